"""Shares by speed (``trainer.balance``, ddptrain/trainer/balance.py) on the threaded group.

The spec: fixed weights cut each micro-batch by share and leave the gradient the per-sample mean
(normal mode) or the bits unchanged (invariant mode); ``auto`` moves work off a slow rank, at a
step boundary on every rank, and leaves an even job alone; bad input is refused before training.
The speed gained is measured in scripts/bench_balance.py, not here.
"""

import json
import re
import time

import pytest
import torch
from torch.utils.data import TensorDataset

from ddptrain import Config, ConfigError, Trainer, plugin_callbacks
from ddptrain.data.global_batches import shards_of_step, split_by_weight, virtual_ranks_by_weight
from ddptrain.preflight import validate
from ddptrain.testing import run_threaded
from ddptrain.trainer.balance import capped_proportions
from tests.models import seeded_mlp

pytestmark = pytest.mark.timeout(120)


class Task(Trainer):
    slow_rank: int | None = None  # this rank sleeps 3 ms per sample in each training step
    seen: dict | None = None  # rank -> the batch sizes it trained on

    def configure_model(self):
        return seeded_mlp(8, 16, 3)

    def train_dataloader(self):
        x = torch.randn(480, 8, generator=torch.Generator().manual_seed(0))
        return TensorDataset(x, x[:, :3].argmax(1))

    def val_dataloader(self):
        return None

    def training_step(self, model, batch):
        if self.seen is not None:
            self.seen.setdefault(self.rank, []).append(len(batch[0]))
        if self.rank == self.slow_rank:
            time.sleep(0.003 * len(batch[0]))
        return super().training_step(model, batch)


def _config(out, shares, invariant=False, zero_stage=0, **balance):
    return Config.from_dict(
        {
            "data": {"global_batch_size": 32},
            "dist": {"zero_stage": zero_stage},
            "optimizer": {"name": "adamw", "lr": 0.01},
            "trainer": {
                "epochs": 1,
                "world_size_invariant": invariant,
                "virtual_ranks": 16,
                "progress": False,
                "loggers": {"tensorboard": False, "csv": False},
                "checkpoint": {"every_epochs": 0, "at_end": False},
                "output_dir": str(out),
                "balance": {"shares": shares, **balance},
            },
        }
    )


def _fit(rank, world_size, config, slow_rank=None, seen=None):
    task = Task(config, callbacks=plugin_callbacks(config))  # the doctor, when trainer.doctor is on
    task.slow_rank, task.seen = slow_rank, seen
    final = task.fit()
    return final, [p.detach().clone() for p in task.model.module.parameters()]


def test_units_are_dealt_by_weight_each_rank_at_least_one_and_a_cap_holds():
    assert split_by_weight(10, [2, 1]) == [7, 3] and split_by_weight(16, [1, 0.5]) == [11, 5]
    assert split_by_weight(8, [100, 1]) == [7, 1]  # never fewer than one: a slow rank is not removed
    assert split_by_weight(7, [1, 1, 1]) == [3, 2, 2] and sum(split_by_weight(1000, [0.3, 0.7, 1.9])) == 1000
    assert [list(virtual_ranks_by_weight(r, 8, [3, 1])) for r in range(2)] == [[0, 1, 2, 3, 4, 5], [6, 7]]
    assert split_by_weight(2, [1, 1]) == [1, 1]
    with pytest.raises(ValueError, match=r"1 units cannot give each of 2 ranks at least 1"):
        split_by_weight(1, [1, 1])
    assert capped_proportions([3, 1], None) == [0.75, 0.25]
    assert capped_proportions([8, 1, 1], 0.6) == pytest.approx([0.6, 0.2, 0.2])  # the rest in proportion
    assert capped_proportions([8, 1, 3], 0.6) == pytest.approx([0.6, 0.1, 0.3])
    assert capped_proportions([5, 5, 1, 1], 0.3) == pytest.approx([0.3, 0.3, 0.2, 0.2])  # two capped


def test_weights_cut_each_micro_batch_of_a_step_into_slices_that_take_every_sample_once():
    step = shards_of_step(100, 20, 2, 2, range(2), [3, 1])  # 2 micro-batches of 10, each cut 8:2
    assert [(s.index, s.start, s.end) for s in step.shards] == [
        (0, 100, 108),
        (1, 108, 110),
        (2, 110, 118),
        (3, 118, 120),
    ]
    assert [(s.start, s.end) for s in shards_of_step(100, 20, 2, 2, range(1, 2), [3, 1]).shards] == [
        (108, 110),
        (118, 120),
    ]
    short = shards_of_step(0, 3, 2, 2, range(2), [1, 1])  # a last micro-batch of 1 sample for 2 ranks
    assert [(s.start, s.end) for s in short.shards] == [(0, 1), (1, 2), (2, 3), (3, 3)]
    lopsided = shards_of_step(0, 2, 1, 2, range(2), [100, 1])  # as many samples as ranks: one each
    assert [(s.start, s.end) for s in lopsided.shards] == [(0, 1), (1, 2)]


def test_fixed_weights_cut_each_micro_batch_by_share_and_keep_the_per_sample_mean(tmp_path):
    seen = {}
    even = run_threaded(_fit, 2, _config(tmp_path / "even", "off"), timeout_s=60)
    shared = run_threaded(_fit, 2, _config(tmp_path / "shared", [3, 1]), None, seen, timeout_s=60)
    assert seen[0][:3] == [24, 24, 24] and seen[1][:3] == [8, 8, 8]  # 3:1 of each global batch of 32
    for a, b in zip(even[0][1], shared[0][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)  # the same gradients, summed in another order
    assert shared[0][0]["balance"] == {"shares": [0.75, 0.25], "changes": []}


@pytest.mark.parametrize("stage", [1, 2])
def test_shares_compose_with_zero_in_normal_mode(tmp_path, stage, caplog):
    """ZeRO's shards cut parameters and the shares cut samples: with weights 3:1 the ranks train
    on 24 and 8 samples per step, each steps its own part of the parameters, and the run ends
    where the even unsharded run does."""
    caplog.set_level("INFO", logger="ddptrain.trainer")
    seen = {}
    even = run_threaded(_fit, 2, _config(tmp_path / "even", "off"), timeout_s=60)
    config = _config(tmp_path / "zero", [3, 1], zero_stage=stage)
    validate(config, 2)  # the two modes compose: no refusal
    shared = run_threaded(_fit, 2, config, None, seen, timeout_s=60)
    assert seen[0][:3] == [24, 24, 24] and seen[1][:3] == [8, 8, 8]
    for a, b in zip(even[0][1], shared[0][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    steps = [re.search(r"this rank steps (\d+) of (\d+)", r.getMessage()) for r in caplog.records]
    held = [(int(m[1]), int(m[2])) for m in steps if m]
    assert len(held) == 2 and sum(h for h, _ in held) == held[0][1] and all(h < total for h, total in held)


def test_in_invariant_mode_any_shares_give_the_same_bits(tmp_path):
    uniform = run_threaded(_fit, 1, _config(tmp_path / "one", "off", invariant=True), timeout_s=60)[0][0]
    dealt = run_threaded(_fit, 2, _config(tmp_path / "dealt", [3, 1], invariant=True), timeout_s=60)[0][0]
    assert dealt["params_sha256"] == uniform["params_sha256"]


@pytest.mark.parametrize("invariant", [False, True], ids=["normal", "invariant"])
def test_auto_moves_work_off_a_slow_rank_at_a_step_boundary(tmp_path, invariant, caplog):
    """Rank 1 sleeps 3 ms per sample: after the first window, rank 0 takes more than 60% of each batch,
    and the log says so once. In invariant mode the run still ends with the uniform run's bits."""
    caplog.set_level("INFO", logger="ddptrain.trainer")
    seen = {}
    config = _config(tmp_path / "auto", "auto", invariant, window=3)
    final = run_threaded(_fit, 2, config, 1, seen, timeout_s=90)[0][0]
    changes = final["balance"]["changes"]
    assert changes and changes[0]["step"] == 3, changes  # decided after the window of 3 steps
    assert changes[0]["shares"][0] > 0.6 and changes[0]["predicted_step_s"] < changes[0]["previous_step_s"]
    assert changes[0]["seconds_per_sample"][1] >= 0.003  # it sleeps 3 ms per sample: at least that
    # before the change, 16 samples of a 32-sample step on each rank: the slower rank's time
    assert changes[0]["previous_step_s"] == pytest.approx(16 * max(changes[0]["seconds_per_sample"]))
    assert final["balance"]["shares"][0] > 0.6
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("balance: shares")]
    first = changes[0]
    expected = (
        f"balance: shares {first['shares'][0]:.3f}, {first['shares'][1]:.3f} from step 3 (compute per sample "
        f"{first['seconds_per_sample'][0] * 1e3:.3f}, {first['seconds_per_sample'][1] * 1e3:.3f} ms; predicted step "
        f"{first['predicted_step_s'] * 1e3:.1f} ms, was {first['previous_step_s'] * 1e3:.1f} ms)"
    )
    assert logged[0] == expected and len(logged) == len(changes), logged  # rank 0 alone, once per change
    # measured too: a step of the window after the change against one of the window before
    assert changes[0]["measured_step_s_before"] >= changes[0]["previous_step_s"]  # the slow rank's compute, at least
    assert changes[0]["measured_gain"] > 1.2, changes[0]  # 2x predicted; the machine is busy
    if invariant:
        assert len(seen[1]) < len(seen[0]), {r: len(v) for r, v in seen.items()}  # rank 1 was dealt fewer shards
        uniform = run_threaded(_fit, 1, _config(tmp_path / "one", "off", invariant=True), timeout_s=60)[0][0]
        assert final["params_sha256"] == uniform["params_sha256"]
    else:
        first, later = seen[1][0], seen[1][-2]
        assert first == 16 and later < 16, seen[1]  # rank 1's slices shrank from the fourth step on


def test_the_doctors_report_says_what_auto_chose_and_gained(tmp_path, caplog):
    """At the end of fit the doctor's report gains a ``balance`` entry: the shares auto chose, each
    change's predicted and measured gain. (Rank 1 sleeps, which the doctor does not count as the
    busy work of a straggler: its window reports no cause for that.)"""
    caplog.set_level("INFO", logger="ddptrain.doctor")
    config = _config(tmp_path, "auto", window=3)
    config.trainer.doctor, config.doctor.warmup_steps, config.doctor.steps = True, 1, 3
    final = run_threaded(_fit, 2, config, 1, timeout_s=90)[0][0]
    report = json.loads((tmp_path / "doctor.json").read_text())
    balance = report["balance"]
    assert balance["shares"] == final["balance"]["shares"] and balance["shares"][0] > 0.6
    first = final["balance"]["changes"][0]
    assert balance["changes"][0] == {
        "step": first["step"],
        "kind": "faster",
        "shares": first["shares"],
        "predicted_gain": pytest.approx(first["previous_step_s"] / first["predicted_step_s"]),
        "measured_gain": first["measured_gain"],
    }
    assert balance["changes"][0]["measured_gain"] > 1.2
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("doctor: balance chose")]
    assert len(lines) == 1 and f"step {first['step']}: predicted" in lines[0], lines


@pytest.mark.parametrize("invariant", [False, True], ids=["normal", "invariant"])
def test_a_resume_goes_on_with_the_shares_auto_learnt_and_keeps_their_history(tmp_path, invariant):
    """The checkpoint of step 6 holds the change auto made at step 3: resumed from it, rank 1
    trains on less from the first step, and metrics.json still lists that change. In invariant
    mode the resumed run ends with the uniform run's bits, and so does a resume with the shares off."""
    config = _config(tmp_path / "first", "auto", invariant, window=3)
    config.trainer.checkpoint.every_steps = 6
    first = run_threaded(_fit, 2, config, 1, timeout_s=90)[0][0]
    learnt = first["balance"]["changes"][0]
    assert learnt["step"] == 3
    checkpoint = str(tmp_path / "first" / "checkpoints" / "step_000000006.pt")
    seen = {}
    again = _config(tmp_path / "again", "auto", invariant, window=3)
    again.trainer.resume = checkpoint
    resumed = run_threaded(_fit, 2, again, 1, seen, timeout_s=90)[0][0]
    decided = ("step", "shares", "seconds_per_sample", "predicted_step_s", "previous_step_s", "measured_step_s_before")
    assert {k: resumed["balance"]["changes"][0][k] for k in decided} == {k: learnt[k] for k in decided}
    if not invariant:
        assert seen[1][0] == round(16 * 2 * learnt["shares"][1]) < 16, (seen[1], learnt)  # not an even 16 first
        return
    assert len(seen[1]) < len(seen[0]), {r: len(v) for r, v in seen.items()}  # fewer shards dealt to rank 1
    uniform = run_threaded(_fit, 1, _config(tmp_path / "one", "off", invariant=True), timeout_s=60)[0][0]
    assert resumed["params_sha256"] == uniform["params_sha256"]
    off = _config(tmp_path / "off", "off", invariant=True)
    off.trainer.resume = checkpoint  # a balanced checkpoint, resumed without balance
    assert run_threaded(_fit, 2, off, timeout_s=60)[0][0]["params_sha256"] == uniform["params_sha256"]


def test_auto_keeps_equal_shares_unless_the_gain_passes_min_gain(tmp_path):
    config = _config(tmp_path / "auto", "auto", window=3, min_gain=0.95)
    final = run_threaded(_fit, 2, config, 1, timeout_s=90)[0][0]
    assert final["balance"]["shares"] == [0.5, 0.5] and final["balance"]["changes"] == []
    assert final["balance"]["seconds_per_sample"][1] > final["balance"]["seconds_per_sample"][0]  # measured


@pytest.mark.parametrize(
    ("balance", "message"),
    [
        ({"shares": [2, 1, 1]}, r"names 3 weight\(s\), and the job has 2 rank\(s\).*one weight per rank"),
        ({"shares": [0, 1]}, r"must be off, auto, or a list of positive weights"),
        ({"shares": [-1, 2]}, r"must be off, auto, or a list of positive weights"),
        (
            {"shares": "auto", "max_share": 0.4},
            r"max_share=0.4 is below the fair share of 2 rank\(s\), 1/2 = 0.5: .* Set it to at least 0.5, or null",
        ),
    ],
)
def test_bad_input_is_refused_before_training_naming_the_rule(balance, message):
    with pytest.raises(ConfigError, match=message):
        validate(Config.from_dict({"trainer": {"balance": balance}}), 2)


@pytest.mark.parametrize(("max_share", "world_size"), [(0.5, 2), (0.6, 2), (1 / 3, 3), (1.0, 4)])
def test_a_cap_at_or_above_the_fair_share_is_accepted(max_share, world_size):
    """The fair share itself passes (1/3 too, whose float times 3 is not exactly 1)."""
    validate(Config.from_dict({"trainer": {"balance": {"shares": "auto", "max_share": max_share}}}), world_size)


def test_shares_need_no_global_batch_the_world_size_divides(tmp_path):
    """The shares are uneven by design: 32 samples per step over 3 ranks by 2:1:1 is 16, 8 and 8
    (plain DDP refuses 32 over 3)."""
    config = _config(tmp_path, [2, 1, 1])
    validate(config, 3)
    with pytest.raises(ConfigError, match=r"global_batch_size=32 is not divisible by dist.world_size=3"):
        validate(_config(tmp_path, "off"), 3)
    seen = {}
    run_threaded(_fit, 3, config, None, seen, timeout_s=60)
    assert [seen[r][0] for r in range(3)] == [16, 8, 8]


def test_a_resume_where_the_world_size_does_not_divide_the_position_takes_up_at_the_exact_sample(tmp_path):
    """32 samples per step over 3 ranks by 2:1:1, stopped after step 5 (160 samples: 53.3 per rank):
    the checkpoint's exact position, not the sampler's per-rank count times 3 (162), lets the resumed
    run take the same samples, so it ends with the uninterrupted run's parameters, bit for bit."""
    whole = run_threaded(_fit, 3, _config(tmp_path / "whole", [2, 1, 1]), timeout_s=60)
    first = _config(tmp_path / "run", [2, 1, 1])
    first.trainer.stop_after_steps, first.trainer.checkpoint.every_steps = 5, 5
    run_threaded(_fit, 3, first, timeout_s=60)
    again = _config(tmp_path / "run", [2, 1, 1])
    again.trainer.resume = str(tmp_path / "run" / "checkpoints" / "step_000000005.pt")
    resumed = run_threaded(_fit, 3, again, timeout_s=60)
    assert resumed[0][0]["step"] == 15
    assert all(torch.equal(a, b) for a, b in zip(whole[0][1], resumed[0][1]))


def test_fixed_weights_given_at_a_resume_replace_the_checkpoints(tmp_path):
    first = _config(tmp_path / "run", [3, 1])
    first.trainer.stop_after_steps, first.trainer.checkpoint.every_steps = 3, 3
    run_threaded(_fit, 2, first, timeout_s=60)
    seen = {}
    again = _config(tmp_path / "run", [1, 3])
    again.trainer.resume = str(tmp_path / "run" / "checkpoints" / "step_000000003.pt")
    final = run_threaded(_fit, 2, again, None, seen, timeout_s=60)[0][0]
    assert (seen[0][0], seen[1][0]) == (8, 24) and final["balance"]["shares"] == [0.25, 0.75]


class MovingSlowdown(Task):
    """Rank 1 sleeps 3 ms per sample in the first 3 steps, rank 0 from the fourth on: the change
    auto makes after the first window sends more work to the rank that has just become slow."""

    def training_step(self, model, batch):
        slow = 1 if self.state.step < 3 else 0
        if self.rank == slow:
            time.sleep(0.003 * len(batch[0]))
        return Trainer.training_step(self, model, batch)


def _fit_moving(rank, world_size, config):
    return MovingSlowdown(config).fit()


def test_a_change_that_measures_less_than_half_its_predicted_gain_is_taken_back(tmp_path, caplog):
    caplog.set_level("INFO", logger="ddptrain.trainer")
    final = run_threaded(_fit_moving, 2, _config(tmp_path, "auto", window=3), timeout_s=90)[0]
    first, back = final["balance"]["changes"][:2]
    assert (first["step"], first["kind"]) == (3, "faster") and first["shares"][0] > 0.6
    assert first["measured_gain"] < 1 < first["previous_step_s"] / first["predicted_step_s"], first
    assert (back["step"], back["kind"], back["shares"]) == (6, "taken back", [0.5, 0.5])
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("balance: shares back")]
    assert logged[0] == (
        f"balance: shares back to 0.500, 0.500 from step 6: the change at step 3 measured "
        f"{first['measured_gain']:.2f}x, predicted {first['predicted_gain']:.2f}x (the next change needs a "
        "predicted gain of 20%)"
    )
    assert first["predicted_gain"] == pytest.approx(first["previous_step_s"] / first["predicted_step_s"])
