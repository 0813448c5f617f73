"""Modes compose through the registry (ddptrain.modes): a new mode is one strategy class plus one
``register`` call, with no edit to the Trainer or to another mode's rules; its rules meet the
others' through capabilities, and two modes that would both pick the strategy are refused."""

import dataclasses

import pytest
import torch
from torch.utils.data import TensorDataset

from ddptrain import Config, ConfigError, Trainer
from ddptrain.modes import Feature, Mode, Refusal, features, mode_of, register, registered
from ddptrain.preflight import validate
from ddptrain.testing import run_threaded
from ddptrain.trainer.steps import DataParallelSteps, StepStrategy
from tests.models import argmax_task, seeded_mlp

pytestmark = pytest.mark.timeout(120)

LR = 0.01


class SignSteps(DataParallelSteps):
    """A toy mode: signSGD over plain DDP's reduced gradients (each one replaced by its sign)."""

    def forward_backward(self, micro_batches):
        loss = super().forward_backward(micro_batches)
        for p in self.trainer.model.parameters():
            if p.grad is not None:
                p.grad.sign_()
        return loss


SIGN_SGD = Mode(
    name="sign_sgd",
    active=lambda c: bool(c.recipe.params.get("sign_sgd")),
    setting=lambda c: "recipe.params.sign_sgd=true",
    way_back="drop recipe.params.sign_sgd",
    refuses=[
        Refusal(lambda c: c.trainer.grad_clip_norm is not None, "trainer.grad_clip_norm", "a sign has no norm to clip")
    ],
    lacks={"full_precision_gradients": "sign SGD sends the gradients' signs"},
    strategy=SignSteps,
    priority=50,
)


class Task(Trainer):
    def configure_model(self):
        return seeded_mlp(6, 9, 3)

    def train_dataloader(self):
        return argmax_task(64, 6)

    def val_dataloader(self):
        return None


def _config(out, override=None, **params):
    raw = {
        "recipe": {"params": params},
        "data": {"global_batch_size": 16},
        "dist": {},
        "optimizer": {"name": "sgd", "lr": LR, "momentum": 0.0, "weight_decay": 0.0},
        "trainer": {"max_steps": 1, "progress": False, "loggers": {"tensorboard": False}, "output_dir": str(out)},
    }
    for section, values in (override or {}).items():
        raw[section].update(values)
    return Config.from_dict(raw)


def _one_step(rank, world_size, out, params):
    task = Task(_config(out, **params))
    before = [p.detach().clone() for p in task.configure_model().parameters()]
    task.fit()
    return type(task.strategy).__name__, [p.detach() - b for p, b in zip(task.model.module.parameters(), before)]


def test_a_toy_mode_registered_by_a_test_trains_a_fit_with_no_edit_to_the_trainer(tmp_path):
    with registered(SIGN_SGD):
        validate(_config(tmp_path, sign_sgd=True), 2)
        toy = run_threaded(_one_step, 2, tmp_path / "toy", {"sign_sgd": True}, timeout_s=60)
    plain = run_threaded(_one_step, 2, tmp_path / "plain", {}, timeout_s=60)
    assert [name for name, _ in toy] == ["SignSteps", "SignSteps"]
    assert [name for name, _ in plain] == ["DataParallelSteps", "DataParallelSteps"]
    moved = torch.cat([d.flatten() for d in toy[0][1]])
    exactly_lr = torch.full_like(moved, LR)  # up to float32 rounding of p - lr
    assert torch.allclose(moved.abs(), exactly_lr, rtol=0, atol=1e-6), "sign SGD moves every weight by lr"
    assert all(torch.equal(a, b) for a, b in zip(toy[0][1], toy[1][1])), "the ranks agree"
    plain_moved = torch.cat([d.flatten() for d in plain[0][1]]).abs()
    assert not torch.allclose(plain_moved, exactly_lr, rtol=0, atol=1e-6), "without the mode, plain SGD"


def test_a_registered_modes_rules_meet_the_others_without_naming_them(tmp_path):
    with registered(SIGN_SGD):
        with pytest.raises(ConfigError) as err:  # its own refusal
            validate(_config(tmp_path, {"trainer": {"grad_clip_norm": 1.0}}, sign_sgd=True), 2)
        assert str(err.value) == (
            "recipe.params.sign_sgd=true cannot be combined with trainer.grad_clip_norm: a sign has no norm to "
            "clip. Drop trainer.grad_clip_norm, or drop recipe.params.sign_sgd."
        )
        with pytest.raises(ConfigError) as err:  # a capability the doctor needs and it lacks
            validate(_config(tmp_path, {"trainer": {"doctor": True}}, sign_sgd=True), 2)
        assert str(err.value) == (
            "recipe.params.sign_sgd=true cannot be combined with trainer.doctor=true: the doctor's model of a "
            "step predicts full-precision all-reduces, and sign SGD sends the gradients' signs. Drop "
            "trainer.doctor, or drop recipe.params.sign_sgd."
        )
        with pytest.raises(ConfigError) as err:  # two modes would pick the strategy
            validate(_config(tmp_path, {"dist": {"zero_stage": 1}}, sign_sgd=True), 2)
        assert str(err.value) == (
            "recipe.params.sign_sgd=true and dist.zero_stage=1 each pick how a step trains (SignSteps and "
            "ZeroSteps), and a run has one: drop recipe.params.sign_sgd, or train with dist.zero_stage=0."
        )
    validate(_config(tmp_path, {"trainer": {"doctor": True}}, sign_sgd=True), 2)  # gone with the block
    assert "sign_sgd" not in [f.name for f in features()]


def test_a_mode_that_composes_with_another_trains_with_it_and_the_others_rules_still_hold(tmp_path):
    """Declared with ``composes_with={"zero"}``, the toy mode meets ZeRO: no conflict, the higher
    priority's strategy trains, and ZeRO's own refusals still apply."""
    composing = dataclasses.replace(SIGN_SGD, composes_with=frozenset({"zero"}))
    with registered(composing):
        config = _config(tmp_path, {"dist": {"zero_stage": 1}}, sign_sgd=True)
        validate(config, 2)
        assert mode_of(config) is composing
        with pytest.raises(ConfigError, match=r"^dist.zero_stage=1 cannot be combined with dist.find_unused"):
            validate(_config(tmp_path, {"dist": {"zero_stage": 1, "find_unused_parameters": True}}, sign_sgd=True), 2)
    shared = Config.from_dict({"dist": {"zero_stage": 2}, "trainer": {"balance": {"shares": "auto"}}})
    validate(shared, 2)  # the built-in case: shared batches take ZeRO's update
    assert mode_of(shared).name == "shared_batches"
    with pytest.raises(ConfigError, match=r"^dist.zero_stage=2 cannot be combined with dist.gradient_as_bucket_view"):
        validate(dataclasses.replace(shared, dist=dataclasses.replace(shared.dist, gradient_as_bucket_view=True)), 2)


def test_a_feature_that_needs_what_a_built_in_mode_lacks_is_refused_with_both_reasons(tmp_path):
    probe = Feature(
        name="bucket_probe",
        active=lambda c: bool(c.recipe.params.get("probe")),
        setting=lambda c: "recipe.params.probe=true",
        way_back="drop recipe.params.probe",
        needs={"bucket_collectives": "the probe times the buckets"},
    )
    with registered(probe):
        config = _config(tmp_path, {"trainer": {"world_size_invariant": True}}, probe=True)
        with pytest.raises(
            ConfigError,
            match=r"^trainer.world_size_invariant=true cannot be combined with "
            r"recipe.params.probe=true: the probe times the buckets, and invariant mode sums",
        ):
            validate(config, 2)
        validate(_config(tmp_path, probe=True), 2)  # plain DDP has buckets


def test_a_name_is_registered_once():
    with registered(SIGN_SGD), pytest.raises(ValueError, match="named 'sign_sgd' is registered already"):
        register(SIGN_SGD)


@pytest.mark.parametrize(
    ("override", "mode", "strategy"),
    [
        ({}, "plain", "DataParallelSteps"),
        ({"dist": {"zero_stage": 2}}, "zero", "ZeroSteps"),
        ({"dist": {"sync": "diloco"}}, "local_steps", "LocalSteps"),
        ({"trainer": {"world_size_invariant": True}}, "world_size_invariant", "InvariantSteps"),
        ({"trainer": {"elastic": True}}, "shared_batches", "SharedBatchSteps"),
        ({"trainer": {"elastic": True, "world_size_invariant": True}}, "world_size_invariant", "InvariantSteps"),
    ],
)
def test_each_built_in_mode_is_picked_by_its_setting_and_names_a_strategy(override, mode, strategy):
    picked = mode_of(Config.from_dict(override))
    assert picked.name == mode
    assert picked.strategy_class().__name__ == strategy and issubclass(picked.strategy_class(), StepStrategy)


def test_plain_ddp_counts_an_epoch_by_this_ranks_share():
    """With data.drop_last, 10 samples over 3 ranks are 3 per rank: 3 steps of 3 samples (the tenth
    is dropped). Counted by global batches, as the elastic and invariant modes do, it would be 4."""
    from ddptrain.trainer.data import plan_epochs

    config = Config.from_dict({"data": {"global_batch_size": 3, "drop_last": True}})
    assert not mode_of(config).whole_global_batches
    plan = plan_epochs(config, TensorDataset(torch.zeros(10, 1)), None, 3, 0)
    assert plan.steps_per_epoch == 3
