"""``ddptrain doctor`` on real process groups: each injected cause comes out first.

One spawned world per backend and size runs every scenario (a fit each, reusing the group),
because spawning costs seconds on two busy cores. The injected causes are large (sleeps of
tenths of a second against steps of milliseconds, a hundred all-reduces where one would do) so
that the diagnosis holds on a loaded machine. The slow link runs in a private network namespace
whose loopback is rate-limited to 50 Mbit/s (root, ``unshare`` and ``tc`` needed).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

from ddptrain.doctor.diagnose import ROOT_CAUSES_OF, _min_share
from ddptrain.testing import run_distributed
from tests.conftest import MPIEXEC, PYTHON, REPO, cli_env, run_cli
from tests.doctor.tasks import run_doctored

# alone: its tests measure speed (scripts/test.sh runs them last, one at a time)
pytestmark = [pytest.mark.alone, pytest.mark.dist, pytest.mark.timeout(400)]


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


# what each injected cause's advice names
ADVICE = {
    "data_loading": "data.num_workers=",
    "straggler": "dist.world_size",
    "small_buckets": "dist.bucket_cap_mb=25",
    "find_unused_overhead": "dist.find_unused_parameters=false",
    "cpu_oversubscribed": "dist.threads_per_worker=",
}
# the share of the step these scenarios' causes take at least, as the only cause: a 0.4 s sleep and
# 5 ms per sample (160 ms for 32) against ~10 ms of work, far from any threshold on a loaded host
LARGE = {"data": 0.5, "straggler": 0.8}


def _sound(report: dict, world_size: int, steps: int) -> None:
    """What holds for any report: its shape, each cause above its rule's minimum share, ranked
    largest first (a straggler after its likely root cause)."""
    assert report["world_size"] == world_size and len(report["per_rank"]) == world_size
    assert report["breakdown"]["steps"] == steps
    causes = report["causes"]
    if [c["cause"] for c in causes] == ["healthy"]:
        assert causes[0]["predicted_step_s"] == pytest.approx(report["step_s"])
        return
    assert all(c["share"] >= _min_share(c["cause"]) for c in causes), causes
    names = {c["cause"] for c in causes}
    late = [c for c in causes if any(r in names for r in ROOT_CAUSES_OF.get(c["cause"], ()))]
    ranked = [c for c in causes if c not in late]
    assert causes == ranked + late, causes
    assert [c["share"] for c in ranked] == sorted((c["share"] for c in ranked), reverse=True), causes


def _host_straggler(report: dict, cause: str) -> bool:
    """Whether a scenario that injected no straggler got one first: another job on this shared
    2-core host can make one rank a real straggler for a few steps."""
    return cause != "straggler" and report["causes"][0]["cause"] == "straggler"


def _check(reports: list[dict], cases: list, world_size: int) -> None:
    """Each scenario's first cause is the injected one, with its advice and a shorter predicted
    step; the large ones (a 0.4 s sleep, 5 ms per sample) alone and nearly the whole step."""
    summary = {name: [(c["cause"], c["share"]) for c in r["causes"]] for (name, _, _), r in zip(cases, reports)}
    for (_, kwargs, _), r in zip(cases, reports):
        _sound(r, world_size, kwargs.get("steps", 6))
    got = {name: (r["causes"][0]["cause"], r["causes"][0].get("rank")) for (name, _, _), r in zip(cases, reports)}
    want = {name: (cause, world_size - 1 if cause == "straggler" else None) for name, _, cause in cases}
    assert got == want, json.dumps(summary, indent=1)
    for (name, _, cause), r in zip(cases, reports):
        first = r["causes"][0]
        if cause == "healthy":
            assert len(r["causes"]) == 1, summary[name]
            continue
        assert ADVICE[cause] in first["advice"], (name, first["advice"])
        assert first["predicted_step_s"] < r["step_s"], (name, first)
        if name in LARGE:
            assert len(r["causes"]) == 1 and first["share"] >= LARGE[name], json.dumps(summary, indent=1)
    straggler = next(r for (name, _, _), r in zip(cases, reports) if name == "straggler")
    # once the 0.4 s sleep is gone, a step of the others' ~10 ms of work and the link's time
    assert straggler["causes"][0]["predicted_step_s"] < 0.1 * straggler["step_s"], straggler["causes"]


@pytest.mark.parametrize(
    "backend,world_size",
    [
        ("gloo", 2),
        pytest.param("mpi", 2, marks=pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec")),
        # more than two ranks on one backend; mpi at 3 ranks adds no rule the two runs above miss
        pytest.param("gloo", 3, marks=pytest.mark.slow),
    ],
)
def test_each_injected_cause_comes_out_first(tmp_path, backend, world_size):
    # small buckets on CPU ranks: the all-reduces steal cores from backward, so much of their cost
    # shows as backward; the doctor's probe (compute without communication) tells them apart
    cases = scenarios(world_size)

    rounds: list[Path] = []

    def doctored(chosen: list) -> list[dict]:
        runs = [(name, kwargs) for name, kwargs, _ in chosen]
        out = tmp_path / f"round{len(rounds)}"
        rounds.append(out)
        return run_distributed(run_doctored, world_size, runs, str(out), backend=backend, timeout_s=360)[0]

    reports = doctored(cases)
    # A scenario whose first cause is a straggler it did not inject runs once more, and the rerun
    # must give its own cause (the discarded report must still be sound). Any other wrong cause
    # fails at once.
    again = [i for i, (_, _, cause) in enumerate(cases) if _host_straggler(reports[i], cause)]
    for i in again:
        _sound(reports[i], world_size, cases[i][1].get("steps", 6))
    if again:
        for i, report in zip(again, doctored([cases[i] for i in again])):
            reports[i] = report
    _check(reports, cases, world_size)


_SLOW_LINK = (
    "ip link set lo up && ip link set lo mtu 1500 && "
    "tc qdisc add dev lo root tbf rate 50mbit burst 32kbit latency 400ms"
)
_SLOW_RUN = """
import json, sys
from ddptrain.testing import run_distributed
from tests.doctor.tasks import run_doctored
if __name__ == "__main__":
    ws = int(sys.argv[3])
    # samples a rank: the longer backward, the smaller the link's share of the step (what smaller
    # buckets save), which must clear the 10% a cause needs with room for a slow 2-core host (at 512
    # and 768 it sat at 0.10-0.12 there, at 256 at 0.16-0.20); backward (~35 ms) still outlasts
    # fc1's all-reduce (~10-14 ms over 50 Mbit/s)
    B = 256
    runs = [
        ("slow_link", dict(model={"kind": "mlp", "layers": 4, "width": 256}, batch=16 * ws, steps=4)),
        # one bucket for the tutorial Net: fc1's 64 kB (ready early) could go out while the
        # convolutions' backward runs (~35 ms for 256 samples); over 50 Mbit/s that is most of the link's time
        ("no_overlap", dict(model={"kind": "net"}, batch=B * ws, samples=B * ws * 20, steps=8)),
    ]
    reports = run_distributed(run_doctored, ws, runs, sys.argv[1], backend=sys.argv[2], timeout_s=200)[0]
    print("REPORT " + json.dumps(reports))
"""


_MPI = [pytest.mark.slow, pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec")]


@pytest.mark.parametrize(
    "backend,world_size",
    [("gloo", 2), pytest.param("gloo", 3, marks=pytest.mark.slow), pytest.param("mpi", 2, marks=_MPI)],
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

    # The one-bucket run's link is as slow, so whether no_overlap or slow_network ranks first sits
    # within noise on this 2-core host (near the 10% line). What must hold either way: its report
    # tells the user to split the one bucket (both causes' advice name a smaller dist.bucket_cap_mb),
    # and one second run is allowed, as the healthy run has.
    def splits_the_bucket(causes: list[dict]) -> bool:
        return any("dist.bucket_cap_mb=0.0" in c["advice"] for c in causes)

    report, one_bucket = run(0)
    if report["causes"][0]["cause"] != "slow_network" or not splits_the_bucket(one_bucket["causes"]):
        report, one_bucket = run(1)
    first = report["causes"][0]
    assert first["cause"] == "slow_network", report["causes"]
    assert report["link"]["busbw_GBps"] < 0.05  # the 50 Mbit/s (0.00625 GB/s) link, not loopback's GB/s
    assert splits_the_bucket(one_bucket["causes"]), one_bucket["causes"]


@pytest.fixture(scope="module")
def doctor_cli(tmp_path_factory):
    """``python -m ddptrain.doctor`` as a user runs it: (console text, run dir)."""
    tmp = tmp_path_factory.mktemp("doctor_cli")
    run_dir = tmp / "run"
    args = ["recipe=synthetic", "data.num_train_samples=4096", "data.num_val_samples=200", f"hydra.run.dir={run_dir}"]
    proc = run_cli("doctor", *args, cwd=tmp, timeout=200)  # ddptrain doctor, as the README names it
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr, run_dir


def test_the_doctor_cli_describes_its_window_not_the_epochs_it_skips(doctor_cli):
    text, _ = doctor_cli
    assert "doctor window: 13 steps (3 warm-up + 10 measured) on 2 rank(s)" in text, text
    assert "epoch(s);" not in text, text  # no "N step(s) per epoch, 10 epoch(s)" plan
    totals = set(re.findall(r"\bstep \d+/(\d+)", text))
    assert totals == {"13"}, f"step lines count to {totals}, not the window's 13 steps:\n{text}"


def test_the_doctor_cli_says_its_scaling_is_weak(doctor_cli):
    text, run_dir = doctor_cli
    assert "scaling (weak: 64 samples per rank, global batch grows with the world size;" in text, text
    report = json.loads((run_dir / "doctor.json").read_text())
    assert report["scaling_mode"]["kind"] == "weak" and report["scaling_mode"]["samples_per_rank"] == 64
    assert [s["global_batch_size"] for s in report["scaling"]] == [64 * s["world_size"] for s in report["scaling"]]


def test_the_doctor_cli_names_each_file_it_wrote_and_only_what_exists(doctor_cli):
    text, run_dir = doctor_cli
    lines = text.splitlines()
    first = next(i for i, ln in enumerate(lines) if ln.startswith("written: "))
    named = [ln.split()[1 if i == 0 else 0] for i, ln in enumerate(lines[first : first + 3])]
    assert named == [str(run_dir / "doctor.json"), str(run_dir / "doctor_trace.json"), f"{run_dir / 'tensorboard'}/"]
    assert all(Path(p).exists() for p in named), named
    summary = next(ln for ln in lines if ln.startswith("ddptrain: outputs"))
    on_disk = sorted(p.name + "/" * p.is_dir() for p in run_dir.iterdir() if not p.name.startswith("."))
    assert "checkpoints/" not in on_disk and summary == f"ddptrain: outputs in {run_dir}: {', '.join(on_disk)}"
