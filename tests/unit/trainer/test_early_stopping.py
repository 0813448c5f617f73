"""``trainer.should_stop``, the EarlyStopping callback and the evaluation cadence: every rank stops
at the same step (seen from outside: each rank's step count), whoever set the flag and when."""

import pytest
import torch
import torch.nn.functional as F

from ddptrain import Callback, ConfigError
from ddptrain.testing import run_threaded
from ddptrain.trainer import EarlyStopping
from ddptrain.trainer.checkpoint import load_checkpoint

from .test_trainer import TinyTrainer, _config


class StopOnOneRank(Callback):
    """Sets ``should_stop`` on one rank only, after step ``at_step`` or at the end of epoch ``at_epoch``."""

    def __init__(self, rank, at_step=None, at_epoch=None):
        self.rank, self.at_step, self.at_epoch = rank, at_step, at_epoch

    def on_train_batch_end(self, trainer, loss):
        if trainer.rank == self.rank and trainer.state.step == self.at_step:
            trainer.should_stop = True

    def on_epoch_end(self, trainer, epoch, metrics):
        if trainer.rank == self.rank and epoch == self.at_epoch:
            trainer.should_stop = True


def _fit(rank, world_size, config, callback_args):
    trainer = TinyTrainer(config, callbacks=[StopOnOneRank(**callback_args)])
    metrics = trainer.fit()
    return trainer.state.step, metrics["stopped_early"], trainer.should_stop


def test_should_stop_set_mid_epoch_on_one_rank_stops_every_rank_after_the_next_step(tmp_path):
    # 40 samples, global batch 12 (the last one short): 4 steps per epoch. Rank 2 asks after step 2.
    config = _config(tmp_path, data={"global_batch_size": 12}, epochs=3)
    results = run_threaded(_fit, 3, config, {"rank": 2, "at_step": 2}, timeout_s=120)
    assert results == [(3, True, True)] * 3  # the agreement is asynchronous: one step later, on all ranks


def test_should_stop_set_at_an_epoch_end_stops_before_the_next_step(tmp_path):
    config = _config(tmp_path, epochs=3)
    results = run_threaded(_fit, 2, config, {"rank": 1, "at_epoch": 0}, timeout_s=120)
    assert results == [(4, True, True)] * 2


class ZeroLr(TinyTrainer):
    """Learns nothing: the validation loss is the same at every evaluation (a plateau)."""

    def configure_optimizers(self, model):
        return torch.optim.SGD(model.parameters(), lr=0.0)


class EvalSteps(Callback):
    def __init__(self):
        self.steps = []

    def on_validation_end(self, trainer, metrics):
        self.steps.append(trainer.state.step)


def _fit_early(rank, world_size, config):
    evals = EvalSteps()
    trainer = ZeroLr(config, callbacks=[evals])
    metrics = trainer.fit()
    stopper = next(c for c in trainer.callbacks if isinstance(c, EarlyStopping))
    return trainer.state.step, metrics["stopped_early"], evals.steps, stopper.wait, stopper.stopped_step


def test_early_stopping_from_config_stops_every_rank_at_the_same_evaluation(tmp_path):
    """Evaluations every 3 steps (and at epoch ends, every 4): the first sets the best, the next two
    do not improve (patience 2), so every rank stops at the third evaluation's step."""
    config = _config(tmp_path, epochs=10, eval_every_steps=3, early_stopping={"monitor": "eval/loss", "patience": 2})
    results = run_threaded(_fit_early, 2, config, timeout_s=120)
    # Evaluations at steps 3, 4 (epoch end) and 6: stop at 6 on both ranks, no step 7.
    assert results == [(6, True, [3, 4, 6], 2, 6)] * 2


def test_early_stopping_waits_while_the_metric_improves(tmp_path):
    """A learning model: eval/loss falls at every evaluation, so patience 0 never triggers."""
    config = _config(tmp_path, epochs=3, early_stopping={"monitor": "eval/loss", "patience": 0})
    metrics = TinyTrainer(config).fit()
    assert metrics["step"] == 12 and not metrics["stopped_early"]


def test_a_monitored_metric_that_never_appears_is_a_clear_error(tmp_path):
    config = _config(tmp_path, epochs=2, early_stopping={"monitor": "eval/los"})
    with pytest.raises(ConfigError) as info:
        TinyTrainer(config).fit()
    message = str(info.value)
    assert "EarlyStopping monitors 'eval/los', but no metric of that name was reported by step 4" in message
    assert "Did you mean 'eval/loss'?" in message
    available = "comm/bytes_per_step, eval/accuracy, eval/loss, eval/samples, time/train_s, train/comm_wait_s"
    assert f"Available: {available}, train/loss, train/lr" in message


def _epoch_losses(trainer, epochs):
    """train/epoch_loss computed here: the mean of the steps' batch-mean losses over each epoch's
    order (randperm seeded with seed + epoch) in global batches, from the (never trained) model."""
    (x, y), batch = trainer.train_dataloader().tensors, trainer.config.data.global_batch_size
    seed = trainer.config.trainer.seed
    losses = []
    with torch.no_grad():
        for epoch in range(epochs):
            order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed + epoch))
            steps = [order[i : i + batch] for i in range(0, len(x), batch)]
            losses.append(sum(F.cross_entropy(trainer.model.module(x[i]), y[i]).item() for i in steps) / len(steps))
    return losses


def test_early_stopping_without_validation_checks_at_epoch_ends(tmp_path):
    """40 samples in global batches of 12 (the last of 4): the epoch loss of a model that learns
    nothing depends on which 4 samples form the short batch, so it moves from epoch to epoch:
    1.2939 (best), 1.3108 (wait 1), 1.2452 (best), 1.3383 (wait 1), 1.2421 (best), 1.3201 (wait 1),
    1.2580 (wait 2 = patience): stop at the end of epoch 7, step 28 of 40."""

    class NoVal(ZeroLr):
        def val_dataloader(self):
            return None

    stopper = EarlyStopping("train/epoch_loss", mode="min", patience=2)
    trainer = NoVal(_config(tmp_path, data={"global_batch_size": 12}, epochs=10), callbacks=[stopper])
    metrics = trainer.fit()
    losses = _epoch_losses(trainer, 10)
    best, wait, expected = losses[0], 0, None
    for epoch, loss in enumerate(losses[1:], start=2):
        best, wait = (loss, 0) if loss < best else (best, wait + 1)
        if wait == 2:
            expected = 4 * epoch
            break
    assert expected == 28
    assert metrics["stopped_early"] and metrics["step"] == stopper.stopped_step == 28
    assert stopper.best == pytest.approx(losses[4], abs=1e-9) and stopper.best_step == 20


@pytest.mark.parametrize(
    ("mode", "min_delta", "improved", "not_improved"),
    [
        ("min", 0.0, [0.9999, -3.0], [1.0, 1.0001]),
        ("min", 0.25, [0.7499, 0.5], [0.75, 0.76, 1.0, 1.5]),  # 1 - 0.25 = 0.75 exactly: not more than min_delta
        ("max", 0.0, [1.0001, 3.0], [1.0, 0.9999]),
        ("max", 0.25, [1.2501, 1.5], [1.25, 1.24, 1.0, 0.5]),
    ],
)
def test_improved_means_better_than_the_best_by_more_than_min_delta(mode, min_delta, improved, not_improved):
    stopper = EarlyStopping("eval/loss", mode=mode, min_delta=min_delta)
    assert stopper.improved(123.0)  # no best yet: anything is
    stopper.best = 1.0
    assert [stopper.improved(v) for v in improved] == [True] * len(improved)
    assert [stopper.improved(v) for v in not_improved] == [False] * len(not_improved)


class Scored(TinyTrainer):
    """Reports ``eval/score``: SCORES[step] at the evaluation after that step (one per epoch end)."""

    SCORES = {4: 1.0, 8: 0.95, 12: 0.85, 16: 0.80, 20: 0.78, 24: 0.70, 28: 0.69, 32: 0.68, 36: 0.67, 40: 0.66}
    sign = 1.0

    def validation_step(self, model, batch):
        value = self.sign * self.SCORES[self.state.step]
        return {**super().validation_step(model, batch), "score": torch.full((len(batch[0]),), value)}


@pytest.mark.parametrize("mode", ["min", "max"])
@pytest.mark.parametrize(("min_delta", "expected"), [(0.1, 20), (0.0, None)])
def test_min_delta_decides_the_stop_step(tmp_path, mode, min_delta, expected):
    """The score falls at every evaluation, by less than 0.1 after step 12. With min_delta 0.1 and
    patience 2: best 1.0 at 4, 0.95 (wait 1), 0.85 (best), 0.80 and 0.78 (not below 0.75: wait 2),
    stop at step 20. With min_delta 0 every evaluation improves: all 40 steps. Mode max: the
    negated score, the same steps."""

    class Signed(Scored):
        sign = 1.0 if mode == "min" else -1.0

    stopper = EarlyStopping("eval/score", mode=mode, patience=2, min_delta=min_delta)
    config = _config(tmp_path, epochs=10, num_sanity_val_steps=0)  # SCORES start at step 4
    metrics = Signed(config, callbacks=[stopper]).fit()
    assert metrics["step"] == (expected or 40) and metrics["stopped_early"] == (expected is not None)
    assert stopper.stopped_step == expected
    assert stopper.best == pytest.approx(Signed.sign * (0.85 if expected else 0.66))


@pytest.mark.parametrize(("every_epochs", "expected"), [(1, [3, 4, 6, 8]), (0, [3, 6, 8])])
def test_eval_every_steps_cadence(tmp_path, every_epochs, expected):
    """4 steps per epoch, 2 epochs, evaluation every 3 steps and/or every epoch; the final
    evaluation (step 8) happens once, whether asked by the epoch end or by the end of the fit."""
    evals = EvalSteps()
    config = _config(tmp_path, eval_every_steps=3, eval_every_epochs=every_epochs)
    metrics = TinyTrainer(config, callbacks=[evals]).fit()
    assert evals.steps == expected and metrics["eval/samples"] == 13


def test_bad_early_stopping_settings_are_refused():
    with pytest.raises(ConfigError, match="mode must be one of min, max"):
        EarlyStopping("eval/loss", mode="lowest")
    from ddptrain.config import Config
    from ddptrain.preflight import validate

    config = Config.from_dict({"trainer": {"early_stopping": {"monitor": "eval/loss", "mode": "up"}}})
    with pytest.raises(ConfigError, match="trainer.early_stopping.mode"):
        validate(config, 1)


def test_early_stopping_state_survives_a_resume(tmp_path):
    """Plateau from the first evaluation, checks every 2 steps, patience 3: the uninterrupted run
    stops at step 8. Stopped at step 4 (one check without improvement behind it) and resumed, the
    run must stop at 8 too, not start counting again (it would stop at 12)."""
    kwargs = {"epochs": 10, "eval_every_steps": 2, "checkpoint": {"every_steps": 2}}
    kwargs["early_stopping"] = {"monitor": "eval/loss", "patience": 3}
    straight = ZeroLr(_config(tmp_path / "straight", **kwargs)).fit()
    ZeroLr(_config(tmp_path / "mid", stop_after_steps=4, **kwargs)).fit()
    saved = load_checkpoint(tmp_path / "mid" / "checkpoints" / "step_000000004.pt")["callbacks"]["EarlyStopping"]
    assert saved["wait"] == 1 and saved["best_step"] == 2 and saved["monitor"] == "eval/loss"
    resumed = ZeroLr(_config(tmp_path / "mid", resume="latest", **kwargs)).fit()
    assert straight["step"] == resumed["step"] == 8 and resumed["stopped_early"]
