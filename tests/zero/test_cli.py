"""ZeRO through the CLI on real processes: ``recipe=synthetic dist.zero_stage=2`` (the backend's
own reduce-scatter and all-gather, 2 ranks on gloo) ends with the ``params_sha256`` of plain DDP
over the ring (``dist.zero_stage=0 dist.algorithm=ring``), and its last checkpoint resumes in a
plain DDP run (with ``dist.grad_compression=bf16``). World sizes 3 and 4 and the other
optimizers run on the threaded group (tests/zero/test_optimizer.py,
tests/zero/test_trainer.py) and on gloo (tests/zero/test_processes.py)."""

import json
from pathlib import Path

import pytest

from tests.conftest import run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 30


def _run(run_dir: Path, *overrides: str) -> dict:
    proc = run_cli(
        "recipe=synthetic",
        f"trainer.max_steps={STEPS}",
        "trainer.progress=false",
        "trainer.loggers.tensorboard=false",
        f"hydra.run.dir={run_dir}",
        *overrides,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return json.loads((run_dir / "metrics.json").read_text())


def test_zero_stage_2_ends_with_plain_ring_ddps_parameters_and_its_checkpoint_loads_in_plain_ddp(tmp_path):
    zero = _run(tmp_path / "zero", "dist.zero_stage=2")
    plain = _run(tmp_path / "plain", "dist.zero_stage=0", "dist.algorithm=ring")
    assert zero["params_agree"] and plain["params_agree"]
    assert zero["params_sha256"] == plain["params_sha256"]
    assert "ZeRO stage 2 (native reduce-scatter): this rank steps" in (tmp_path / "zero" / "train.log").read_text()
    checkpoint = sorted((tmp_path / "zero" / "checkpoints").glob("step_*.pt"))[-1]
    resumed = _run(
        tmp_path / "resumed",
        "dist.zero_stage=0",
        f"trainer.resume={checkpoint}",
        f"trainer.max_steps={STEPS + 5}",
        "dist.grad_compression=bf16",  # the key from the command line, in the same job
    )
    assert resumed["params_agree"]
    assert "gradients travel in bf16 (dist.grad_compression)" in (tmp_path / "resumed" / "train.log").read_text()


def test_an_incompatible_combination_is_refused_before_any_worker_starts(tmp_path):
    proc = run_cli(
        "recipe=synthetic",
        "dist.zero_stage=2",
        "trainer.world_size_invariant=true",
        f"hydra.run.dir={tmp_path}",
        cwd=ROOT,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    refusal = "trainer.world_size_invariant=true cannot be combined with dist.zero_stage=2: every rank holds"
    assert refusal in proc.stderr + proc.stdout
