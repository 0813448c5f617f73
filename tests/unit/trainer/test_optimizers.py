"""What configure_optimizers may return: one optimizer, several (each stepped and zeroed, held
against a hand-run loop), Lightning's dict with step/epoch intervals and ReduceLROnPlateau, and a
clear error for anything else. Checkpoints keep every optimizer and scheduler (exact resume)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ddptrain import ConfigError
from ddptrain.testing import run_threaded
from ddptrain.trainer.checkpoint import load_checkpoint

from .test_trainer import TinyTrainer, _config


def _two_layers():
    g = torch.Generator().manual_seed(3)
    model = nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def _two_optimizers(model):
    return (
        torch.optim.SGD(model[0].parameters(), lr=0.2, momentum=0.9),
        torch.optim.Adam(model[2].parameters(), lr=0.05),
    )


class TwoOptimizers(TinyTrainer):
    num_train = 48

    def configure_model(self):
        return _two_layers()

    def configure_optimizers(self, model):
        return _two_optimizers(model)  # a tuple of two optimizers: both step, neither is a scheduler


def _fit_two(rank, world_size, config):
    trainer = TwoOptimizers(config)
    metrics = trainer.fit()
    return {k: v.clone() for k, v in trainer.model.module.state_dict().items()}, metrics


def _hand_run(config, epochs, steps_per_epoch):
    """One process, full global batches in the sampler's order, both optimizers by hand."""
    model = _two_layers()
    first, second = _two_optimizers(model)
    x, y = TwoOptimizers(config).train_dataloader().tensors
    batch = config.data.global_batch_size
    for epoch in range(epochs):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(config.trainer.seed + epoch))
        for step in range(steps_per_epoch):
            index = order[step * batch : (step + 1) * batch]
            F.cross_entropy(model(x[index]), y[index]).backward()
            first.step()
            second.step()
            first.zero_grad()
            second.zero_grad()
    return model.state_dict()


@pytest.mark.parametrize("world_size", [1, 2])
def test_two_optimizers_are_each_stepped_and_zeroed(tmp_path, world_size):
    config = _config(tmp_path, data={"global_batch_size": 12})
    results = run_threaded(_fit_two, world_size, config, timeout_s=120)
    expected = _hand_run(config, epochs=2, steps_per_epoch=4)
    for params, metrics in results:
        assert metrics["step"] == 8 and metrics["params_agree"]
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_two_optimizers_resume_exactly(tmp_path):
    kwargs = {"data": {"global_batch_size": 12}, "checkpoint": {"every_steps": 3}}
    straight = TwoOptimizers(_config(tmp_path / "straight", **kwargs)).fit()
    TwoOptimizers(_config(tmp_path / "mid", stop_after_steps=3, **kwargs)).fit()
    saved = load_checkpoint(tmp_path / "mid" / "checkpoints" / "step_000000003.pt")
    assert isinstance(saved["optimizer"], list) and len(saved["optimizer"]) == 2 and saved["scheduler"] is None
    resumed = TwoOptimizers(_config(tmp_path / "mid", resume="latest", **kwargs)).fit()
    assert resumed["params_sha256"] == straight["params_sha256"]


class Returns(TinyTrainer):
    returned = None

    def configure_optimizers(self, model):
        return type(self).returned(model)


@pytest.mark.parametrize(
    ("returned", "expected"),
    [
        (lambda m: "sgd", "configure_optimizers returned str 'sgd'; return an optimizer, (optimizer, scheduler)"),
        (lambda m: None, "configure_optimizers returned NoneType None; return an optimizer"),
        (lambda m: [], "configure_optimizers returned a list of (); return an optimizer"),
        (
            lambda m: {"optim": torch.optim.SGD(m.parameters(), lr=0.1)},
            "configure_optimizers returned a dict with keys ['optim'] (unknown key(s) ['optim'])",
        ),
        (
            lambda m: (torch.optim.SGD(m.parameters(), lr=0.1), "cosine"),
            "configure_optimizers returned a tuple of (SGD, str); return",
        ),
        (
            lambda m: (torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(m.parameters(), lr=0.1)),
            "a parameter of shape (3, 8) is in optimizers 0 and 1: it would be updated twice per step",
        ),
        (
            lambda m: (opt := torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.lr_scheduler.ReduceLROnPlateau(opt)),
            "ReduceLROnPlateau needs a metric",
        ),
        (
            lambda m: {
                "optimizer": (opt := torch.optim.SGD(m.parameters(), lr=0.1)),
                "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1), "interval": "batch"},
            },
            "interval='batch' must be 'step' or 'epoch'",
        ),
    ],
)
def test_a_wrong_return_is_a_clear_error(tmp_path, returned, expected):
    trainer = type("Wrong", (Returns,), {"returned": staticmethod(returned)})(_config(tmp_path, epochs=1))
    with pytest.raises(ConfigError) as info:
        trainer.fit()
    assert expected in str(info.value)


class Frozen(TinyTrainer):
    """Learns nothing (zero gradients), so eval/loss is on a plateau; lr 0.1 halves on plateau."""

    interval = "epoch"

    def training_step(self, model, batch):
        return model(batch[0]).sum() * 0.0

    def configure_optimizers(self, model):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)
        schedule = {"scheduler": plateau, "monitor": "eval/loss", "interval": self.interval}
        return {"optimizer": optimizer, "lr_scheduler": schedule}


def test_reduce_lr_on_plateau_reduces_the_rate_on_every_plateau_epoch(tmp_path):
    lrs = []

    class Record(Frozen):
        def configure_callbacks(self):
            trainer = self

            class At(__import__("ddptrain").Callback):
                def on_epoch_end(self, t, epoch, metrics):
                    lrs.append(trainer.optimizer.param_groups[0]["lr"])

            return [*super().configure_callbacks(), At()]

    Record(_config(tmp_path, epochs=4)).fit()
    # Epoch 1 sets the best eval/loss; each later epoch equals it (no improvement, patience 0).
    assert lrs == pytest.approx([0.1, 0.05, 0.025, 0.0125])


def test_reduce_lr_on_plateau_state_survives_a_resume(tmp_path):
    kwargs = {"checkpoint": {"every_epochs": 1}}
    straight = Frozen(_config(tmp_path / "straight", epochs=4, **kwargs))
    straight.fit()
    Frozen(_config(tmp_path / "mid", epochs=4, stop_after_steps=8, **kwargs)).fit()
    resumed = Frozen(_config(tmp_path / "mid", epochs=4, resume="latest", **kwargs))
    resumed.fit()
    assert resumed.optimizer.param_groups[0]["lr"] == straight.optimizer.param_groups[0]["lr"] == 0.0125


def test_a_plateau_monitor_that_never_appears_is_a_clear_error(tmp_path):
    class Missing(Frozen):
        interval = "step"

    with pytest.raises(ConfigError) as info:
        Missing(_config(tmp_path, epochs=1)).fit()
    assert "ReduceLROnPlateau monitors 'eval/loss', but no metric of that name was reported by step 1" in str(
        info.value
    )


@pytest.mark.parametrize(
    ("interval", "expected_lr"), [("step", 0.5 * 0.5**8), ("epoch", 0.5 * 0.5**2), (None, 0.5 * 0.5**2)]
)
def test_scheduler_intervals(tmp_path, interval, expected_lr):
    class Scheduled(TinyTrainer):
        def configure_optimizers(self, model):
            optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
            spec = {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)}
            if interval is not None:
                spec["interval"] = interval  # absent: Lightning's default, every epoch
            return {"optimizer": optimizer, "lr_scheduler": spec}

    trainer = Scheduled(_config(tmp_path))
    trainer.fit()  # 2 epochs of 4 steps
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(expected_lr)
