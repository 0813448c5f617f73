"""ZeRO-1 in world-size-invariant mode (``dist.zero_stage=1`` with ``trainer.world_size_invariant``,
ddptrain/ddp/zero_whole.py): each rank holds a share of the optimizer state, and the bits are
those of the unsharded run at any world size, across resumes that change the world size and
switch ZeRO on or off, in both checkpoint formats. Threaded ranks."""

import re

import pytest
import torch
from torch.utils.data import TensorDataset

from ddptrain import Config, ConfigError, Trainer
from ddptrain.comm import get_process_group
from ddptrain.ddp.zero_whole import WholeGradientZero
from ddptrain.preflight import validate
from ddptrain.testing import run_threaded
from ddptrain.trainer.callbacks import Callback
from tests.conftest import merged
from tests.models import seeded_mlp

pytestmark = pytest.mark.timeout(300)


class Task(Trainer):
    def configure_model(self):
        return seeded_mlp(8, 24, 3)

    def train_dataloader(self):
        x = torch.randn(200, 8, generator=torch.Generator().manual_seed(0))
        return TensorDataset(x, x[:, :3].argmax(1))

    def val_dataloader(self):
        return None


def _config(out, zero_stage, **trainer):
    return Config.from_dict(
        {
            "data": {"global_batch_size": 24},
            "dist": {"zero_stage": zero_stage},
            "optimizer": {"name": "adamw", "lr": 0.01, "weight_decay": 0.1},
            "trainer": {
                "epochs": 2,
                "world_size_invariant": True,
                "virtual_ranks": 12,  # 1, 2, 3 and 4 ranks divide it
                "progress": False,
                "log_every_steps": 1,
                "loggers": {"tensorboard": False, "csv": False},
                "output_dir": str(out),
                **trainer,
            },
        }
    )


class _StateHeld(Callback):
    """Each rank's optimizer state bytes at the end, and whether the trainer's own optimizer holds
    any (under ZeRO it must not: the shards' optimizer does)."""

    def __init__(self, held):
        self.held = held

    def on_fit_end(self, trainer, metrics):
        zero = trainer.strategy.update.zero
        assert zero is None or not trainer.optimizer_set.optimizer.state
        self.held[trainer.rank] = zero.state_bytes() if zero is not None else None


def _fit(rank, world_size, out, zero_stage, held=None, optimizer=None, **trainer):
    config = _config(out, zero_stage, **trainer)
    if optimizer:
        config = Config.from_dict(merged(config.to_dict(), {"optimizer": optimizer}))
    task = Task(config, callbacks=[] if held is None else [_StateHeld(held)])
    final = task.fit()
    return final["params_sha256"], task.loss_history, final["step"]


def test_zero_1_ends_with_the_unsharded_bits_at_1_2_3_and_4_ranks_holding_a_share_of_the_state(tmp_path, caplog):
    caplog.set_level("INFO", logger="ddptrain.trainer")
    plain = run_threaded(_fit, 1, tmp_path / "plain", 0, timeout_s=120)[0]
    assert plain[2] == 18  # 2 epochs of 9 steps (the last of each short)
    for world_size in (2, 3, 4):
        held = {}
        ranks = run_threaded(_fit, world_size, tmp_path / f"z{world_size}", 1, held, timeout_s=120)
        assert {r[0] for r in ranks} == {plain[0]}, f"ZeRO-1 at {world_size} ranks ends with other bits"
        assert ranks[0][1] == plain[1]  # and logs the same losses
        whole = 2 * 4 * sum(p.numel() for p in seeded_mlp(8, 24, 3).parameters())  # AdamW's two moments, fp32
        assert all(abs(n - whole / world_size) <= 64 for n in held.values()), held  # and each piece's step
    # each rank says which elements it steps: at 4 ranks, 4 ranges that tile every parameter element
    said = [
        re.search(r"this rank steps parameter elements (\d+)-(\d+) of (\d+)", r.getMessage()) for r in caplog.records
    ]
    ranges = sorted((int(m[1]), int(m[2]), int(m[3])) for m in [m for m in said if m][-4:])  # the 4-rank run's
    total = sum(p.numel() for p in seeded_mlp(8, 24, 3).parameters())
    assert [r[2] for r in ranges] == [total] * 4 and ranges[0][0] == 0 and ranges[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), ranges


@pytest.mark.parametrize(
    ("chain", "checkpoint_format"),
    [
        pytest.param([(4, 1), (3, 1), (1, 0)], "dcp", id="zero1@4-zero1@3-plain@1-dcp"),
        pytest.param([(4, 1), (3, 1), (1, 0)], "torch", id="zero1@4-zero1@3-plain@1-torch"),
        pytest.param([(2, 0), (3, 1)], "dcp", id="plain@2-zero1@3-dcp"),
    ],
)
def test_a_run_stopped_and_resumed_across_world_sizes_and_zero_ends_bitwise_as_the_uninterrupted_one(
    tmp_path, chain, checkpoint_format
):
    """No trainer.allow_world_size_change: invariant mode resumes at any world size."""
    whole = run_threaded(_fit, 1, tmp_path / "whole", 0, timeout_s=120)[0]
    run_dir, checkpoint = tmp_path / "run", {"format": checkpoint_format}
    stops = [5, 11, None][: len(chain) - 1] + [None]
    for i, ((world_size, stage), stop) in enumerate(zip(chain, stops)):
        resume = {"resume": str(run_dir)} if i else {}
        held = {} if stage else None  # and the trainer's own optimizer holds no state after the resume
        leg = {"stop_after_steps": stop, "checkpoint": checkpoint, **resume}
        ranks = run_threaded(_fit, world_size, run_dir, stage, held, timeout_s=120, **leg)
        assert len({r[0] for r in ranks}) == 1
    digest, losses, step = ranks[0]
    assert step == 18 and digest == whole[0]
    assert losses == whole[1][-len(losses) :]  # the last leg's losses are the uninterrupted run's


def test_a_schedule_drives_the_shards_and_the_optimizers_step_hooks_see_every_step(tmp_path):
    """The learning rate a scheduler sets on the trainer's optimizer reaches the shards' (warm-up
    then cosine: the bits of the unsharded run), and the trainer's optimizer still steps."""
    schedule = {"name": "adamw", "lr": 0.01, "scheduler": {"name": "cosine", "warmup_steps": 5}}
    plain = run_threaded(_fit, 1, tmp_path / "plain", 0, optimizer=schedule, timeout_s=120)[0]
    sharded = run_threaded(_fit, 3, tmp_path / "z3", 1, optimizer=schedule, timeout_s=120)
    assert {r[0] for r in sharded} == {plain[0]}

    steps = []

    def counted(rank, world_size):
        optimizer = torch.optim.AdamW(seeded_mlp(8, 24, 3).parameters(), lr=0.01)
        optimizer.register_step_post_hook(lambda *_: steps.append(rank))
        zero = WholeGradientZero(optimizer, get_process_group())
        for p in optimizer.param_groups[0]["params"]:
            p.grad = torch.ones_like(p)
        zero.step()

    run_threaded(counted, 2, timeout_s=60)
    assert sorted(steps) == [0, 1]


def test_optimizers_and_parameters_it_cannot_shard_are_refused_by_name():
    def build(rank, world_size, optimizer):
        WholeGradientZero(optimizer, get_process_group())

    mixed = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))]
    with pytest.raises(ValueError, match=r"parameters in one buffer, and they come in 2 dtypes or devices"):
        run_threaded(build, 2, torch.optim.SGD(mixed, lr=0.1), timeout_s=60)
    with pytest.raises(ValueError, match=r"ZeRO cannot shard the optimizer LBFGS"):
        run_threaded(build, 2, torch.optim.LBFGS([torch.nn.Parameter(torch.zeros(3))]), timeout_s=60)


def test_zero_2_in_invariant_mode_is_refused_saying_why():
    config = Config.from_dict({"dist": {"zero_stage": 2}, "trainer": {"world_size_invariant": True}})
    with pytest.raises(ConfigError, match=r"every rank holds the whole exact gradient, so there are no gradient"):
        validate(config, 2)
    validate(Config.from_dict({"dist": {"zero_stage": 1}, "trainer": {"world_size_invariant": True}}), 2)
