"""A job killed in the middle of a background checkpoint write resumes from the previous complete
checkpoint, bitwise (``trainer.checkpoint.async_save=true``).

The kill is aimed from outside, at the write itself: a checkpoint's data (about 80 MB here) is
written to a temporary file, ``.step_N.pt.<random>.tmp``, renamed when whole. The test polls for
that file for a checkpoint after the first and sends SIGKILL to the whole job (launcher and ranks)
as soon as it appears, while the data is being written. What must hold: no ``step_N.pt`` of the cut checkpoint
(a writer that wrote in place would leave half a file under that name), every checkpoint left
loads and verifies, and ``trainer.resume=latest`` ends with the bits of the uninterrupted run.
"""

import json
import os
import signal
import subprocess
import time

import pytest

from ddptrain.trainer.checkpoint import load_checkpoint
from tests.conftest import PYTHON, cli_env, run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

# Big enough that writing a checkpoint takes a while (an MLP of 6.4M parameters with AdamW: about
# 80 MB a file), small enough to train 12 steps in seconds.
JOB = [
    "recipe=synthetic",
    "model=mlp",
    "model.hidden=8192",
    "optimizer=adamw",
    "data.num_train_samples=4096",
    "data.num_val_samples=256",
    "trainer.max_steps=12",
    "trainer.epochs=1",
    "trainer.eval_every_epochs=0",
    "trainer.num_sanity_val_steps=0",
    "trainer.progress=false",
    "trainer.model_summary=false",
    "trainer.loggers.tensorboard=false",
    "trainer.checkpoint.every_steps=2",
    "trainer.checkpoint.keep_last=10",
    "trainer.checkpoint.async_save=true",
]


def _digest(run_dir):
    return json.loads((run_dir / "metrics.json").read_text())["params_sha256"]


def _kill_mid_write(run_dir, deadline_s: float = 120) -> int:
    """Start the job and SIGKILL it while a checkpoint after the first is being written; the step
    of the checkpoint cut short."""
    proc = subprocess.Popen(
        [PYTHON, "-m", "ddptrain", *JOB, f"hydra.run.dir={run_dir}"],
        env=cli_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    checkpoints = run_dir / "checkpoints"
    deadline = time.monotonic() + deadline_s
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            for partial in checkpoints.glob(".step_*.pt.*.tmp") if checkpoints.is_dir() else ():
                step = int(partial.name[6:15])
                if step > 2:  # its data is being written
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=30)
                    return step
            time.sleep(0.001)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    pytest.fail("the job ended (or the deadline passed) before a background write could be caught")


def test_a_kill_during_a_background_write_resumes_from_the_previous_checkpoint_bitwise(tmp_path):
    whole = run_cli(*JOB, f"hydra.run.dir={tmp_path / 'whole'}", cwd=tmp_path, timeout=300)
    assert whole.returncode == 0, whole.stderr

    run_dir = tmp_path / "killed"
    cut = _kill_mid_write(run_dir)
    complete = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*.pt"))
    assert f"step_{cut:09d}.pt" not in complete and complete, complete  # never a half file under its name
    for name in complete:
        load_checkpoint(run_dir / "checkpoints" / name)  # whole, and its digest agrees
    assert not (run_dir / "metrics.json").exists()

    resumed = run_cli(*JOB, f"hydra.run.dir={run_dir}", "trainer.resume=latest", cwd=tmp_path, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    previous = max(complete)  # the newest complete checkpoint: the one before the cut
    assert (
        f"resumed from {run_dir / 'checkpoints' / previous}: step {int(previous[5:14])},"
        in (run_dir / "train.log").read_text()
    )
    assert _digest(run_dir) == _digest(tmp_path / "whole")
    assert not list((run_dir / "checkpoints").glob(".*.tmp"))  # the cut write's leftover, rewritten
