"""Faults in a real CLI job: `kill -9` of rank 1 ends the job promptly; with restarts it finishes,
with exactly the parameters of the same job left alone.

The job runs `python -m ddptrain` as a subprocess; rank 1 is the second worker the launcher
spawned (workers start in rank order) and is killed with SIGKILL once the first checkpoint exists.
Each restart test runs an uninterrupted twin next to the interrupted job (at the same time: on
2 cores their start-ups overlap) and compares the final parameters' checksum (metrics.json).
Most use recipe=synthetic; one runs an epoch of real MNIST.
"""

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import PYTHON, REPO, TORCHRUN, children, cli_env, spawned_workers

# timed: its tests bound durations (scripts/test.sh runs this phase after the parallel one)
pytestmark = [pytest.mark.timed, pytest.mark.e2e, pytest.mark.timeout(300)]

# 3 epochs of 47 steps: the kill after step 10's checkpoint comes long before the end.
SYNTHETIC = [
    "recipe=synthetic",
    "trainer.epochs=3",
    "data.num_train_samples=6000",
    "data.num_val_samples=200",
    "trainer.checkpoint.every_steps=10",
    "trainer.progress=false",
    "trainer.loggers.tensorboard=false",
    "dist.timeout_s=30",
]


def _popen(command, env=None):
    return subprocess.Popen(
        command,
        cwd=REPO,
        env=cli_env(**(env or {})),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _start(run_dir, *overrides, env=None):
    return _popen([PYTHON, "-m", "ddptrain", *SYNTHETIC, f"hydra.run.dir={run_dir}", *overrides], env)


def _finish(jobs, timeout_s):
    """Wait for every job; kill the process groups of those that outlive ``timeout_s``."""
    outputs = []
    try:
        for job in jobs:
            outputs.append(job.communicate(timeout=timeout_s)[0])
    finally:
        for job in jobs:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
    return outputs


def _same_end_as_the_twin(run_dir, twin_dir):
    """The interrupted job ends exactly where the uninterrupted one does: parameters, loss, history."""
    metrics = json.loads((run_dir / "metrics.json").read_text())
    twin = json.loads((twin_dir / "metrics.json").read_text())
    assert metrics["params_agree"] and twin["params_agree"]
    assert metrics["step"] == twin["step"], (metrics, twin)
    assert metrics["params_sha256"] == twin["params_sha256"], (metrics, twin)
    assert metrics["eval/loss"] == twin["eval/loss"]
    # the logged losses survive the restart: the run reports its real first loss, not the restart's
    assert metrics["train/loss_first"] == twin["train/loss_first"], (metrics, twin)


def _kill_rank_1_after_first_checkpoint(proc, run_dir, timeout_s=120):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if list((run_dir / "checkpoints").glob("step_*.pt")):
            workers = spawned_workers(proc.pid)
            if len(workers) == 2:
                os.kill(workers[1], signal.SIGKILL)
                return time.monotonic(), workers
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    out = proc.stdout.read() if proc.poll() is not None else ""
    proc.kill()
    pytest.fail(f"no checkpoint / rank 1 to kill within {timeout_s} s: {out[-3000:]}")


def test_kill_9_of_rank_1_ends_the_job_naming_it(tmp_path):
    run_dir = tmp_path / "run"
    proc = _start(run_dir)
    killed_at, workers = _kill_rank_1_after_first_checkpoint(proc, run_dir)
    try:
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert time.monotonic() - killed_at < 30
    assert proc.returncode != 0
    assert "rank 1" in out and "SIGKILL" in out, out[-3000:]
    alive = [
        pid
        for pid in workers
        if Path(f"/proc/{pid}").exists()
        and "Z" not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    ]
    assert alive == [], f"workers {alive} outlived the job"


def test_max_restarts_resumes_from_the_last_checkpoint_and_finishes(tmp_path):
    twin = _start(tmp_path / "twin")
    proc = _start(tmp_path / "run", "launcher.max_restarts=1")
    try:
        _kill_rank_1_after_first_checkpoint(proc, tmp_path / "run")
    finally:
        out, twin_out = _finish([proc, twin], timeout_s=240)
    assert proc.returncode == 0, out[-4000:]
    assert twin.returncode == 0, twin_out[-4000:]
    assert re.search(r"rank 1 failed .*restart 1 of 1, resuming from latest", out), out[-4000:]
    resumed = re.search(r"resumed from \S+step_0*(\d+)\.pt: step (\d+)", out)
    assert resumed and int(resumed.group(2)) >= 10, out[-4000:]
    assert "finished on 2 rank(s)" in out
    _same_end_as_the_twin(tmp_path / "run", tmp_path / "twin")


def _rank_from_environ(pid):
    try:
        for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
            if item.startswith(b"RANK="):
                return int(item[5:])
    except OSError:
        pass
    return None


def test_torchrun_max_restarts_resumes_from_the_last_checkpoint(tmp_path):
    """torchrun restarts the workers; the trainer sees TORCHELASTIC_RESTART_COUNT and resumes."""

    def torchrun(run_dir):
        prefix = [TORCHRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "-m", "ddptrain"]
        return _popen([*prefix, *SYNTHETIC, "launcher=torchrun", f"hydra.run.dir={run_dir}"])

    run_dir = tmp_path / "run"
    twin, proc = torchrun(tmp_path / "twin"), torchrun(run_dir)
    try:
        deadline = time.monotonic() + 120
        killed = False
        while time.monotonic() < deadline and not killed and proc.poll() is None:
            if list((run_dir / "checkpoints").glob("step_*.pt")):
                for child in children(proc.pid):
                    if _rank_from_environ(child) == 1:
                        os.kill(child, signal.SIGKILL)
                        killed = True
            time.sleep(0.2)
        assert killed, "rank 1 was not found to kill"
    finally:
        out, twin_out = _finish([proc, twin], timeout_s=240)
    assert proc.returncode == 0, out[-4000:]
    assert twin.returncode == 0, twin_out[-4000:]
    assert "torchrun restart 1: resuming from the latest checkpoint" in out, out[-4000:]
    resumed = re.search(r"resumed from \S+: step (\d+)", out)
    assert resumed and int(resumed.group(1)) >= 10, out[-4000:]
    _same_end_as_the_twin(run_dir, tmp_path / "twin")


# -- the must-show on real MNIST: kill -9 of rank 1 with launcher.max_restarts=1 ------------------
MNIST_ONE_EPOCH = [
    "recipe=mnist",
    "trainer.epochs=1",
    "trainer.checkpoint.every_steps=100",
    "trainer.progress=false",
    "trainer.loggers.tensorboard=false",
    "dist.timeout_s=30",
]


def _session_processes(sid, settle_s: float = 5.0):
    """Live (non-zombie) processes of session ``sid`` (whatever a job started with
    start_new_session left), once those already exiting are gone: a killed rank reparented to
    init can still be tearing down (state R, its command line already empty) just after the job
    returned. A process still there after ``settle_s`` outlived the job."""
    deadline = time.monotonic() + settle_s
    while True:
        alive = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":
                alive.append(int(stat.parent.name))
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def _final_accuracy(out):
    found = re.search(r"finished on 2 rank\(s\) at step (\d+) .*eval/accuracy=([0-9.]+)", out)
    assert found, out[-4000:]
    return int(found.group(1)), float(found.group(2))


def test_mnist_kill_9_with_max_restarts_ends_like_an_uninterrupted_run(tmp_path, mnist_root):
    """One epoch of the MNIST recipe, rank 1 SIGKILLed after the step-100 checkpoint: the job
    restarts once, resumes from that checkpoint, and ends with the accuracy and the parameters
    (checksum) of the same run left alone — exact resume."""
    data = {"DDPTRAIN_DATA": str(mnist_root)}  # prepared by the loader: both jobs only read it
    command = [PYTHON, "-m", "ddptrain", *MNIST_ONE_EPOCH]
    reference = _popen([*command, f"hydra.run.dir={tmp_path / 'ref'}"], data)
    proc = _popen([*command, "launcher.max_restarts=1", f"hydra.run.dir={tmp_path / 'run'}"], data)
    run_dir = tmp_path / "run"
    try:
        _, first_workers = _kill_rank_1_after_first_checkpoint(proc, run_dir)
    finally:
        out, reference_out = _finish([proc, reference], timeout_s=150)
    assert reference.returncode == 0, reference_out[-3000:]
    assert proc.returncode == 0, out[-4000:]
    assert re.search(
        rf"rank 1 failed \(rank 1 \(pid {first_workers[1]}\) killed by signal SIGKILL.*\); restart 1 of 1, "
        r"resuming from latest",
        out,
    ), out[-4000:]
    resumed = re.search(r"resumed from \S+step_0*(\d+)\.pt: step (\d+), epoch 1", out)
    assert resumed and int(resumed.group(2)) == int(resumed.group(1)) >= 100, out[-4000:]
    assert "[launcher][WARNING] rank 1 failed" in (run_dir / "train.log").read_text()  # the launcher logs there too
    assert "resumed from" in (run_dir / "train.log").read_text()  # rank 0's, appended by both attempts
    step, accuracy = _final_accuracy(out)
    ref_step, ref_accuracy = _final_accuracy(reference_out)
    assert step == ref_step == 469 and accuracy > 0.85, out[-2000:]
    assert accuracy == ref_accuracy, (accuracy, ref_accuracy)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    ref_metrics = json.loads((tmp_path / "ref" / "metrics.json").read_text())
    assert metrics["params_agree"] and metrics["params_sha256"] == ref_metrics["params_sha256"], (metrics, ref_metrics)
    assert metrics["eval/loss"] == ref_metrics["eval/loss"]
    # the logged losses survive the restart: the run reports its real first loss, not the restart's
    assert metrics["train/loss_first"] == ref_metrics["train/loss_first"], (metrics, ref_metrics)
    assert _session_processes(proc.pid) == [], "processes of the job outlived it"
