"""Best checkpoints: exactly the k best by the monitored value stay on disk, each carrying its
value; ``best`` is a resume target; a monitor the run never produces is a clear error."""

import math
import random

import pytest
import torch
import torch.nn.functional as F

from ddptrain import Callback, ConfigError
from ddptrain.testing import run_threaded
from ddptrain.trainer.checkpoint import CheckpointError, list_checkpoints, resolve_checkpoint
from ddptrain.trainer.topk import Ranked, TopK

from .test_trainer import TinyTrainer, _config


def _reference_top(values, k, mode):
    """The k best (step, value) by a plain sort: value (negated for max), then the earlier step."""
    finite = [(v, s) for s, v in values if not math.isnan(v)]
    ranked = sorted(finite, key=lambda vs: (vs[0] if mode == "min" else -vs[0], vs[1]))
    return [s for _, s in ranked[:k]]


@pytest.mark.parametrize("mode", ["min", "max"])
@pytest.mark.parametrize("k", [1, 3])
def test_topk_keeps_exactly_the_best_k_with_deterministic_ties(mode, k):
    rng = random.Random(k)
    # Few distinct values: many ties; a NaN is never kept.
    values = [(step, float(rng.choice([0.1, 0.2, 0.3, 0.4, float("nan")]))) for step in range(1, 40)]
    topk, evicted_total = TopK(k, mode), []
    for step, value in values:
        if topk.accepts(value, step):
            evicted_total += topk.add(Ranked(value, step, f"p{step}"))
    assert [r.step for r in topk.kept] == _reference_top(values, k, mode)
    entered = {r.step for r in topk.kept} | {r.step for r in evicted_total}
    assert len(evicted_total) == len(entered) - len(topk.kept)  # every entry that left was handed back


class Evaluations(Callback):
    def __init__(self):
        self.seen = []

    def on_validation_end(self, trainer, metrics):
        self.seen.append((trainer.state.step, metrics))


def _best_run(tmp_path, monitor, mode, k, epochs=6, data=None, **extra):
    recorder = Evaluations()
    # lr 2 with momentum: the eval loss and accuracy go up and down (the best are not the last), with ties.
    config = _config(
        tmp_path,
        data,
        {"lr": 2.0, "momentum": 0.9},
        epochs=epochs,
        checkpoint={"every_epochs": 1, "monitor": monitor, "mode": mode, "save_top_k": k},
        **extra,
    )
    TinyTrainer(config, callbacks=[recorder]).fit()
    return [(step, m[monitor]) for step, m in recorder.seen]


def _val_loss(state_dict):
    model = torch.nn.Linear(8, 3)
    model.load_state_dict(state_dict)
    x, y = TinyTrainer(_config("unused")).val_dataloader().tensors
    with torch.no_grad():
        return F.cross_entropy(model(x), y).item()


@pytest.mark.parametrize(("monitor", "mode", "k"), [("eval/loss", "min", 2), ("eval/accuracy", "max", 3)])
def test_a_fit_keeps_exactly_the_k_best_each_with_its_value(tmp_path, monitor, mode, k):
    values = _best_run(tmp_path, monitor, mode, k)
    best_dir = tmp_path / "checkpoints" / "best"
    kept = [int(p.name[5:14]) for p in list_checkpoints(best_dir)]
    assert sorted(kept) == sorted(_reference_top(values, k, mode)), values
    assert sorted(p.name for p in best_dir.iterdir()) == sorted(
        n for s in kept for n in (f"step_{s:09d}.pt", f"step_{s:09d}.pt.sha256")
    )
    for path in list_checkpoints(best_dir):
        state = torch.load(path, weights_only=True)  # plain torch.load keeps working
        step = state["step"]
        assert state["monitor"] == {"name": monitor, "mode": mode, "value": dict(values)[step]}
        if monitor == "eval/loss":  # the weights stored are the ones that scored that value
            assert _val_loss(state["model"]) == pytest.approx(state["monitor"]["value"], rel=1e-5)
    assert len(list_checkpoints(tmp_path / "checkpoints")) == 3  # the last ones, kept beside them
    best_step = _reference_top(values, 1, mode)[0]
    assert resolve_checkpoint("best", tmp_path / "checkpoints").name == f"step_{best_step:09d}.pt"
    assert resolve_checkpoint(str(best_dir), tmp_path).name == f"step_{best_step:09d}.pt"
    last = list_checkpoints(tmp_path / "checkpoints")[-1]
    assert (
        resolve_checkpoint("last", tmp_path / "checkpoints")
        == resolve_checkpoint("latest", tmp_path / "checkpoints")
        == last
    )


class StartStep(Callback):
    def on_fit_start(self, trainer):
        self.step = trainer.state.step


def test_resume_best_continues_from_the_best_step_and_keeps_its_ranking(tmp_path):
    values = _best_run(tmp_path, "eval/loss", "min", 2, epochs=4)
    best_step = _reference_top(values, 1, "min")[0]
    start = StartStep()
    more = Evaluations()
    config = _config(
        tmp_path,
        None,
        {"lr": 2.0, "momentum": 0.9},
        epochs=7,
        checkpoint={"every_epochs": 1, "monitor": "eval/loss", "save_top_k": 2},
        resume="best",
    )
    TinyTrainer(config, callbacks=[start, more]).fit()
    assert start.step == best_step
    # The ranking went on from the files: the first run's values and the resumed run's compete.
    combined = dict(values)
    combined.update((s, m["eval/loss"]) for s, m in more.seen)
    kept = [int(p.name[5:14]) for p in list_checkpoints(tmp_path / "checkpoints" / "best")]
    assert sorted(kept) == sorted(_reference_top(sorted(combined.items()), 2, "min"))


def test_a_monitor_never_produced_is_named_with_the_metrics_that_exist(tmp_path):
    with pytest.raises(ConfigError) as info:
        _best_run(tmp_path, "eval/acc", "max", 1, epochs=2)
    message = str(info.value)
    assert "trainer.checkpoint.monitor='eval/acc'" in message
    assert "eval/accuracy" in message and "eval/loss" in message and "train/loss" in message


def test_best_without_best_checkpoints_is_an_error_that_says_how(tmp_path):
    TinyTrainer(_config(tmp_path, epochs=1, checkpoint={"every_epochs": 1})).fit()
    with pytest.raises(CheckpointError, match=r"no best checkpoint.*trainer.checkpoint.monitor.*'latest'"):
        TinyTrainer(_config(tmp_path, epochs=2, resume="best")).fit()


def _best_on_rank(rank, world_size, root):
    return _best_run(root, "eval/loss", "min", 2, epochs=5, data={"global_batch_size": 12})


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_rank_saves_the_same_best_checkpoints(tmp_path, world_size):
    results = run_threaded(_best_on_rank, world_size, tmp_path, timeout_s=120)
    assert all(r == results[0] for r in results)  # evaluations reduced exactly: the same on every rank
    kept = [int(p.name[5:14]) for p in list_checkpoints(tmp_path / "checkpoints" / "best")]
    assert sorted(kept) == sorted(_reference_top(results[0], 2, "min"))


def test_the_mode_and_k_are_checked_before_any_worker_starts():
    from ddptrain.config import Config
    from ddptrain.preflight import validate

    with pytest.raises(
        ConfigError, match=r"trainer.checkpoint.mode='maximum' is not one of min, max \(did you mean max\?\)"
    ):
        validate(Config.from_dict({"trainer": {"checkpoint": {"mode": "maximum"}}}), 2)
    with pytest.raises(ConfigError, match="trainer.checkpoint.save_top_k=0 must be at least 1"):
        validate(Config.from_dict({"trainer": {"checkpoint": {"save_top_k": 0}}}), 2)


class LoggingTrainer(TinyTrainer):
    def validation_step(self, model, batch):
        out = super().validation_step(model, batch)
        self.log("val_acc", out["accuracy"].mean(), batch_size=len(out["accuracy"]))
        return out


def test_a_metric_logged_with_self_log_can_be_monitored(tmp_path):
    recorder = Evaluations()
    config = _config(
        tmp_path,
        None,
        {"lr": 2.0, "momentum": 0.9},
        epochs=6,
        checkpoint={"every_epochs": 1, "monitor": "val_acc", "mode": "max", "save_top_k": 2},
    )
    LoggingTrainer(config, callbacks=[recorder]).fit()
    values = [(step, m["val_acc"]) for step, m in recorder.seen]
    kept = [int(p.name[5:14]) for p in list_checkpoints(tmp_path / "checkpoints" / "best")]
    assert sorted(kept) == sorted(_reference_top(values, 2, "max")), values
