"""ZeRO in the Trainer (``dist.zero_stage``, ddptrain.trainer.zero_steps) on the threaded group.

A fit with ``dist.zero_stage=1|2`` over the ring ends with plain ring DDP's parameters bit for
bit (gradient accumulation included), within 1e-6 relative with gradient clipping; its
checkpoint's optimizer entry is plain DDP's, and it resumes at another world size, with ZeRO or
without, to the same parameters. What ZeRO cannot be combined with is refused before any
process starts, with the reason.
"""

import copy
import re

import pytest
import torch
from torch.utils.data import TensorDataset

from ddptrain import Config, Trainer
from ddptrain.config import ConfigError
from ddptrain.preflight import validate
from ddptrain.testing import run_threaded
from ddptrain.trainer.callbacks import Callback
from ddptrain.trainer.checkpoint import CheckpointError, load_checkpoint
from ddptrain.trainer.checkpoint.files import remove_checkpoint

pytestmark = pytest.mark.timeout(300)


class Task(Trainer):
    def configure_model(self):
        model = torch.nn.Sequential(torch.nn.Linear(8, 17), torch.nn.Tanh(), torch.nn.Linear(17, 3))
        g = torch.Generator().manual_seed(0)  # not the global RNG, which the rank threads share
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        return model

    def train_dataloader(self):
        x = torch.randn(240, 8, generator=torch.Generator().manual_seed(0))
        return TensorDataset(x, x[:, :3].argmax(1))

    def val_dataloader(self):
        return None


def _config(out, zero_stage, **trainer):
    return Config.from_dict(
        {
            "data": {"global_batch_size": 24},
            "dist": {"algorithm": "ring", "zero_stage": zero_stage, "bucket_cap_mb": 0.0002},
            "optimizer": {"name": "adamw", "lr": 0.01, "weight_decay": 0.1},
            "trainer": {
                "epochs": 2,
                "progress": False,
                "loggers": {"tensorboard": False},
                "output_dir": str(out),
                **trainer,
            },
        }
    )


def _fit(rank, world_size, out, zero_stage, **trainer):
    task = Task(_config(out, zero_stage, **trainer))
    task.fit()
    return [p.detach().clone() for p in task.model.module.parameters()]


@pytest.mark.parametrize("stage", [1, 2])
def test_a_zero_fit_ends_with_plain_ring_ddps_parameters(tmp_path, stage):
    plain = run_threaded(_fit, 3, tmp_path / "plain", 0, grad_accum_steps=2, timeout_s=120)
    zero = run_threaded(_fit, 3, tmp_path / "zero", stage, grad_accum_steps=2, timeout_s=120)
    assert all(torch.equal(a, b) for a, b in zip(plain[0], zero[0]))
    assert all(torch.equal(a, b) for rank in zero for a, b in zip(rank, zero[0]))


class EveryThirdStepSchedule(Task):
    """A user's per-step schedule due every third optimizer step (Lightning's scheduler dict)."""

    def configure_optimizers(self, model):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 3}}


class LearningRates(Callback):
    def __init__(self):
        self.seen = []

    def on_train_batch_end(self, trainer, loss):
        self.seen.append(trainer.optimizer.param_groups[0]["lr"])


def _fit_lrs(rank, world_size, out, zero_stage):
    lrs = LearningRates()
    EveryThirdStepSchedule(_config(out, zero_stage, epochs=1, max_steps=7), callbacks=[lrs]).fit()
    return lrs.seen


def test_a_per_step_schedule_is_due_at_the_same_steps_as_in_plain_ddp(tmp_path):
    plain = run_threaded(_fit_lrs, 2, tmp_path / "plain", 0, timeout_s=120)
    zero = run_threaded(_fit_lrs, 2, tmp_path / "zero", 2, timeout_s=120)
    assert zero == plain
    assert plain[0] == [0.1, 0.1, 0.05, 0.05, 0.05, 0.025, 0.025]  # halved after steps 3 and 6


def test_each_rank_says_how_many_elements_it_steps_and_together_they_are_every_one(tmp_path, caplog):
    caplog.set_level("INFO", logger="ddptrain.trainer")
    run_threaded(_fit, 3, tmp_path, 2, max_steps=1, timeout_s=120)
    lines = [r.getMessage() for r in caplog.records if "this rank steps" in r.getMessage()]
    counts = [re.search(r"this rank steps (\d+) of (\d+) parameter elements", line).groups() for line in lines]
    assert len(counts) == 3 and {total for _, total in counts} == {str(8 * 17 + 17 + 17 * 3 + 3)}, lines
    assert sum(int(held) for held, _ in counts) == 8 * 17 + 17 + 17 * 3 + 3, lines


def test_clipping_stays_within_1e_6_relative_of_plain_ddp(tmp_path):
    plain = run_threaded(_fit, 3, tmp_path / "plain", 0, grad_clip_norm=0.1, timeout_s=120)
    zero = run_threaded(_fit, 3, tmp_path / "zero", 2, grad_clip_norm=0.1, timeout_s=120)
    for a, b in zip(plain[0], zero[0]):
        assert ((a - b).abs().max() / a.abs().max()).item() < 1e-6


def test_a_zero_checkpoint_is_plain_and_resumes_at_another_world_size(tmp_path):
    run_threaded(_fit, 4, tmp_path / "plain4", 0, max_steps=7, timeout_s=120)
    run_threaded(_fit, 4, tmp_path / "zero4", 2, max_steps=7, timeout_s=120)
    plain = load_checkpoint(tmp_path / "plain4" / "checkpoints" / "step_000000007.pt")
    zero = load_checkpoint(tmp_path / "zero4" / "checkpoints" / "step_000000007.pt")
    assert plain["optimizer"]["param_groups"] == zero["optimizer"]["param_groups"]
    for i, state in plain["optimizer"]["state"].items():
        assert all(torch.equal(v, zero["optimizer"]["state"][i][k]) for k, v in state.items())
    ckpt = str(tmp_path / "zero4" / "checkpoints" / "step_000000007.pt")
    again = {"resume": ckpt, "allow_world_size_change": True}
    as_plain = run_threaded(_fit, 2, tmp_path / "p2", 0, timeout_s=120, **again)
    as_zero = run_threaded(_fit, 2, tmp_path / "z2", 2, timeout_s=120, **again)
    assert all(torch.equal(a, b) for a, b in zip(as_plain[0], as_zero[0]))
    assert not all(torch.equal(a, b) for a, b in zip(as_plain[0], zero["model"].values())), "nothing trained"


def test_a_sharded_checkpoint_keeps_one_shard_per_rank_and_reads_back_as_the_consolidated_one(tmp_path):
    """trainer.checkpoint.sharded=true at 4 ranks: four shard files beside the checkpoint, none
    holding the whole state, the checkpoint itself none of it; read back, the state is the
    consolidated checkpoint's bit for bit, and it resumes at 2 ranks (ZeRO and plain DDP) as that one does."""
    run_threaded(_fit, 4, tmp_path / "zero4", 2, max_steps=7, timeout_s=120)
    run_threaded(_fit, 4, tmp_path / "shard4", 2, max_steps=7, checkpoint={"sharded": True}, timeout_s=120)
    consolidated_path = tmp_path / "zero4" / "checkpoints" / "step_000000007.pt"
    sharded_path = tmp_path / "shard4" / "checkpoints" / "step_000000007.pt"
    raw = torch.load(sharded_path, weights_only=True)
    assert raw["optimizer"]["shards"] == 4 and "state" not in raw["optimizer"]
    total = sum(p.numel() for p in Task(_config(tmp_path, 0)).configure_model().parameters())
    held = []
    for rank in range(4):
        shard = tmp_path / "shard4" / "checkpoints" / f"step_000000007.pt.optim-{rank}-of-4"
        assert shard.with_name(shard.name + ".sha256").is_file()
        pieces = torch.load(shard, weights_only=True)["params"].values()
        assert all(p["state"]["exp_avg"].numel() == p["hi"] - p["lo"] for p in pieces)
        held.append(sum(p["hi"] - p["lo"] for p in pieces))
    assert sum(held) == total and max(held) < total, held  # every element once, no rank all of them
    consolidated, sharded = load_checkpoint(consolidated_path), load_checkpoint(sharded_path)
    assert sharded["optimizer"]["param_groups"] == consolidated["optimizer"]["param_groups"]
    assert sharded["optimizer"]["state"].keys() == consolidated["optimizer"]["state"].keys()
    for i, state in consolidated["optimizer"]["state"].items():
        assert all(torch.equal(v, sharded["optimizer"]["state"][i][k]) for k, v in state.items()), i
    again = {"allow_world_size_change": True, "timeout_s": 120}
    for stage in (0, 2):
        from_sharded = run_threaded(_fit, 2, tmp_path / f"s{stage}", stage, resume=str(sharded_path), **again)
        from_consolidated = run_threaded(_fit, 2, tmp_path / f"c{stage}", stage, resume=str(consolidated_path), **again)
        assert all(torch.equal(a, b) for a, b in zip(from_sharded[0], from_consolidated[0])), stage


def test_a_sharded_checkpoint_missing_a_shard_is_refused_naming_it_and_deleting_it_takes_the_shards(tmp_path):
    run_threaded(_fit, 2, tmp_path / "run", 1, max_steps=3, checkpoint={"sharded": True}, timeout_s=120)
    path = tmp_path / "run" / "checkpoints" / "step_000000003.pt"
    (tmp_path / "run" / "checkpoints" / "step_000000003.pt.optim-1-of-2").unlink()
    with pytest.raises(CheckpointError, match=r"step_000000003.pt.optim-1-of-2 is missing"):
        load_checkpoint(path)
    remove_checkpoint(path)
    assert sorted(p.name for p in path.parent.iterdir()) == []


def test_sharded_checkpoints_without_zero_are_refused():
    with pytest.raises(ConfigError, match="trainer.checkpoint.sharded=true writes each rank's shard of a ZeRO"):
        validate(Config.from_dict({"trainer": {"checkpoint": {"sharded": True}}}), 2)


@pytest.mark.parametrize(
    "override, message",
    [
        (
            {"dist": {"find_unused_parameters": True}},
            "dist.zero_stage=2 cannot be combined with dist.find_unused_parameters=true: a parameter without a "
            "gradient would still be stepped",
        ),
        ({"dist": {"gradient_as_bucket_view": True}}, "cannot be combined with dist.gradient_as_bucket_view=true"),
        ({"dist": {"bucket_cap_mb": "auto"}}, "cannot be combined with dist.bucket_cap_mb=auto"),
        (
            {"trainer": {"precision": "16-mixed", "device": "cuda"}},
            "cannot be combined with trainer.precision=16-mixed: its gradient scaler",
        ),
    ],
)
def test_incompatible_settings_are_refused_with_the_reason(override, message):
    data = {"dist": {"zero_stage": 2}, "trainer": {}}
    for section, values in override.items():
        data[section] = {**data.get(section, {}), **values}
    with pytest.raises(ConfigError) as err:
        validate(Config.from_dict(copy.deepcopy(data)), 2)
    assert message in str(err.value)
    assert "or train with dist.zero_stage=0" in str(err.value)


def test_a_stage_that_does_not_exist_is_refused():
    with pytest.raises(ConfigError, match="dist.zero_stage=3 is not one of 0, 1, 2"):
        validate(Config.from_dict({"dist": {"zero_stage": 3}}), 2)


class LbfgsTask(Task):
    def configure_optimizers(self, model):
        return torch.optim.LBFGS(model.parameters())


def test_an_optimizer_that_couples_elements_is_refused_by_name(tmp_path):
    def body(rank, world_size):
        LbfgsTask(_config(tmp_path, 1)).fit()

    with pytest.raises(ConfigError, match="ZeRO cannot shard the optimizer LBFGS"):
        run_threaded(body, 2, timeout_s=60)


class TwoOptimizersTask(Task):
    def configure_optimizers(self, model):
        first, second = model[0], model[2]
        return [torch.optim.SGD(first.parameters(), lr=0.1), torch.optim.Adam(second.parameters())]


def test_more_than_one_optimizer_is_refused_with_the_count(tmp_path):
    def body(rank, world_size):
        TwoOptimizersTask(_config(tmp_path, 2)).fit()

    with pytest.raises(ConfigError, match="shards one optimizer, and configure_optimizers returned 2"):
        run_threaded(body, 2, timeout_s=60)


def test_shards_that_do_not_cover_a_parameter_exactly_once_are_refused_naming_it():
    from ddptrain.ddp.zero import consolidate_shards

    def piece(lo, hi):
        return {"lo": lo, "hi": hi, "shape": [2, 3], "state": {"step": torch.tensor(1.0), "v": torch.ones(hi - lo)}}

    groups = {"param_groups": []}
    whole = consolidate_shards(groups, [{"params": {0: piece(0, 4)}}, {"params": {0: piece(4, 6)}}])
    assert whole["state"][0]["v"].shape == (2, 3) and float(whole["state"][0]["step"]) == 1.0
    for parts in ([piece(0, 4)], [piece(0, 4), piece(3, 6)]):  # a gap; an overlap
        with pytest.raises(ValueError, match=r"parameter 0 \(shape \(2, 3\)\) cover elements"):
            consolidate_shards(groups, [{"params": {0: p}} for p in parts])
