"""``dist.sync=diloco`` from the command line, on gloo processes: the ranks end on one model, and
the step lines and metrics files report the bytes of one outer step per round (the windows
checked hold no epoch end, whose evaluation and checkpoint send bytes of their own)."""

import csv
import json

import pytest
import torch

from ddptrain.trainer.stopping import NUM_VOTES
from tests.conftest import run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_diloco_on_two_processes_reports_one_outer_step_of_bytes_per_round(tmp_path):
    out = tmp_path / "run"
    args = ["recipe=synthetic", "data.num_train_samples=4096", "data.num_val_samples=200", "trainer.progress=false"]
    args += ["dist.sync=diloco", "dist.sync_every=4", "trainer.max_steps=10", "trainer.log_every_steps=4"]
    proc = run_cli(*args, f"trainer.output_dir={out}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    final = json.loads((out / "metrics.json").read_text())
    assert final["step"] == 10 and final["params_agree"]
    checkpoint = torch.load(out / "checkpoints" / "step_000000010.pt", weights_only=False)
    floats = sum(t.numel() for t in checkpoint["model"].values() if t.is_floating_point())
    one_round = (floats + NUM_VOTES) * 4  # every parameter and float buffer, and the stop votes, in fp32
    with open(out / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["comm/bytes_per_step"]]
    assert [int(r["step"]) for r in rows][:2] == [4, 8]
    assert [float(r["comm/bytes_per_step"]) * 4 for r in rows[:2]] == [one_round, one_round]
    assert f"{one_round / 4 / 1000:.1f} kB/step sent" in proc.stdout + proc.stderr
    assert len(checkpoint["strategy"]["ranks"]) == 2 and "outer_optimizer" in checkpoint["strategy"]
