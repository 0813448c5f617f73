"""``self.log`` from training_step, validation_step and callbacks: reduced over the ranks (mean,
sum, max, min) and held against a single-process computation here; validation values count each
sample once (the sampler's padding duplicates are cut off); torchmetrics metrics synchronised
through ddptrain's own process group."""

import pytest
import torch
import torch.nn.functional as F

from ddptrain import Callback, EarlyStopping
from ddptrain.testing import run_threaded

from .test_trainer import FixedInitTrainer, _config


class Logs(FixedInitTrainer):
    """Logs in both steps; the built-in per-sample metrics stay as they are."""

    def training_step(self, model, batch):
        x, y = batch
        loss = F.cross_entropy(model(x), y)
        self.log("batch_loss", loss, on_step=True, on_epoch=True)
        self.log("samples_seen", len(y), reduce="sum", on_epoch=True, on_step=False)
        self.log("label_max", y.max(), reduce="max")
        return loss

    def validation_step(self, model, batch):
        x, y = batch
        logits = model(x)
        per_sample = F.cross_entropy(logits, y, reduction="none")
        self.log("val_loss", per_sample.mean())  # a batch mean, weighted by the batch's size
        self.log("val_correct", (logits.argmax(1) == y).sum(), reduce="sum")
        self.log("val_worst", per_sample.max(), reduce="max")
        self.log("val_best", per_sample.min(), reduce="min")
        return super().validation_step(model, batch)


class Seen(Callback):
    def __init__(self):
        self.logs, self.epochs, self.validations = [], [], []

    def on_log(self, trainer, scalars):
        self.logs.append(dict(scalars))

    def on_epoch_end(self, trainer, epoch, metrics):
        self.epochs.append(dict(metrics))

    def on_validation_end(self, trainer, metrics):
        self.validations.append(dict(metrics))
        trainer.log("from_callback", 2.5)  # a callback may log too: it joins the next window


def _fit(rank, world_size, config):
    seen = Seen()
    trainer = Logs(config, callbacks=[seen])
    final = trainer.fit()
    return seen, final, dict(trainer.callback_metrics), trainer.model.module


def _by_hand(module, trainer_class, config):
    x, y = trainer_class(config).val_dataloader().tensors
    with torch.no_grad():
        logits = module(x)
    per_sample = F.cross_entropy(logits, y, reduction="none").double()
    return {
        "val_loss": per_sample.mean().item(),
        "val_correct": float((logits.argmax(1) == y).sum()),
        "val_worst": per_sample.max().item(),
        "val_best": per_sample.min().item(),
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_logged_values_equal_a_single_process_computation(tmp_path, world_size):
    # 48 training samples in global batches of 12 (no training padding); 13 validation samples:
    # padding on 2 and 3 ranks, which must not be counted.
    config = _config(tmp_path, data={"global_batch_size": 12, "eval_batch_size": 4})
    results = run_threaded(_fit, world_size, config, timeout_s=120)
    single = _fit(0, 1, _config(tmp_path / "one", data={"global_batch_size": 12, "eval_batch_size": 4}))
    seen_1, _, _, module_1 = single
    by_hand = _by_hand(module_1, Logs, config)
    for seen, _, callback_metrics, _ in results:
        last = seen.validations[-1]
        for name, value in by_hand.items():
            assert last[name] == pytest.approx(value, rel=1e-5), name
            assert last[name] == pytest.approx(seen_1.validations[-1][name], rel=1e-5), name
        assert last["val_correct"] == pytest.approx(last["eval/accuracy"] * 13)
        assert last["val_loss"] == pytest.approx(last["eval/loss"], rel=1e-6)
        for epoch, epoch_1 in zip(seen.epochs, seen_1.epochs):
            assert epoch["samples_seen"] == 48.0  # a sum over ranks and steps
            assert epoch["batch_loss_epoch"] == pytest.approx(epoch_1["batch_loss_epoch"], rel=1e-5)
            assert epoch["batch_loss_epoch"] == pytest.approx(epoch["train/epoch_loss"], rel=1e-6)
        for log, log_1 in zip(seen.logs, seen_1.logs):
            assert log["batch_loss_step"] == pytest.approx(log["train/loss"], rel=1e-6)
            assert log["batch_loss_step"] == pytest.approx(log_1["batch_loss_step"], rel=1e-5)
            assert log["label_max"] == 2.0
        assert [("from_callback" in log) for log in seen.logs] == [False, False, True, False]
        assert callback_metrics["val_correct"] == last["val_correct"] and "batch_loss_epoch" in callback_metrics


def test_early_stopping_can_monitor_a_logged_value(tmp_path):
    stopper = EarlyStopping("val_worst", mode="max", patience=0)  # stops at the first check without a new max
    final = Logs(_config(tmp_path, epochs=20, data={"global_batch_size": 12}), callbacks=[stopper]).fit()
    assert final["stopped_early"] and final["step"] == stopper.stopped_step < 80


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"reduce": "avg"}, "reduce must be one of mean, sum, max, min"),
        ({"on_step": True}, "on_step=True) in validation_step"),
        ({"on_epoch": False}, "on_step=False, on_epoch=False) in validation_step would never report it"),
    ],
)
def test_bad_log_calls_are_refused(tmp_path, kwargs, message):
    class Bad(FixedInitTrainer):
        def validation_step(self, model, batch):
            self.log("x", 1.0, **kwargs)
            return super().validation_step(model, batch)

    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Bad(_config(tmp_path, epochs=1)).fit()


torchmetrics = pytest.importorskip("torchmetrics", reason="torchmetrics is optional: pip install ddptrain[metrics]")


class F1(FixedInitTrainer):
    """A non-per-sample metric: macro F1 over the validation set, from torchmetrics."""

    def configure_model(self):
        self.f1 = torchmetrics.classification.MulticlassF1Score(num_classes=3, average="macro")
        self.auroc = torchmetrics.classification.MulticlassAUROC(num_classes=3)  # a list ("cat") state
        return super().configure_model()

    def validation_step(self, model, batch):
        x, y = batch
        logits = model(x)
        self.f1.update(logits.argmax(1), y)
        self.auroc.update(logits.softmax(1), y)
        self.log("val_f1", self.f1)
        self.log("val_auroc", self.auroc)
        return super().validation_step(model, batch)


def _fit_f1(rank, world_size, config):
    trainer = F1(config)
    final = trainer.fit()
    return final, trainer.model.module


@pytest.mark.parametrize("world_size", [2, 3])
def test_torchmetrics_are_synchronised_through_ddptrains_group(tmp_path, world_size):
    config = _config(tmp_path, data={"global_batch_size": 12, "eval_batch_size": 4})
    results = run_threaded(_fit_f1, world_size, config, timeout_s=120)
    module = results[0][1]
    x, y = F1(config).val_dataloader().tensors
    with torch.no_grad():
        logits = module(x)
    f1 = torchmetrics.functional.classification.multiclass_f1_score(logits.argmax(1), y, num_classes=3, average="macro")
    auroc = torchmetrics.functional.classification.multiclass_auroc(logits.softmax(1), y, num_classes=3)
    for final, _ in results:
        assert final["val_f1"] == pytest.approx(float(f1), rel=1e-6)
        assert final["val_auroc"] == pytest.approx(float(auroc), rel=1e-6)
        assert final["eval/samples"] == 13


def test_prog_bar_values_reach_the_progress_bar(tmp_path, capsys):
    class Bar(FixedInitTrainer):
        def training_step(self, model, batch):
            loss = super().training_step(model, batch)
            self.log("shown", 2 * loss, prog_bar=True)
            self.log("hidden", loss)
            return loss

    config = _config(tmp_path, epochs=1, progress="true")
    trainer = Bar(config)
    trainer.fit()
    assert set(trainer.progress_bar_metrics) == {"shown"}
    assert trainer.progress_bar_metrics["shown"] == trainer.callback_metrics["shown"]
    assert "shown=" in capsys.readouterr().out  # the tqdm bar's postfix (on stdout)
