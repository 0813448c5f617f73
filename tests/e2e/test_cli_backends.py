"""Smoke runs through the CLI on the other communication paths: ring buckets with the
desynchronisation guard, and backend=mpi started by the local launcher through mpiexec."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]


def _cli(tmp_path, *overrides):
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
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=200)


def test_ring_all_reduce_with_the_sync_guard(tmp_path):
    proc = _cli(tmp_path, "dist.algorithm=ring", "trainer.check_sync_every_n_steps=5")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "smoke check passed" in out


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
