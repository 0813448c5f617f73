"""``ddptrain doctor`` on real process groups: each injected cause comes out first.

One spawned world per backend and size runs every scenario (a fit each, reusing the group),
because spawning costs seconds on two busy cores. The injected causes are large (sleeps of
tenths of a second against steps of milliseconds, a hundred all-reduces where one would do) so
that the diagnosis holds on a loaded machine. The slow link runs in a private network namespace
whose loopback is rate-limited to 50 Mbit/s (root, ``unshare`` and ``tc`` needed).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import textwrap

import pytest

from ddptrain.testing import run_distributed
from tests.conftest import MPIEXEC, PYTHON, REPO, cli_env
from tests.doctor_tasks import run_doctored

pytestmark = [pytest.mark.dist, pytest.mark.timeout(400)]


def scenarios(world_size: int, backend: str = "gloo") -> list[tuple[str, dict, str]]:
    """``(name, doctor_config kwargs, expected first cause)``."""
    last = world_size - 1
    batch = 32 * world_size
    return [
        ("healthy", dict(model={"kind": "net"}, batch=batch, steps=10), "healthy"),
        ("data", dict(model={"kind": "net", "sleep_s": 0.005}, batch=batch), "data_loading"),
        ("straggler", dict(model={"kind": "net", "slow_rank": last, "slow_s": 0.4}, batch=batch), "straggler"),
        (
            "small_buckets",
            dict(
                model={"kind": "mlp", "layers": 100, "width": 128}, dist={"bucket_cap_mb": 0.05}, batch=8 * world_size
            ),
            "small_buckets",
        ),
        (
            "find_unused",
            dict(
                model={"kind": "mlp", "layers": 200, "width": 8},
                dist={"find_unused_parameters": True},
                batch=4 * world_size,
            ),
            "find_unused_overhead",
        ),
        (
            "oversubscribed",
            dict(model={"kind": "net"}, dist={"threads_per_worker": 4}, batch=128 * world_size),
            "cpu_oversubscribed",
        ),
    ]


def _check(reports: list[dict], cases: list, world_size: int) -> None:
    """Each scenario's first cause is the injected one. The healthy run has one second chance:
    another job on this shared 2-core host can make one rank a real straggler for a few steps."""
    if reports[0]["causes"][0]["cause"] != "healthy":
        reports, cases = reports[1:], cases[1:]
    else:
        reports, cases = reports[:1] + reports[2:], cases[:1] + cases[2:]
    got = {name: (r["causes"][0]["cause"], r["causes"][0].get("rank")) for (name, _, _), r in zip(cases, reports)}
    want = {name: (cause, world_size - 1 if cause == "straggler" else None) for name, _, cause in cases}
    summary = {name: [(c["cause"], c["share"]) for c in r["causes"]] for (name, _, _), r in zip(cases, reports)}
    assert got == want, json.dumps(summary, indent=1)
    for r in reports:
        assert r["world_size"] == world_size and len(r["per_rank"]) == world_size


@pytest.mark.parametrize(
    "backend,world_size",
    [
        ("gloo", 2),
        pytest.param("mpi", 2, marks=pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec")),
        pytest.param("gloo", 3, marks=pytest.mark.slow),
        pytest.param("mpi", 3, marks=[pytest.mark.slow, pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec")]),
    ],
)
def test_each_injected_cause_comes_out_first(tmp_path, backend, world_size):
    # small buckets on CPU ranks: the all-reduces steal cores from backward, so much of their cost
    # shows as backward; the doctor's probe (compute without communication) tells them apart
    cases = scenarios(world_size)
    cases.insert(1, ("healthy_again", *cases[0][1:]))
    runs = [(name, kwargs) for name, kwargs, _ in cases]
    reports = run_distributed(run_doctored, world_size, runs, str(tmp_path), backend=backend, timeout_s=360)[0]
    _check(reports, cases, world_size)


_SLOW_LINK = (
    "ip link set lo up && ip link set lo mtu 1500 && "
    "tc qdisc add dev lo root tbf rate 50mbit burst 32kbit latency 400ms"
)
_SLOW_RUN = """
import json, sys
from ddptrain.testing import run_distributed
from tests.doctor_tasks import run_doctored
if __name__ == "__main__":
    ws = int(sys.argv[3])
    # samples a rank: at 3 ranks on 2 cores backward must outlast more bytes, but not by so much that
    # the link's share (what smaller buckets save) nears the 10% a cause needs: with 1024 mpi's was
    # under 0.10 (healthy) in 8 of 11 runs today, with 768 0.13 (gloo 0.18-0.19)
    B = 512 if ws == 2 else 768
    runs = [
        ("slow_link", dict(model={"kind": "mlp", "layers": 4, "width": 256}, batch=16 * ws, steps=4)),
        # one bucket for the tutorial Net: fc1's 64 kB (ready early) could go out while the
        # convolutions' backward runs (~70 ms for 512 samples); over 50 Mbit/s that is most of the link's time
        ("no_overlap", dict(model={"kind": "net"}, batch=B * ws, samples=B * ws * 20, steps=8)),
    ]
    reports = run_distributed(run_doctored, ws, runs, sys.argv[1], backend=sys.argv[2], timeout_s=200)[0]
    print("REPORT " + json.dumps(reports))
"""


_MPI = [pytest.mark.slow, pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec")]


@pytest.mark.parametrize(
    "backend,world_size",
    [("gloo", 2), pytest.param("gloo", 3, marks=pytest.mark.slow), pytest.param("mpi", 2, marks=_MPI)]
    + [pytest.param("mpi", 3, marks=_MPI)],
)
def test_a_rate_limited_link_is_slow_network_and_one_big_bucket_there_no_overlap(tmp_path, backend, world_size):
    if not (shutil.which("unshare") and shutil.which("tc")) or subprocess.run(["unshare", "-n", "true"]).returncode:
        pytest.skip("needs root with unshare -n and tc (a private, rate-limited loopback)")
    script = tmp_path / "slow_link.py"
    script.write_text(textwrap.dedent(_SLOW_RUN))
    env = cli_env(PYTHONPATH=str(REPO), OMPI_MCA_btl="self,tcp", OMPI_MCA_btl_tcp_if_include="lo")

    def run(attempt: int) -> list[dict]:
        out = tmp_path / f"run{attempt}"
        out.mkdir()
        command = f"{_SLOW_LINK} && exec {PYTHON} {script} {out} {backend} {world_size}"
        done = subprocess.run(
            ["unshare", "-n", "bash", "-c", command], env=env, capture_output=True, text=True, timeout=300, cwd=REPO
        )
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("REPORT ")]
        assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
        return json.loads(lines[0].removeprefix("REPORT "))

    # One second run, as the healthy run has: the one-bucket run's causes sit near the 10% line on
    # this shared 2-core host (a CI-style run, 2026-12-02, gloo at 2 ranks: slow_network 15% first,
    # no_overlap under 10%; it had passed in every earlier CI run).
    report, one_bucket = run(0)
    if report["causes"][0]["cause"] != "slow_network" or one_bucket["causes"][0]["cause"] != "no_overlap":
        report, one_bucket = run(1)
    first = report["causes"][0]
    assert first["cause"] == "slow_network", report["causes"]
    assert report["link"]["busbw_GBps"] < 0.05  # the 50 Mbit/s (0.00625 GB/s) link, not loopback's GB/s
    first = one_bucket["causes"][0]
    assert first["cause"] == "no_overlap" and "dist.bucket_cap_mb=0.0" in first["advice"], one_bucket["causes"]
