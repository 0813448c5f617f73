"""Faults in a real CLI job: `kill -9` of rank 1 ends the job promptly; with restarts it finishes.

The job runs `python -m ddptrain` as a subprocess; rank 1 is the second worker the launcher
spawned (workers start in rank order) and is killed with SIGKILL once the first checkpoint exists.
Most use recipe=synthetic; one runs an epoch of real MNIST next to an uninterrupted twin and
checks the restarted job ends with the same accuracy and parameters.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]


def _children(pid):
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _workers(pid):
    """The launcher's spawned workers, oldest first (= rank order); not its resource tracker."""
    found = []
    for child in _children(pid):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            started = int(Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[19])
        except OSError:
            continue
        if b"spawn_main" in cmdline:
            found.append((started, child))
    return [child for _, child in sorted(found)]


def _start(run_dir, *overrides):
    cmd = [
        sys.executable,
        "-m",
        "ddptrain",
        "recipe=synthetic",
        "trainer.epochs=6",
        "data.num_train_samples=6000",
        "trainer.checkpoint_every_steps=10",
        "trainer.progress=false",
        "trainer.tensorboard=false",
        "dist.timeout_s=30",
        f"hydra.run.dir={run_dir}",
        *overrides,
    ]
    return subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def _kill_rank_1_after_first_checkpoint(proc, run_dir, timeout_s=120):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if list((run_dir / "checkpoints").glob("step_*.pt")):
            workers = _workers(proc.pid)
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
    run_dir = tmp_path / "run"
    proc = _start(run_dir, "launcher.max_restarts=1")
    _kill_rank_1_after_first_checkpoint(proc, run_dir)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out[-4000:]
    assert re.search(r"rank 1 failed .*restart 1 of 1, resuming from latest", out), out[-4000:]
    resumed = re.search(r"resumed from \S+step_0*(\d+)\.pt: step (\d+)", out)
    assert resumed and int(resumed.group(2)) >= 10, out[-4000:]
    assert "finished on 2 rank(s)" in out


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
    run_dir = tmp_path / "run"
    torchrun = str(Path(sys.executable).parent / "torchrun")
    cmd = [
        torchrun,
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "-m",
        "ddptrain",
        "recipe=synthetic",
        "launcher=torchrun",
        "trainer.epochs=6",
        "data.num_train_samples=6000",
        "trainer.checkpoint_every_steps=10",
        "trainer.progress=false",
        "trainer.tensorboard=false",
        "dist.timeout_s=30",
        f"hydra.run.dir={run_dir}",
    ]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 120
        killed = False
        while time.monotonic() < deadline and not killed and proc.poll() is None:
            if list((run_dir / "checkpoints").glob("step_*.pt")):
                for child in _children(proc.pid):
                    if _rank_from_environ(child) == 1:
                        os.kill(child, signal.SIGKILL)
                        killed = True
            time.sleep(0.2)
        assert killed, "rank 1 was not found to kill"
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-4000:]
    assert "torchrun restart 1: resuming from the latest checkpoint" in out, out[-4000:]
    resumed = re.search(r"resumed from \S+: step (\d+)", out)
    assert resumed and int(resumed.group(1)) >= 10, out[-4000:]


# -- the must-show on real MNIST: kill -9 of rank 1 with launcher.max_restarts=1 ------------------
SHARED_MNIST = ROOT.parent / "shared" / "data" / "MNIST" / "raw"
MNIST_ONE_EPOCH = [
    "recipe=mnist",
    "trainer.epochs=1",
    "trainer.checkpoint_every_steps=100",
    "trainer.progress=false",
    "trainer.tensorboard=false",
    "dist.timeout_s=30",
]


def _session_processes(sid):
    """Live (non-zombie) processes of session ``sid``: whatever a job started with start_new_session left."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            alive.append(int(stat.parent.name))
    return alive


def _final_accuracy(out):
    found = re.search(r"finished on 2 rank\(s\) at step (\d+) .*eval/accuracy=([0-9.]+)", out)
    assert found, out[-4000:]
    return int(found.group(1)), float(found.group(2))


@pytest.mark.skipif(
    not (SHARED_MNIST / "train-images-idx3-ubyte.gz").is_file(), reason=f"real MNIST not found in {SHARED_MNIST}"
)
def test_mnist_kill_9_with_max_restarts_ends_like_an_uninterrupted_run(tmp_path):
    """One epoch of the MNIST recipe, rank 1 SIGKILLed after the step-100 checkpoint: the job
    restarts once, resumes from that checkpoint, and ends with the accuracy and the parameters
    (checksum) of the same run left alone — exact resume."""
    started = []
    try:
        # Both jobs at once: on 2 cores they overlap their start-ups (single-threaded imports).
        for name, extra in (("ref", []), ("run", ["launcher.max_restarts=1"])):
            started.append(
                subprocess.Popen(
                    [sys.executable, "-m", "ddptrain", *MNIST_ONE_EPOCH, *extra, f"hydra.run.dir={tmp_path / name}"],
                    cwd=ROOT,
                    env={**os.environ, "DDPTRAIN_DATA": str(tmp_path / f"data-{name}")},
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    start_new_session=True,
                )
            )
        reference, proc = started
        run_dir = tmp_path / "run"
        _, first_workers = _kill_rank_1_after_first_checkpoint(proc, run_dir)
        out, _ = proc.communicate(timeout=150)
        reference_out, _ = reference.communicate(timeout=60)
    finally:
        for job in started:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
    assert reference.returncode == 0, reference_out[-3000:]
    assert proc.returncode == 0, out[-4000:]
    assert re.search(
        rf"rank 1 failed \(rank 1 \(pid {first_workers[1]}\) killed by signal SIGKILL.*\); restart 1 of 1, "
        r"resuming from latest",
        out,
    ), out[-4000:]
    resumed = re.search(r"resumed from \S+step_0*(\d+)\.pt: step (\d+), epoch 1", out)
    assert resumed and int(resumed.group(2)) == int(resumed.group(1)) >= 100, out[-4000:]
    assert "restart 1 of 1" in (run_dir / "ddptrain.log").read_text()  # the launching process's log file
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
