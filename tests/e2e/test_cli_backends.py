"""Smoke runs through the CLI on the other communication paths: ring buckets with the
desynchronisation guard, and backend=mpi started by the local launcher through mpiexec."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import check_run_log

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]


def _cli(tmp_path, *overrides, env=None):
    cmd = [
        sys.executable,
        "-m",
        "ddptrain",
        "recipe=mnist",
        "trainer=smoke",
        "trainer.progress=false",
        f"hydra.run.dir={tmp_path / 'run'}",
        *overrides,
    ]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=200, env=env)


def test_ring_all_reduce_with_the_sync_guard(tmp_path, mnist_root):
    trainer = "recipe.trainer_class=tests.e2e.ring_counter.RingCountingMnistTrainer"  # counts ring messages
    env = {**os.environ, "DDPTRAIN_DATA": str(mnist_root)}
    proc = _cli(tmp_path, "dist.algorithm=ring", "trainer.check_sync_every_n_steps=5", trainer, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "smoke check passed" in out
    for rank in (0, 1):
        sent = json.loads((tmp_path / "run" / f"ring_rank{rank}.json").read_text())
        assert sent["steps"] == 40 and sent["world_size"] == 2
        # On 2 ranks the ring sends each bucket's two halves once each (reduce-scatter, all-gather):
        # at least 2 messages per step, and every gradient element exactly once per step.
        assert sent["messages"] >= 2 * sent["steps"], sent
        assert sent["elements"] == sent["steps"] * sent["trainable"], sent


@pytest.mark.skipif(
    shutil.which("mpiexec", path=str(Path(sys.executable).parent)) is None,
    reason="mpiexec not installed next to this Python (pip install 'ddptrain[mpi]')",
)
def test_backend_mpi_with_the_local_launcher_goes_through_mpiexec(tmp_path):
    proc = _cli(tmp_path, "backend=mpi")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "mpiexec -n 2" in out and "smoke check passed" in out
    assert "finished on 2 rank(s)" in out
    check_run_log(tmp_path / "run", proc.stdout, steps_logged=[10, 20, 30, 40])
