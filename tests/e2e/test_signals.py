"""Ctrl-C and SIGTERM on a running job, under each launcher: a prompt, clean stop with a
checkpoint at the interrupt step, one line saying how to resume — and resuming ends bitwise where
an uninterrupted run ends.

Each job trains a small synthetic task whose steps sleep 40 ms (tests/e2e/slow_trainer.py), so
the signal lands in the middle of the run; it is sent once the log shows step 10.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import MPIEXEC, PYTHON, REPO, TORCHRUN, cli_env, descendants, run_cli, sigint_at_default

# timed: its tests bound durations (scripts/test.sh runs this phase after the parallel one)
pytestmark = [pytest.mark.timed, pytest.mark.e2e, pytest.mark.timeout(300)]

JOB = [
    "recipe=synthetic",
    "recipe.trainer_class=tests.e2e.slow_trainer.SlowTrainer",
    "data.num_train_samples=2560",  # 20 steps of 128 per epoch
    "data.num_val_samples=256",
    "trainer.epochs=3",
    "trainer.log_every_steps=5",
    "trainer.progress=false",
]
ENV = {"PYTHONPATH": str(REPO)}


def _alive(pids: list[int], wait_s: float = 5.0) -> list[str]:
    """The processes among ``pids`` still running (zombies awaiting their reaper do not count)."""
    deadline = time.monotonic() + wait_s
    while True:
        alive = []
        for pid in pids:
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
            except OSError:
                continue
            if stat.rsplit(")", 1)[1].split()[0] != "Z":
                alive.append(f"{pid} {cmd}")
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def _sha(run_dir: Path) -> str:
    return json.loads((run_dir / "metrics.json").read_text())["params_sha256"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> str:
    cwd = tmp_path_factory.mktemp("twin")
    proc = run_cli(*JOB, f"hydra.run.dir={cwd / 'run'}", cwd=cwd, env=ENV, timeout=200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return _sha(cwd / "run")


def _start(command: list[str], cwd: Path) -> subprocess.Popen:
    """Start a job in a session of its own, as a terminal would run it in the foreground."""
    return subprocess.Popen(
        command,
        cwd=cwd,
        env=cli_env(**ENV),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=sigint_at_default,
    )


def _wait_for_step(run_dir: Path, proc: subprocess.Popen, step: int = 10, timeout_s: float = 120) -> None:
    _wait_for_line(run_dir, proc, rf"step {step}/", timeout_s)


def _wait_for_line(run_dir: Path, proc: subprocess.Popen, pattern: str, timeout_s: float = 120) -> re.Match:
    log = run_dir / "train.log"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the job ended before a line matching {pattern!r}: {proc.communicate()}")
        found = re.search(pattern, log.read_text()) if log.exists() else None
        if found:
            return found
        time.sleep(0.05)
    pytest.fail(f"no line matching {pattern!r} in {log} within {timeout_s} s")


def _stop_and_check(proc: subprocess.Popen, send, run_dir: Path, signal_name: str, code: int) -> int:
    """Send the signal; the job must end within 10 s with ``code``, one line, a checkpoint; returns
    the interrupt step."""
    job_pids = descendants(proc.pid)
    sent = time.monotonic()
    send()
    try:
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    took = time.monotonic() - sent
    assert took < 10, f"the job took {took:.1f} s to stop"
    assert proc.returncode == code, out + err
    assert "Traceback" not in out + err, out + err
    line = [ln for ln in out.splitlines() if ln.startswith("ddptrain: stopped by")]
    assert len(line) == 1, out
    match = re.match(rf"ddptrain: stopped by {signal_name} at step (\d+) \((\S+)\)\. Resume with: (.+)$", line[0])
    assert match, line[0]
    step = int(match.group(1))
    assert 10 <= step < 60, step
    assert Path(match.group(2)) == run_dir / "checkpoints" / f"step_{step:09d}.pt" and Path(match.group(2)).exists()
    assert f"trainer.resume={run_dir}" in match.group(3)
    assert _alive(job_pids) == [], "processes left running"
    return step


def _resume(cwd: Path, run_dir: Path, *extra: str) -> str:
    proc = run_cli(
        *JOB, *extra, f"trainer.resume={run_dir}", f"hydra.run.dir={cwd / 'resumed'}", cwd=cwd, env=ENV, timeout=200
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return _sha(cwd / "resumed")


def test_ctrl_c_on_the_local_launcher(tmp_path, uninterrupted):
    run_dir = tmp_path / "run"
    proc = _start([PYTHON, "-m", "ddptrain", *JOB, f"hydra.run.dir={run_dir}"], tmp_path)
    _wait_for_step(run_dir, proc)
    # A terminal's Ctrl-C: SIGINT to the foreground process group (the ranks sit in groups of their own).
    _stop_and_check(proc, lambda: os.killpg(proc.pid, signal.SIGINT), run_dir, "SIGINT", 130)
    assert _resume(tmp_path, run_dir) == uninterrupted


def test_ctrl_c_stops_an_elastic_job_after_a_change_and_its_resume_ends_bitwise(tmp_path):
    """Ctrl-C keeps its meaning in an elastic job: after a member was lost and the spare took its
    place, the members stop with a checkpoint; the workers that were waiting to be admitted end too
    and are not restarted, and the job's store stays up until the ranks are done with it."""
    elastic = ["trainer.world_size_invariant=true", "trainer.elastic=true", "dist.world_size=4"]
    elastic += ["launcher.spares=1", "launcher.max_restarts=2"]
    run_dir = tmp_path / "run"
    proc = _start([PYTHON, "-m", "ddptrain", *JOB, *elastic, f"hydra.run.dir={run_dir}"], tmp_path)
    # Rank 0's member, which says so: of the 5 members, the first 4 to register are the ranks and
    # which one waits as the spare is a race, so killing a member by its slot may kill the spare.
    member = _wait_for_line(run_dir, proc, r"elastic: member (\S+) \(pid (\d+)\) joined generation 0 as rank 0")
    _wait_for_step(run_dir, proc)
    os.kill(int(member.group(2)), signal.SIGKILL)
    _wait_for_line(run_dir, proc, rf"elastic: generation \d+: lost {re.escape(member.group(1))}")
    _stop_and_check(proc, lambda: os.killpg(proc.pid, signal.SIGINT), run_dir, "SIGINT", 130)
    log = (run_dir / "train.log").read_text()
    after = log.split("SIGINT: the ranks stop")[1]
    assert "starts again" not in after, log  # nothing restarted after the stop
    assert "failed:" not in after, log  # a rank that lost the store on its way out reports a failure
    reference = run_cli(*JOB, elastic[0], f"hydra.run.dir={tmp_path / 'reference'}", cwd=tmp_path, env=ENV, timeout=200)
    assert reference.returncode == 0, reference.stdout + reference.stderr
    assert _resume(tmp_path, run_dir, *elastic) == _sha(tmp_path / "reference")


def test_ctrl_c_at_one_torchrun_of_an_elastic_job_stops_the_other_without_a_restart(tmp_path):
    """An elastic job of two torchruns (one per "host", here both on loopback) joined by the job's
    store. Ctrl-C at one of them stops every rank with a checkpoint; the other torchrun's worker,
    which got no signal, exits 0, so its torchrun (--max-restarts 1) does not start it again into
    a job that has stopped."""
    store = subprocess.Popen(
        [PYTHON, "-m", "ddptrain.store", "--port", "0"], stdout=subprocess.PIPE, text=True, env=cli_env(**ENV)
    )
    run_dir = tmp_path / "run"
    args = [*JOB, "trainer.world_size_invariant=true", "trainer.elastic=true", "dist.world_size=2"]
    try:
        address = store.stdout.readline().split()[-1]
        command = [TORCHRUN, "--standalone", "--nproc-per-node=1", "--max-restarts=1", "--monitor-interval=0.1"]
        command += ["-m", "ddptrain", *args, f"dist.elastic_store={address}", f"hydra.run.dir={run_dir}"]
        here, there = _start(command, tmp_path), _start(command, tmp_path)
        try:
            _wait_for_step(run_dir, here)
            os.killpg(here.pid, signal.SIGINT)  # the terminal's Ctrl-C, at one host's torchrun
            out, err = there.communicate(timeout=30)
            here.communicate(timeout=30)
        finally:
            for proc in (here, there):
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
    finally:
        store.kill()
        store.wait()
    assert there.returncode == 0, out + err
    assert "exitcode" not in err and "Restarting" not in err, err  # torchrun restarted no worker
    log = (run_dir / "train.log").read_text()
    stopped = re.search(r"stopped by SIGINT: step=(\d+)", log)
    assert stopped, log[-3000:]
    assert (run_dir / "checkpoints" / f"step_{int(stopped.group(1)):09d}.pt").exists(), log[-3000:]


def test_sigterm_to_the_local_launcher_with_mpi_ranks(tmp_path, uninterrupted):
    if MPIEXEC is None:
        pytest.skip("no mpiexec")
    run_dir = tmp_path / "run"
    proc = _start([PYTHON, "-m", "ddptrain", *JOB, "backend=mpi", f"hydra.run.dir={run_dir}"], tmp_path)
    _wait_for_step(run_dir, proc)
    # What a scheduler does: SIGTERM to the launching process alone.
    _stop_and_check(proc, lambda: os.kill(proc.pid, signal.SIGTERM), run_dir, "SIGTERM", 143)
    assert _resume(tmp_path, run_dir, "backend=mpi") == uninterrupted


def test_ctrl_c_under_torchrun(tmp_path, uninterrupted):
    """Through ``ddptrain torchrun``: torchrun itself ends a Ctrl-C with its SignalException's
    traceback and 1; the wrapper ends it with one line and 130, as every other launcher does."""
    run_dir = tmp_path / "run"
    command = [
        PYTHON,
        "-m",
        "ddptrain",
        "torchrun",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "ddptrain",
        *JOB,
        "launcher=torchrun",
        f"hydra.run.dir={run_dir}",
    ]
    proc = _start(command, tmp_path)
    _wait_for_step(run_dir, proc)
    job_pids = descendants(proc.pid)
    sent = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)  # the terminal's Ctrl-C reaches torchrun and its workers
    try:
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert time.monotonic() - sent < 10
    assert proc.returncode == 130, out + err
    assert "Traceback" not in err and "ddptrain: torchrun stopped by SIGINT" in err, err
    step = int(re.search(r"ddptrain: stopped by SIGINT at step (\d+)", out).group(1))
    assert (run_dir / "checkpoints" / f"step_{step:09d}.pt").exists()
    assert "Resume with: the same launch command with the arguments" in out
    assert _alive(job_pids) == [], "processes left running"
    assert _resume(tmp_path, run_dir) == uninterrupted


@pytest.mark.parametrize(
    "launch, how",
    [("local", "SIGTERM to the launcher"), ("mpi", "Ctrl-C"), ("torchrun", "SIGTERM to the launcher")],
)
def test_the_other_signal_on_each_launcher_stops_with_a_checkpoint(tmp_path, launch, how):
    """The remaining launcher x signal pairs: a prompt stop with the checkpoint (resuming from such a
    checkpoint is shown bitwise above, once per launcher)."""
    if launch == "mpi" and MPIEXEC is None:
        pytest.skip("no mpiexec")
    run_dir = tmp_path / "run"
    args = [*JOB, f"hydra.run.dir={run_dir}"]
    command = {
        "local": [PYTHON, "-m", "ddptrain", *args],
        "mpi": [PYTHON, "-m", "ddptrain", *args, "backend=mpi"],
        "torchrun": [TORCHRUN, "--standalone", "--nproc-per-node=2", "-m", "ddptrain", *args, "launcher=torchrun"],
    }[launch]
    proc = _start(command, tmp_path)
    _wait_for_step(run_dir, proc)
    if how == "Ctrl-C":
        send, name, code = (lambda: os.killpg(proc.pid, signal.SIGINT)), "SIGINT", 130
    else:
        send, name, code = (lambda: os.kill(proc.pid, signal.SIGTERM)), "SIGTERM", 143
    if launch == "torchrun":  # torchrun's own exit code and output are torchrun's; the ranks' line is ours
        job_pids = descendants(proc.pid)
        sent = time.monotonic()
        send()
        out, _ = proc.communicate(timeout=30)
        assert time.monotonic() - sent < 10
        step = int(re.search(rf"ddptrain: stopped by {name} at step (\d+)", out).group(1))
        assert (run_dir / "checkpoints" / f"step_{step:09d}.pt").exists()
        assert _alive(job_pids) == [], "processes left running"
        return
    _stop_and_check(proc, send, run_dir, name, code)
