"""The mpi backend under a real `mpiexec` (Open MPI from the `mpi` extra)."""
import os
import shutil
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MPIEXEC = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")


def _mpiexec(n, *args, timeout=240):
    if MPIEXEC is None:
        pytest.skip("mpiexec not found: install the mpi extra (pip install 'ddptrain[mpi]')")
    env = dict(os.environ, PYTHONPATH=ROOT, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMP_NUM_THREADS="1")
    cmd = [MPIEXEC, "-n", str(n), "--oversubscribe", sys.executable, os.path.join(ROOT, "tests", "mpi_worker.py"), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def _sleeps(rank, ws):
    import time
    time.sleep(120)


def test_a_stuck_mpi_job_is_killed_at_the_launch_timeout_with_every_rank():
    import time
    from ddptrain.launch import LaunchTimeoutError
    from ddptrain.testing import run_distributed
    if MPIEXEC is None:
        pytest.skip("mpiexec not found: install the mpi extra (pip install 'ddptrain[mpi]')")
    t0 = time.monotonic()
    with pytest.raises(LaunchTimeoutError, match=r"did not finish within 8 s; rank\(s\) \[0, 1\] still running"):
        run_distributed(_sleeps, 2, backend="mpi", timeout_s=8)
    assert time.monotonic() - t0 < 20
    left = subprocess.run(["pgrep", "-f", "ddptrain.launch.mpi_entry"], capture_output=True, text=True).stdout
    assert left.strip() == "", f"ranks left running: {left}"


def test_world_size_that_differs_from_mpirun_is_refused():
    proc = _mpiexec(2, "wrong-size", timeout=60)
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
    proc = _mpiexec(2, "crash", timeout=90)
    assert proc.returncode != 0
    assert time.monotonic() - t0 < 60
    assert "rank 1 crashes on purpose" in proc.stderr
