"""Early stopping from the command line, on real processes (2 local workers over gloo): the
config keys reach the callback through Hydra, and both ranks stop at the same step."""

import json

import pytest

from tests.conftest import run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_early_stopping_from_the_command_line_stops_both_ranks_at_one_step(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli(
        "recipe=synthetic",
        "data.num_train_samples=1024",  # 8 steps of 128 per epoch
        "data.num_val_samples=200",
        "trainer.epochs=3",
        "trainer.eval_every_steps=2",
        "trainer.early_stopping.monitor=eval/loss",
        "trainer.early_stopping.patience=1",
        "trainer.early_stopping.min_delta=100",  # nothing after the first evaluation counts as better
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    metrics = json.loads((run_dir / "metrics.json").read_text())
    # Evaluations at steps 2 (the best) and 4 (no improvement, patience 1): stop at 4, on both ranks
    # (params_agree: every rank's parameters, gathered at the end, are the same).
    assert metrics["step"] == 4 and metrics["stopped_early"] and metrics["params_agree"]
    assert metrics["world_size"] == 2
    assert "early stopping at step 4: eval/loss=" in (run_dir / "train.log").read_text()
    rows = (run_dir / "metrics.csv").read_text().splitlines()
    assert rows[0].startswith("step,") and rows[-1].startswith("4,")
