"""World-size-invariant mode through the CLI on real processes and real MNIST: ``recipe=mnist
trainer.world_size_invariant=true`` ends with the same ``params_sha256`` and logs the same per-step
losses at dist.world_size 1 and 4 on gloo and at 2 on mpi, and a run stopped at 2 ranks mid-epoch
and resumed at 4 ends where the uninterrupted run ends. 20 steps each (the first 2560 samples).

Five CLI jobs, because each costs seconds of torch imports per rank; the world sizes in between
are covered on the threaded group at 1, 2, 4 and 8 ranks by tests/invariant/test_trainer.py."""

import json
import shutil
import sys
from pathlib import Path

import pytest

from ddptrain.trainer.checkpoint import load_checkpoint
from tests.conftest import run_cli

# One pytest-xdist worker for the module (scripts/test.sh runs --dist loadgroup): gloo_runs is made once.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900), pytest.mark.xdist_group("invariant-cli")]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 20


def _run(run_dir: Path, mnist_root: Path, *overrides: str) -> dict:
    proc = run_cli(
        "recipe=mnist",
        "trainer.world_size_invariant=true",
        f"trainer.max_steps={STEPS}",
        "trainer.log_every_steps=1",
        "trainer.progress=false",
        "trainer.loggers.tensorboard=false",
        f"hydra.run.dir={run_dir}",
        *overrides,
        cwd=ROOT,
        timeout=300,
        env={"DDPTRAIN_DATA": str(mnist_root)},
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    last = sorted((run_dir / "checkpoints").glob("step_*.pt"))[-1]
    return {
        "hash": metrics["params_sha256"],
        "agree": metrics["params_agree"],
        "losses": load_checkpoint(last)["loss_history"],  # (step, loss) of every step
        "world_size": metrics["world_size"],
    }


@pytest.fixture(scope="module")
def gloo_runs(tmp_path_factory, mnist_root):
    base = tmp_path_factory.mktemp("invariant")
    return {w: _run(base / f"gloo{w}", mnist_root, f"dist.world_size={w}", "backend=gloo") for w in (1, 4)}


def test_gloo_1_and_4_ranks_same_hash_and_per_step_losses(gloo_runs):
    one = gloo_runs[1]
    assert [step for step, _ in one["losses"]] == list(range(1, STEPS + 1))
    for world_size, run in gloo_runs.items():
        assert run["world_size"] == world_size and run["agree"]
        assert run["hash"] == one["hash"], f"dist.world_size={world_size} ends with other parameters"
        assert run["losses"] == one["losses"], f"dist.world_size={world_size} logs other losses"


@pytest.mark.skipif(
    shutil.which("mpiexec", path=str(Path(sys.executable).parent)) is None and shutil.which("mpiexec") is None,
    reason="mpiexec not installed (pip install 'ddptrain[mpi]')",
)
def test_mpi_at_2_ranks_same_as_gloo(tmp_path, mnist_root, gloo_runs):
    run = _run(tmp_path / "mpi2", mnist_root, "dist.world_size=2", "backend=mpi")
    assert run["world_size"] == 2 and run["agree"]
    assert run["hash"] == gloo_runs[1]["hash"], "mpi at 2 ranks ends with other parameters"
    assert run["losses"] == gloo_runs[1]["losses"]


def test_stop_at_2_ranks_mid_epoch_resume_at_4_same_final_hash(tmp_path, mnist_root, gloo_runs):
    run_dir = tmp_path / "run"
    _run(run_dir, mnist_root, "dist.world_size=2", "trainer.stop_after_steps=8")  # step 8 of epoch 1's 469
    resumed = _run(
        run_dir,
        mnist_root,
        "dist.world_size=4",
        f"trainer.resume={run_dir}",
        "trainer.allow_world_size_change=true",
    )
    assert resumed["hash"] == gloo_runs[1]["hash"]
    assert resumed["losses"] == gloo_runs[1]["losses"]
