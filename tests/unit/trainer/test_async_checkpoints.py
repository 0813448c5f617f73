"""Checkpoints written in the background (``trainer.checkpoint.async_save``): the same files as a
foreground save, a failure that surfaces with the file's name, and what it cannot combine with.
A process killed in the middle of a background write: tests/e2e/test_async_checkpoint_kill.py."""

import logging
import time

import pytest
import torch

from ddptrain import Config, ConfigError, Trainer
from ddptrain.errors import CheckpointError
from ddptrain.preflight import validate
from ddptrain.testing import run_threaded
from ddptrain.trainer.checkpoint import list_checkpoints, load_checkpoint
from tests.background_saves import ScribbleWhileWriting
from tests.models import argmax_task, seeded_mlp

pytestmark = pytest.mark.timeout(120)


class Task(Trainer):
    def configure_model(self):
        return seeded_mlp(8, 50_000, 3)  # wide: a write takes long enough for the next steps to run

    def train_dataloader(self):
        return argmax_task(192, 8)

    def val_dataloader(self):
        return None


def _config(out, async_save, **checkpoint):
    return Config.from_dict(
        {
            "data": {"global_batch_size": 16},
            "optimizer": {"name": "adamw", "lr": 0.01},
            "trainer": {
                "max_steps": 9,
                "progress": False,
                "loggers": {"tensorboard": False, "csv": False},
                "output_dir": str(out),
                "checkpoint": {"every_steps": 2, "keep_last": 2, "async_save": async_save, **checkpoint},
            },
        }
    )


def _fit(rank, world_size, out, async_save):
    task = Task(_config(out, async_save), callbacks=[ScribbleWhileWriting()])
    task.fit()
    return [p.detach().clone() for p in task.model.module.parameters()]


def _entries(path):
    """What a checkpoint holds, but the config (whose async_save and output_dir differ)."""
    return {k: v for k, v in load_checkpoint(path).items() if k != "config"}


def _assert_same(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def test_background_saves_write_the_checkpoints_a_foreground_save_writes(tmp_path):
    """The snapshot is the state of its step, though the live tensors changed while it was written
    (ScribbleWhileWriting); the newest keep_last stay, each verified, and the fit ends with the
    last one on disk."""
    plain = run_threaded(_fit, 2, tmp_path / "plain", False, timeout_s=60)
    background = run_threaded(_fit, 2, tmp_path / "background", True, timeout_s=60)
    assert all(torch.equal(a, b) for a, b in zip(plain[0], background[0]))
    names = [p.name for p in list_checkpoints(tmp_path / "background" / "checkpoints")]
    assert names == [p.name for p in list_checkpoints(tmp_path / "plain" / "checkpoints")]
    assert names == ["step_000000008.pt", "step_000000009.pt"]  # every 2 steps, the end, keep_last=2
    for name in names:
        _assert_same(
            _entries(tmp_path / "plain" / "checkpoints" / name),
            _entries(tmp_path / "background" / "checkpoints" / name),
            name,
        )


def test_a_background_save_that_fails_fails_the_fit_naming_the_file(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").write_text("a file where the checkpoints directory goes")
    with pytest.raises(CheckpointError, match=r"the background save of step_000000002.pt failed: .*checkpoints"):
        run_threaded(_fit, 2, tmp_path / "run", True, timeout_s=60)


def test_background_saves_refuse_sharded_optimizer_files():
    config = Config.from_dict(
        {"dist": {"zero_stage": 1}, "trainer": {"checkpoint": {"async_save": True, "sharded": True}}}
    )
    with pytest.raises(
        ConfigError,
        match=r"^trainer.checkpoint.async_save=true cannot be combined with "
        r"trainer.checkpoint.sharded=true: every rank's shard must be on disk",
    ):
        validate(config, 2)


def test_the_writer_runs_one_write_at_a_time_and_the_next_one_says_it_waited(caplog):
    from ddptrain.trainer.checkpoint.background import BackgroundWriter

    writer, done = BackgroundWriter(), []
    writer.submit("step_1.pt", lambda: (time.sleep(0.3), done.append(1)))
    with caplog.at_level(logging.INFO, logger="ddptrain.trainer"):
        waited = writer.submit("step_2.pt", lambda: done.append(2))
    assert done[0] == 1 and waited > 0.1  # the second started only once the first had finished
    assert "step_2.pt waited" in caplog.text and "for the previous background save" in caplog.text
    assert writer.wait() < 0.1 and done == [1, 2]
    assert writer.wait() == 0.0  # nothing in flight


def test_a_failed_write_is_raised_at_the_next_submit_which_does_not_start():
    from ddptrain.trainer.checkpoint.background import BackgroundWriter

    writer, started = BackgroundWriter(), []

    def fail():
        raise OSError("No space left on device")

    writer.submit("step_4.pt", fail)
    with pytest.raises(CheckpointError, match=r"the background save of step_4.pt failed: No space left on device"):
        writer.submit("step_6.pt", lambda: started.append(6))
    assert started == [] and writer.wait() == 0.0  # the failure is reported once
