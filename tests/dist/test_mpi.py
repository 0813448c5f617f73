"""The mpi backend under a real `mpiexec` (Open MPI from the `mpi` extra)."""
import os
import re
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


_SCRIPT = '''
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
'''


def _write_script(tmp_path):
    if MPIEXEC is None:
        pytest.skip("mpiexec not found: install the mpi extra (pip install 'ddptrain[mpi]')")
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
    proc = subprocess.Popen([sys.executable, str(script), "sleep"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
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
