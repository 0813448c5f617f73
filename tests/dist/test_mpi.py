"""The mpi backend under a real `mpiexec` (Open MPI from the `mpi` extra), and how
`ddptrain.launch.launch` starts ranks: through mpiexec for backend mpi, spawned otherwise."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import MPIEXEC, PYTHON, REPO, cli_env

# timed: its tests bound durations (scripts/test.sh runs this phase after the parallel one)
pytestmark = [pytest.mark.timed, pytest.mark.dist, pytest.mark.timeout(300)]

ROOT = str(REPO)


def _need_mpiexec():
    if MPIEXEC is None:
        pytest.skip("mpiexec not found: install the mpi extra (pip install 'ddptrain[mpi]')")


def _mpiexec(n, *args, timeout=240):
    _need_mpiexec()
    env = cli_env(PYTHONPATH=ROOT, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1")
    cmd = [MPIEXEC, "-n", str(n), "--oversubscribe", PYTHON, *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def _how_started(rank, world_size):
    import ddptrain.comm as dist
    from ddptrain.launch.env import detect_environment

    return detect_environment().name, rank, world_size, dist.get_backend() if dist.is_initialized() else None


@pytest.mark.parametrize(
    "backend, join_group, launcher, group",
    [
        # join_group=False is the trainer's way (it joins by itself); True is what run_distributed
        # does in every test of tests/dist, on both launchers.
        ("mpi", False, "mpi", None),  # started by mpiexec: the ranks see Open MPI's variables
        ("gloo", False, "torchrun", None),  # spawned: the ranks see the env:// variables of their parent
    ],
)
def test_launch_starts_mpi_ranks_through_mpiexec_and_others_by_spawning(backend, join_group, launcher, group):
    from ddptrain.launch import launch

    if backend == "mpi":
        _need_mpiexec()
    got = launch(_how_started, 2, backend=backend, join_group=join_group, timeout_s=90, comm_timeout_s=60)
    assert got == [(launcher, rank, 2, group) for rank in range(2)]


_DUMP_ENVIRONMENT = "import json, os, sys; json.dump(dict(os.environ), open(f'{sys.argv[1]}/{os.getpid()}.json', 'w'))"


def test_what_open_mpi_sets_is_read_as_mpi_and_pmix_alone_is_refused(tmp_path):
    """The environment of real ranks, read by ddptrain.launch.env: Open MPI 5 sets its own
    OMPI_COMM_WORLD_* and PMIx's PMIX_RANK, but no size for PMIx (that is a PMIx_Get away)."""
    from ddptrain.launch.env import detect_environment, detect_mpi_environment

    proc = _mpiexec(2, "-c", _DUMP_ENVIRONMENT, str(tmp_path), timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    envs = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("*.json"))]
    assert len(envs) == 2, proc.stdout + proc.stderr
    found = [detect_mpi_environment(env) for env in envs]
    layouts = sorted((e.rank, e.world_size, e.local_rank, e.local_world_size) for e in found)
    assert layouts == [(0, 2, 0, 2), (1, 2, 1, 2)]
    assert [detect_environment(e).name for e in envs] == ["mpi", "mpi"]
    pmix_only = {k: v for k, v in envs[0].items() if not k.startswith(("OMPI_", "SLURM_"))}
    assert "PMIX_RANK" in pmix_only and not any(k.startswith("PMIX_SIZE") for k in pmix_only), sorted(pmix_only)
    with pytest.raises(ValueError, match=r"PMIX_RANK=[01] set, but no launcher environment is complete"):
        detect_environment(pmix_only)


def _sleeps(rank, ws, pid_dir):
    import time

    Path(pid_dir, f"rank{rank}.pid").write_text(str(os.getpid()))
    time.sleep(120)


def test_a_stuck_mpi_job_is_killed_at_the_launch_timeout_with_every_rank(tmp_path):
    import time

    from ddptrain.launch import LaunchTimeoutError
    from ddptrain.testing import run_distributed

    _need_mpiexec()
    t0 = time.monotonic()
    with pytest.raises(LaunchTimeoutError, match=r"did not finish within 8 s; rank\(s\) \[0, 1\] still running"):
        run_distributed(_sleeps, 2, str(tmp_path), backend="mpi", timeout_s=8)
    assert time.monotonic() - t0 < 20
    # this job's own ranks, by the pids they wrote (other tests may run MPI jobs meanwhile)
    pids = sorted(int(p.read_text()) for p in tmp_path.glob("rank*.pid"))
    assert len(pids) == 2, pids
    left = [pid for pid in pids if Path(f"/proc/{pid}").exists() and "zombie" not in _state(pid)]
    assert left == [], f"ranks left running: {left}"


def _state(pid: int) -> str:
    try:
        return next(ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith("State:"))
    except (OSError, StopIteration):
        return "zombie (gone)"


def _waits_for_a_late_peer(rank, world_size, late_s):
    """The CPU time rank 1 spends in an all-reduce that rank 0 joins ``late_s`` late."""
    import time

    import torch

    import ddptrain.comm as dist

    t = torch.ones(4)
    dist.all_reduce(t)  # both ranks are up
    started = time.process_time()
    if rank == 0:
        time.sleep(late_s)
    dist.all_reduce(t)
    assert t.tolist() == [4.0] * 4
    return time.process_time() - started


def test_a_rank_waiting_for_a_late_peer_does_not_spin():
    """Waiting is not computing: on a host with more ranks than cores a spinning waiter takes the
    core the late rank needs. Polling eagerly for 3 s used 2.4 s of CPU here; now about 0.15 s."""
    from ddptrain.testing import run_distributed

    _need_mpiexec()
    env = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    cpu_s = run_distributed(_waits_for_a_late_peer, 2, 3.0, backend="mpi", timeout_s=120, env=env)[1]
    # a spinning waiter gets a third of a core even beside two other busy tests: >= 1 s
    assert cpu_s < 0.6, f"rank 1 used {cpu_s:.2f} s of CPU waiting 3 s for rank 0"


def test_world_size_that_differs_from_mpirun_is_refused():
    proc = _mpiexec(2, os.path.join(ROOT, "tests", "mpi_worker.py"), "wrong-size", timeout=60)
    assert "configured for world_size=5 but mpirun started 2 rank(s)" in proc.stdout, proc.stdout + proc.stderr


def test_missing_mpi4py_gives_the_install_command(monkeypatch):
    import ddptrain.comm.backends as backends

    monkeypatch.setitem(sys.modules, "mpi4py", None)
    monkeypatch.delitem(sys.modules, "ddptrain.comm.backends.mpi", raising=False)
    with pytest.raises(Exception, match=r"pip install 'ddptrain\[mpi\]'"):
        backends.create_backend("mpi", None, -1, -1, None)


def test_a_rank_that_crashes_under_mpiexec_ends_the_job():
    import time

    t0 = time.monotonic()
    proc = _mpiexec(2, os.path.join(ROOT, "tests", "mpi_worker.py"), "crash", timeout=90)
    assert proc.returncode != 0
    assert time.monotonic() - t0 < 60
    assert "rank 1 crashes on purpose" in proc.stderr


_SCRIPT = """
import sys, time
sys.path.insert(0, {root!r})
import torch
import ddptrain.comm as dist
from ddptrain.testing import run_distributed


def body(rank, world_size, scale):
    t = torch.ones(2) * (rank + 1) * scale
    dist.all_reduce(t)
    return t.tolist()


def sleeps(rank, world_size):
    import os
    print("rank", rank, "sleeping, pid", os.getpid(), flush=True)
    time.sleep(300)


if __name__ == "__main__":
    if sys.argv[1] == "sum":
        print("RESULT", run_distributed(body, 2, 10.0, backend="mpi", timeout_s=60))
    else:
        run_distributed(sleeps, 2, backend="mpi", timeout_s=300)
"""


def _write_script(tmp_path):
    _need_mpiexec()
    script = tmp_path / "user_script.py"
    script.write_text(_SCRIPT.format(root=ROOT))
    return script


def test_a_function_of_the_users_script_runs_under_mpiexec(tmp_path):
    """run_distributed(backend="mpi") from `python script.py`: the ranks import the script as
    __mp_main__ (as multiprocessing does) to find the function, without running its main block."""
    script = _write_script(tmp_path)
    proc = subprocess.run([sys.executable, str(script), "sum"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "RESULT [[30.0, 30.0], [30.0, 30.0]]" in proc.stdout, proc.stdout + proc.stderr


def test_killing_the_launcher_takes_mpiexec_and_its_ranks_with_it(tmp_path):
    import signal
    import time

    script = _write_script(tmp_path)
    proc = subprocess.Popen(
        [sys.executable, str(script), "sleep"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 60
        seen = ""
        while seen.count("sleeping") < 2 and time.monotonic() < deadline:
            seen += proc.stdout.readline()
        assert seen.count("sleeping") == 2, seen
        ranks = re.findall(r"sleeping, pid (\d+)", seen)
        assert len(ranks) == 2 and all(os.path.exists(f"/proc/{pid}") for pid in ranks), seen
        proc.send_signal(signal.SIGKILL)  # no cleanup code of the launcher runs
        proc.wait(10)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(os.path.exists(f"/proc/{pid}") for pid in ranks):
            time.sleep(0.2)
        left = [pid for pid in ranks if os.path.exists(f"/proc/{pid}")]
        assert left == [], f"ranks {left} outlived their launcher"
    finally:
        proc.kill()
        for pid in re.findall(r"sleeping, pid (\d+)", seen):
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
