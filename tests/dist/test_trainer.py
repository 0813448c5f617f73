"""The Trainer on real process groups: exact resume, world-size changes, exact evaluation, TensorBoard.

Each test spawns ONE world and runs several fits inside it (``fit`` reuses an existing process
group), because a spawn costs seconds on two busy cores. Bodies return plain data; the parent
asserts. The setup is small but exercises everything a resume must restore: dropout (per-rank
RNG), momentum, a step schedule, gradient accumulation under ``no_sync`` and clipping.
"""

import math
from pathlib import Path

import pytest
import torch

from ddptrain import Config, Trainer
from ddptrain.testing import run_distributed
from ddptrain.trainer import CheckpointError
from ddptrain.trainer.checkpoint import list_checkpoints, load_checkpoint
from tests.conftest import merged

# One pytest-xdist worker for the module (scripts/test.sh runs --dist loadgroup): two_rank_runs is made once.
pytestmark = [pytest.mark.dist, pytest.mark.timeout(240), pytest.mark.xdist_group("dist-trainer")]

STEPS_PER_EPOCH = 10  # 480 samples / (48 per step); 2 ranks: 20 micro-batches of 12 per rank


def make_config(output_dir, **trainer) -> Config:
    """2 epochs of 10 steps; divisible by 1, 2 and 3 ranks (48 = 3 x 2 x 8)."""
    base = {
        "epochs": 2,
        "seed": 7,
        "grad_accum_steps": 2,
        "grad_clip_norm": 0.5,
        "log_every_steps": 5,
        "checkpoint": {"every_epochs": 1, "keep_last": 10},
        "progress": False,
        "loggers": {"tensorboard": False},
        "output_dir": str(output_dir),
    }
    base = merged(base, trainer)
    return Config.from_dict(
        {
            "model": {"_target_": "ddptrain.recipes.mnist.Net", "conv_dropout": 0.3, "fc_dropout": 0.5},
            "data": {
                "name": "synthetic",
                "num_train_samples": 480,
                "num_val_samples": 100,
                "global_batch_size": 48,
                "eval_batch_size": 16,
            },
            "optimizer": {
                "name": "sgd",
                "lr": 0.05,
                "momentum": 0.9,
                "scheduler": {"name": "step", "step_size": 6, "gamma": 0.5, "warmup_steps": 2},
            },
            "trainer": base,
        }
    )


def _fit(output_dir, **trainer):
    t = Trainer(make_config(output_dir, **trainer))
    metrics = t.fit()
    return metrics, t


def resume_body(rank, world_size, root):
    root = Path(root)
    out = {}
    # A: two epochs straight (TensorBoard on, to read its events back).
    a, ta = _fit(root / "straight", loggers={"tensorboard": True})
    out["straight"] = a
    out["loss_history"] = ta.loss_history
    # B: stop in the middle of epoch 2 (step 13, as if preempted), then resume from the newest checkpoint.
    b1, _ = _fit(root / "mid", stop_after_steps=13)
    b2, _ = _fit(root / "mid", resume="latest")
    out["mid_stop"], out["mid_resumed"] = b1, b2
    # C: one epoch, stop, then resume with two epochs (the schedule does not depend on epochs).
    c1, _ = _fit(root / "epoch", epochs=1)
    c2, _ = _fit(root / "epoch", resume=str(root / "epoch"))
    out["epoch_stop"], out["epoch_resumed"] = c1, c2
    # D: a mid-epoch checkpoint every 3 steps, only the last 2 kept; resume from step 9's file.
    d1, _ = _fit(
        root / "every3",
        checkpoint={"every_steps": 3, "every_epochs": 0, "keep_last": 2, "at_end": False},
        stop_after_steps=9,
    )
    d2, _ = _fit(
        root / "every3",
        checkpoint={"every_steps": 3, "every_epochs": 0, "keep_last": 2},
        resume=str(root / "every3" / "checkpoints" / "step_000000009.pt"),
    )
    out["every3_resumed"] = d2
    return out


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("trainer2")
    results = run_distributed(resume_body, 2, str(root), timeout_s=200)
    return root, results


def test_exact_resume_bitwise_equal(two_rank_runs):
    _, results = two_rank_runs
    for rank_result in results:
        straight = rank_result["straight"]["params_sha256"]
        assert rank_result["mid_stop"]["step"] == 13
        assert rank_result["epoch_stop"]["step"] == STEPS_PER_EPOCH
        for name in ("mid_resumed", "epoch_resumed", "every3_resumed"):
            assert rank_result[name]["step"] == 2 * STEPS_PER_EPOCH, name
            assert rank_result[name]["params_sha256"] == straight, f"{name} differs from the straight run"
        # The evaluation after resuming sees the same model, hence the same metrics, exactly.
        assert rank_result["mid_resumed"]["eval/loss"] == rank_result["straight"]["eval/loss"]
    # A run that stopped early is NOT equal: the comparison can fail.
    assert results[0]["mid_stop"]["params_sha256"] != results[0]["straight"]["params_sha256"]


def test_mid_epoch_checkpoint_holds_the_position_trained_on(two_rank_runs):
    root, _ = two_rank_runs
    mid = load_checkpoint(root / "mid" / "checkpoints" / "step_000000013.pt")
    # Step 13 is step 3 of epoch 2: 3 steps of 48 samples over 2 ranks, 72 per rank.
    assert (mid["step"], mid["epoch"], mid["samples_in_epoch"]) == (13, 1, 72)
    assert (mid["sampler"]["epoch"], mid["sampler"]["consumed"]) == (1, 72)


def test_ranks_agree_and_loss_falls(two_rank_runs):
    _, results = two_rank_runs
    assert results[0]["straight"]["params_sha256"] == results[1]["straight"]["params_sha256"]
    assert all(r["straight"]["params_agree"] for r in results)
    losses = [loss for _, loss in results[0]["loss_history"]]
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert results[0]["loss_history"] == results[1]["loss_history"]  # reduced over ranks: the same everywhere


def test_checkpoints_rotated_and_loadable_weights_only(two_rank_runs):
    root, _ = two_rank_runs
    kept = list_checkpoints(root / "every3" / "checkpoints")
    # Steps 3, 6, 9 in the first run, then 12, 15, 18 and the end (20) in the resumed one: last 2 kept.
    assert [p.name for p in kept] == ["step_000000018.pt", "step_000000020.pt"]
    ckpt = load_checkpoint(kept[-1])  # torch.load(weights_only=True) inside
    assert ckpt["step"] == 20 and ckpt["world_size"] == 2 and len(ckpt["rng"]) == 2
    assert not torch.equal(ckpt["rng"][0]["torch"], ckpt["rng"][1]["torch"])  # every rank's own state
    assert {"model", "optimizer", "scheduler", "sampler"} <= set(ckpt)
    assert ckpt["sampler"]["num_replicas"] == 2


def test_tensorboard_scalars_readable(two_rank_runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root, results = two_rank_runs
    acc = EventAccumulator(str(root / "straight" / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    expected = {
        "train/loss",
        "train/lr",
        "train/samples_per_s",
        "train/comm_wait_s",
        "train/epoch_loss",
        "eval/loss",
        "eval/accuracy",
    }
    assert expected <= tags, tags
    loss_events = acc.Scalars("train/loss")
    assert [e.step for e in loss_events] == [5, 10, 15, 20]
    assert [pytest.approx(e.value, rel=1e-6) for e in loss_events] == [loss for _, loss in results[0]["loss_history"]]
    assert [e.step for e in acc.Scalars("eval/accuracy")] == [10, 20]
    assert acc.Scalars("eval/accuracy")[-1].value == pytest.approx(results[0]["straight"]["eval/accuracy"])
    # Warm-up then the step schedule: 0.05 * 0.5 ** ((step - 2) // 6) after the 2 warm-up steps.
    lrs = {e.step: e.value for e in acc.Scalars("train/lr")}
    assert lrs[20] == pytest.approx(0.05 * 0.5 ** ((20 - 2) // 6))
    assert all(e.value >= 0 for e in acc.Scalars("train/comm_wait_s"))
    assert all(e.value > 0 for e in acc.Scalars("train/samples_per_s"))


def world_change_body(rank, world_size, source_dir, root):
    root = Path(root)
    out = {}
    # Refused without the flag, on every rank, before anything is trained.
    try:
        Trainer(make_config(root / "refused", resume=str(source_dir))).fit()
        out["refused"] = None
    except CheckpointError as exc:
        out["refused"] = str(exc)
    # Allowed: continue from step 13 (mid-epoch) to the end with 3 ranks.
    t = Trainer(make_config(root / "allowed", resume=str(source_dir), allow_world_size_change=True))
    out["allowed"] = t.fit()
    # Exact evaluation: 100 validation samples over 3 ranks means 2 padding duplicates; compare with
    # one process evaluating all 100 samples itself.
    module = t.model.module.eval()
    xs = torch.stack([t.val_set[i][0] for i in range(len(t.val_set))])
    ys = torch.stack([t.val_set[i][1] for i in range(len(t.val_set))])
    with torch.no_grad():
        log_probs = module(xs)
    out["reference_accuracy"] = (log_probs.argmax(1) == ys).double().mean().item()
    out["reference_loss"] = torch.nn.functional.cross_entropy(log_probs, ys, reduction="none").double().mean().item()
    out["padded"] = t.val_sampler.num_padded()
    return out


def test_world_size_change_refused_then_allowed(two_rank_runs, tmp_path):
    root, _ = two_rank_runs
    source = root / "mid" / "checkpoints" / "step_000000013.pt"
    # The resumed run went on to write later checkpoints; restore the mid-epoch one as the newest.
    assert source.is_file()
    results = run_distributed(world_change_body, 3, str(source), str(tmp_path), timeout_s=150)
    for r in results:
        assert r["refused"] is not None
        assert "saved with 2 rank(s), not 3" in r["refused"] and "RNG state" in r["refused"]
        assert "trainer.allow_world_size_change=true" in r["refused"]
        assert r["allowed"]["step"] == 2 * STEPS_PER_EPOCH and r["allowed"]["world_size"] == 3
        assert r["allowed"]["params_agree"]
        assert math.isfinite(r["allowed"]["eval/loss"])
    r0 = results[0]
    assert sum(r["padded"] for r in results) == 2  # the padding exists, and is not counted:
    assert r0["allowed"]["eval/samples"] == 100
    assert r0["allowed"]["eval/accuracy"] == pytest.approx(r0["reference_accuracy"], abs=1e-12)
    # rel 1e-6: each rank evaluates its share in batches of another size than the one-batch reference
    # (float32 rounding differs by batch size); counting the 2 padding duplicates would be off by ~1e-2.
    assert r0["allowed"]["eval/loss"] == pytest.approx(r0["reference_loss"], rel=1e-6)
