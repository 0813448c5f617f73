"""Outputs of a CLI run used afterwards: best checkpoints, ``load_model`` on the run directory,
``trainer.init_from`` and ``trainer.resume=best`` on the command line."""

import json
import subprocess

import pytest
import torch

import ddptrain
from ddptrain import Trainer
from ddptrain.config import Config
from tests.conftest import REPO, TORCHRUN, cli_env, run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

TINY = ["recipe=synthetic", "data.num_train_samples=512", "data.num_val_samples=200", "trainer.progress=false"]


def test_a_cli_run_keeps_its_best_and_load_model_rebuilds_the_recipes_model(tmp_path):
    run_dir = tmp_path / "run"
    best = ["trainer.checkpoint.monitor=eval/accuracy", "trainer.checkpoint.mode=max", "trainer.epochs=2"]
    proc = run_cli(*TINY, *best, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    model = ddptrain.load_model(run_dir, which="best")
    assert type(model).__name__ == "Net" and not model.training  # recipe=synthetic trains the tutorial Net
    checkpoint = torch.load(ddptrain.loading.find_checkpoint(run_dir, "best"), weights_only=True)
    x, y = Trainer(Config.from_dict(checkpoint["config"])).val_dataloader().tensors
    with torch.no_grad():
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    assert accuracy == pytest.approx(checkpoint["monitor"]["value"], abs=1e-9)  # the stored value is this model's
    final = json.loads((run_dir / "metrics.json").read_text())
    assert checkpoint["monitor"]["value"] >= final["eval/accuracy"]  # the best, at least the last evaluation

    tuned = tmp_path / "tuned"
    init = f"trainer.init_from={run_dir}/checkpoints/best"
    proc = run_cli(*TINY, "trainer.epochs=1", init, f"hydra.run.dir={tuned}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "training starts at step 0" in (tuned / "train.log").read_text()
    assert json.loads((tuned / "metrics.json").read_text())["step"] == 4

    proc = run_cli(*TINY, "trainer.epochs=3", "trainer.resume=best", f"hydra.run.dir={tuned}", cwd=tmp_path)
    assert proc.returncode != 0 and "no best checkpoint" in proc.stderr and "Traceback" not in proc.stderr


def test_profile_on_the_command_line_writes_one_trace_per_rank(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli(*TINY, "trainer.epochs=1", "trainer.profiler.enabled=true", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    traces = sorted((run_dir / "profile").glob("*.pt.trace.json"))
    assert [p.name.split(".")[0] for p in traces] == ["rank0", "rank1"]
    for path in traces:
        names = {e.get("name") for e in json.loads(path.read_text())["traceEvents"]}
        assert {"ProfilerStep#2", "ddptrain/forward_backward", "ddptrain/optimizer_step"} <= names


def test_test_and_predict_after_fit_under_torchrun(tmp_path):
    """fit destroys the group it created; test and predict join again on torchrun's agent store,
    whose keys of the first group must not be read again (that hung most runs)."""
    script = REPO / "tests" / "e2e" / "fit_then_test.py"
    proc = subprocess.run(
        [TORCHRUN, "--nproc-per-node=2", str(script), str(tmp_path / "out"), str(tmp_path)],
        cwd=tmp_path,
        env=cli_env(PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    assert sorted(r["rank"] for r in lines) == [0, 1]
    assert lines[0]["test"] == lines[1]["test"] == lines[0]["again"] and lines[0]["test"]["test/samples"] == 29
    assert lines[0]["rows"] == 29 and lines[0]["digest"] == lines[1]["digest"]
