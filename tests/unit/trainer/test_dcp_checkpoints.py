"""Checkpoints in torch's distributed format (``trainer.checkpoint.format=dcp``,
ddptrain/trainer/checkpoint/dcp.py), on the threaded group.

The spec: a DCP checkpoint holds exactly what the ``.pt`` of the same run holds; every rank writes
its part (ZeRO's shards each by its owner, never gathered); it resumes bit for bit, at another
world size under ZeRO with every shard equal to its slice of the whole; torch alone loads the
model from it; and it is verified, visible only when whole, and never runs code from its files.
"""

import math
import os
import pickle
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from ddptrain import Config, Trainer
from ddptrain.comm import get_process_group
from ddptrain.export import export
from ddptrain.testing import run_threaded
from ddptrain.trainer.callbacks import Callback
from ddptrain.trainer.checkpoint import CheckpointError, CheckpointWarning, latest_valid_checkpoint, load_checkpoint
from ddptrain.trainer.checkpoint.dcp import DcpWrite, flat_range_chunks, save_dcp
from tests.background_saves import ScribbleWhileWriting
from tests.models import argmax_task, seeded_mlp

pytestmark = pytest.mark.timeout(300)

STEP7 = "step_000000007"


class Task(Trainer):
    def configure_model(self):
        return seeded_mlp(8, 17, 3)  # Sequential(Linear(8, 17), Tanh, Linear(17, 3))

    def train_dataloader(self):
        return argmax_task(240, 8, seed=0)

    def val_dataloader(self):
        return None


def _config(out, zero_stage=0, checkpoint=None, **trainer):
    return Config.from_dict(
        {
            "data": {"global_batch_size": 24},
            "dist": {"algorithm": "ring", "zero_stage": zero_stage, "bucket_cap_mb": 0.0002},
            "optimizer": {"name": "adamw", "lr": 0.01, "weight_decay": 0.1},
            "trainer": {
                "epochs": 2,
                "progress": False,
                "loggers": {"tensorboard": False, "csv": False},
                "output_dir": str(out),
                "checkpoint": {"format": "dcp", **(checkpoint or {})},
                **trainer,
            },
        }
    )


def _fit(rank, world_size, out, zero_stage=0, callbacks=(), **trainer):
    task = Task(_config(out, zero_stage, **trainer), callbacks=list(callbacks))
    task.fit()
    return [p.detach().clone() for p in task.model.module.parameters()]


def _accuracy(params) -> float:
    """The accuracy of the task's model with ``params`` on 2000 held-out samples."""
    model = seeded_mlp(8, 17, 3)
    with torch.no_grad():
        for p, value in zip(model.parameters(), params):
            p.copy_(value)
        x, y = argmax_task(2000, 8, seed=5).tensors
        return (model(x).argmax(1) == y).float().mean().item()


def _assert_same(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), (where, a.keys(), b.keys())
        for key in a:
            _assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def _entries(path):
    """What a checkpoint holds, but the config (whose checkpoint.format and output_dir differ) and
    the RNG states: rank threads share torch's global generator, whose state when each captures
    it depends on the threads' timing (each rank's own state is tested in test_checkpointing.py)."""
    return {k: v for k, v in load_checkpoint(path).items() if k not in ("config", "rng")}


def _files_of(path):
    """``{data file: [keys it holds a piece of]}`` of a DCP checkpoint, from its metadata."""
    held = {}
    for index, info in FileSystemReader(str(path)).read_metadata().storage_data.items():
        held.setdefault(info.relative_path, []).append(index.fqn)
    return held


@pytest.mark.parametrize(
    "shape",
    [(7,), (3, 4), (2, 3, 4), (4, 1, 3)],
)
def test_a_flat_range_becomes_rectangular_chunks_holding_exactly_its_elements_in_order(shape):
    numel = math.prod(shape)
    index = torch.arange(numel).view(shape)
    for lo in range(numel):
        for hi in range(lo + 1, numel + 1):
            chunks = flat_range_chunks(shape, lo, hi)
            got = [i for o, s in chunks for i in index[tuple(slice(a, a + b) for a, b in zip(o, s))].reshape(-1)]
            assert got == list(range(lo, hi)), (lo, hi, chunks)
            assert len(chunks) <= 2 * len(shape) - 1  # a head and a tail per dimension, whole rows between
    assert flat_range_chunks(shape, 3, 3) == []  # no element, no chunk


def test_a_dcp_checkpoint_holds_what_the_torch_one_holds_written_by_both_ranks_and_resumes_bitwise(tmp_path):
    run_threaded(_fit, 2, tmp_path / "pt", max_steps=7, checkpoint={"format": "torch"}, timeout_s=120)
    run_threaded(_fit, 2, tmp_path / "dcp", max_steps=7, timeout_s=120)
    path = tmp_path / "dcp" / "checkpoints" / f"{STEP7}.dcp"
    _assert_same(_entries(tmp_path / "pt" / "checkpoints" / f"{STEP7}.pt"), _entries(path))
    files = _files_of(path)
    assert sorted(files) == ["__0_0.distcp", "__1_0.distcp"], files  # the replicated state, spread
    listed = (path / "SHA256SUMS").read_text()
    assert all(f"  {name}\n" in listed for name in [*files, ".metadata"])
    whole = run_threaded(_fit, 2, tmp_path / "whole", max_steps=12, timeout_s=120)
    resumed = run_threaded(_fit, 2, tmp_path / "r", max_steps=12, resume=str(path), timeout_s=120)
    assert all(torch.equal(a, b) for a, b in zip(whole[0], resumed[0]))


class _ShardsAtStart(Callback):
    """Each rank's ZeRO shard state as the fit starts (after a resume loaded it)."""

    def __init__(self, seen):
        self.seen = seen

    def on_fit_start(self, trainer):
        zero = trainer.strategy.update.zero
        self.seen[trainer.rank] = zero.shard_state_dict()["params"]


def test_zero_2_at_four_ranks_writes_each_shard_by_its_owner_and_resplits_exactly_at_two(tmp_path):
    """ZeRO-2 at W=4: every rank writes a file, each optimizer tensor lies in pieces over several
    files, and reading it gives the consolidated state of the torch format bit for bit. Resumed
    with ZeRO-1 at W=2, every rank's shard is its slice of that state, and the run ends where
    resuming from the consolidated .pt ends."""
    run_threaded(_fit, 4, tmp_path / "pt", 2, max_steps=7, checkpoint={"format": "torch"}, timeout_s=120)
    run_threaded(_fit, 4, tmp_path / "dcp", 2, max_steps=7, timeout_s=120)
    path = tmp_path / "dcp" / "checkpoints" / f"{STEP7}.dcp"
    consolidated = load_checkpoint(tmp_path / "pt" / "checkpoints" / f"{STEP7}.pt")
    _assert_same({k: v for k, v in consolidated.items() if k not in ("config", "rng")}, _entries(path))
    files = _files_of(path)
    assert len(files) == 4
    for key in ("ddptrain.optimizer.state.0.exp_avg", "ddptrain.optimizer.state.2.exp_avg_sq"):
        assert sum(key in held for held in files.values()) > 1, (key, files)  # pieces, never gathered
    seen = {}
    again = {"allow_world_size_change": True, "max_steps": 12, "timeout_s": 120}
    from_dcp = run_threaded(_fit, 2, tmp_path / "z1", 1, resume=str(path), callbacks=[_ShardsAtStart(seen)], **again)
    pt = str(tmp_path / "pt" / "checkpoints" / f"{STEP7}.pt")
    from_pt = run_threaded(_fit, 2, tmp_path / "z1pt", 1, resume=pt, **again)
    assert all(torch.equal(a, b) for a, b in zip(from_dcp[0], from_pt[0]))
    # in line with the uninterrupted ZeRO-2 run at W=4: the same samples per step, summed in another order
    whole = run_threaded(_fit, 4, tmp_path / "whole", 2, max_steps=12, timeout_s=120)
    resumed_accuracy, whole_accuracy = _accuracy(from_dcp[0]), _accuracy(whole[0])
    assert whole_accuracy > 0.6 and abs(resumed_accuracy - whole_accuracy) <= 0.01, (resumed_accuracy, whole_accuracy)
    held = 0
    for params in seen.values():
        for k, piece in params.items():
            whole = consolidated["optimizer"]["state"][k]
            for key, value in piece["state"].items():
                expected = whole[key].reshape(-1)[piece["lo"] : piece["hi"]] if value.dim() else whole[key]
                assert torch.equal(value, expected), (k, key)
            held += piece["hi"] - piece["lo"]
    assert held == sum(v.numel() for v in consolidated["model"].values())  # every element, once


def test_torch_alone_loads_the_bare_model_from_a_zero_2_checkpoint_equal_to_the_export(tmp_path):
    """In a fresh interpreter that never imports ddptrain and starts no process group:
    ``torch.distributed.checkpoint.load`` into the bare model's state_dict (no ``module.``), equal
    to what ``ddptrain.export`` writes from that checkpoint."""
    run_threaded(_fit, 2, tmp_path / "dcp", 2, max_steps=7, timeout_s=120)
    path = tmp_path / "dcp" / "checkpoints" / f"{STEP7}.dcp"
    script = textwrap.dedent(
        f"""
        import sys, torch, torch.distributed.checkpoint as dcp
        model = torch.nn.Sequential(torch.nn.Linear(8, 17), torch.nn.Tanh(), torch.nn.Linear(17, 3))
        state = model.state_dict()
        dcp.load(state, checkpoint_id={str(path)!r})
        model.load_state_dict(state)
        assert "ddptrain" not in sys.modules and not torch.distributed.is_initialized()
        torch.save(model.state_dict(), {str(tmp_path / "alone.pt")!r})
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    alone = torch.load(tmp_path / "alone.pt", weights_only=True)
    out, _, step = export(path, "torch")  # ddptrain's consolidated export of the same checkpoint
    assert (out, step) == (tmp_path / "dcp" / "export" / "model.pt", 7)
    exported = torch.load(out, weights_only=True)
    assert list(alone) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    _assert_same(dict(alone), exported)


def test_background_dcp_saves_write_what_foreground_ones_write(tmp_path, caplog):
    """Each background checkpoint holds its own step's state, though the live tensors changed while
    it was written; both kinds keep the newest keep_last, and each says it is saved."""
    caplog.set_level("INFO", logger="ddptrain.trainer")
    checkpoint, scribble = {"every_steps": 2, "keep_last": 2}, lambda: [ScribbleWhileWriting()]
    run_threaded(_fit, 2, tmp_path / "fg", max_steps=7, checkpoint=checkpoint, callbacks=scribble(), timeout_s=120)
    background = {**checkpoint, "async_save": True}
    run_threaded(_fit, 2, tmp_path / "bg", max_steps=7, checkpoint=background, callbacks=scribble(), timeout_s=120)
    names = sorted(p.name for p in (tmp_path / "bg" / "checkpoints").iterdir())
    assert names == ["step_000000006.dcp", f"{STEP7}.dcp"]  # every 2 steps, the end; no temporary left
    assert sorted(p.name for p in (tmp_path / "fg" / "checkpoints").iterdir()) == names
    saved = [r.getMessage() for r in caplog.records if r.getMessage().startswith("checkpoint saved:")]
    assert any("step_000000004.dcp (step 4, in the background)" in m for m in saved), saved
    assert any("step_000000004.dcp (step 4)" in m for m in saved), saved
    for name in names:
        _assert_same(_entries(tmp_path / "fg" / "checkpoints" / name), _entries(tmp_path / "bg" / "checkpoints" / name))


def test_a_corrupt_or_unfinished_checkpoint_is_refused_naming_why_and_resume_takes_the_older(tmp_path):
    run_threaded(_fit, 2, tmp_path / "run", max_steps=4, checkpoint={"every_steps": 2}, timeout_s=120)
    directory = tmp_path / "run" / "checkpoints"
    newest = directory / "step_000000004.dcp"
    data = newest / "__1_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    with pytest.raises(
        CheckpointError, match=r"is corrupt or incomplete: __1_0.distcp has SHA-256 .*nothing was deleted"
    ):
        load_checkpoint(newest)
    with pytest.warns(CheckpointWarning) as warned:
        assert latest_valid_checkpoint(directory).name == "step_000000002.dcp"
    assert "skipping checkpoint" in str(warned[0].message) and "step_000000004.dcp" in str(warned[0].message)
    (directory / "step_000000002.dcp" / ".metadata").unlink()  # as a save killed before rank 0 committed
    with pytest.raises(CheckpointError, match=r"not a complete DCP checkpoint: it has no .metadata \(its save did not"):
        load_checkpoint(directory / "step_000000002.dcp")


def test_a_background_commit_fails_naming_the_rank_that_failed_or_never_reported(tmp_path):
    """Rank 0's writer thread hears of every rank through the checkpoint's temporary directory."""
    planned = DcpWrite(tmp_path / "step_000000002.dcp", tmp_path, None, None, None, None)
    planned.publish(0, ([], {}))
    with pytest.raises(CheckpointError, match=r"rank\(s\) \[1\] did not finish writing their part within 0 s"):
        planned.gather_published(2, 0.2)
    planned.publish(0, ([], {}))
    planned.publish(1, OSError("No space left on device"))
    with pytest.raises(CheckpointError, match=r"rank\(s\) \[1\] failed to write their part .*No space left on dev"):
        planned.gather_published(2, 60)  # at once, not after the timeout


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_metadata_that_would_run_code_is_refused_and_runs_nothing(tmp_path):
    path = tmp_path / "step_000000001.dcp"
    path.mkdir()
    (path / ".metadata").write_bytes(pickle.dumps(_Payload(tmp_path / "pwned")))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)  # no SHA256SUMS: not written by ddptrain
        with pytest.raises(CheckpointError, match=r"\.metadata cannot be read .*(posix|os)\.system is not part of DCP"):
            load_checkpoint(path)
    assert not (tmp_path / "pwned").exists()


def test_an_elastic_job_refuses_the_dcp_format_saying_why():
    from ddptrain.config import ConfigError
    from ddptrain.preflight import validate

    config = Config.from_dict({"trainer": {"elastic": True, "checkpoint": {"format": "dcp"}}})
    with pytest.raises(ConfigError, match=r"every rank writes its part of a DCP checkpoint, so a rank lost"):
        validate(config, 2)


def test_a_model_key_that_would_collide_with_ddptrains_entries_is_refused(tmp_path):
    def save(rank, world_size):
        state = {"model": {"ddptrain.skeleton.w": torch.zeros(2)}, "step": 0}
        save_dcp(tmp_path / "step_000000000.dcp", state, get_process_group())

    with pytest.raises(CheckpointError, match=r"would both be stored as 'ddptrain.skeleton.w'.*must not start with"):
        run_threaded(save, 1, timeout_s=60)
