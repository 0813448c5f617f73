"""Checkpoint files: atomic, verified, loadable with weights_only, corrupt ones refused and kept."""

import os
import random
import time
import warnings

import pytest
import torch

from ddptrain.trainer.checkpoint import (
    FORMAT_VERSION,
    CheckpointError,
    CheckpointWarning,
    NothingToResumeError,
    checkpoint_name,
    latest_valid_checkpoint,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    resolve_checkpoint,
    save_checkpoint,
)
from ddptrain.trainer.checkpoint.files import monitor_entry, remove_checkpoint
from ddptrain.trainer.rng import capture_rng_state, restore_rng_state


def _state(step, **extra):
    state = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "epoch": 0,
        "world_size": 2,
        "model": {"w": torch.full((100,), float(step))},
        "optimizer": {},
        "sampler": {},
        "rng": [],
    }
    state.update(extra)
    return state


def _write(directory, step):
    return save_checkpoint(directory / checkpoint_name(step), _state(step))


def test_round_trip_and_digest_file(tmp_path):
    path = _write(tmp_path, 5)
    assert path.name == "step_000000005.pt"
    digest_line = (tmp_path / "step_000000005.pt.sha256").read_text()
    assert digest_line.endswith("  step_000000005.pt\n") and len(digest_line.split()[0]) == 64
    loaded = load_checkpoint(path)
    assert torch.equal(loaded["model"]["w"], torch.full((100,), 5.0))
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # no temporary left behind


def test_rng_states_survive_weights_only(tmp_path):
    torch.manual_seed(3)
    random.seed(4)
    state = capture_rng_state()
    expected = (torch.rand(3), random.random())
    path = save_checkpoint(tmp_path / checkpoint_name(1), _state(1, rng=[state]))
    torch.manual_seed(99)
    random.seed(99)
    restore_rng_state(load_checkpoint(path)["rng"][0])
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty"])
def test_corrupt_checkpoint_refused_and_kept(tmp_path, damage):
    _write(tmp_path, 1)
    path = _write(tmp_path, 2)
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip":
        data[len(data) // 2] ^= 0xFF
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    msg = str(info.value)
    assert (
        "corrupt" in msg
        and "nothing was deleted" in msg
        and "step_000000001.pt" in msg
        and "trainer.resume=latest" in msg
    )
    assert path.is_file() and (tmp_path / "step_000000001.pt").is_file()


def test_corrupt_without_digest_file_still_refused(tmp_path):
    path = _write(tmp_path, 1)
    (tmp_path / "step_000000001.pt.sha256").unlink()
    path.write_bytes(path.read_bytes()[:100])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        with pytest.raises(CheckpointError, match="truncated, corrupt, or not a torch checkpoint"):
            load_checkpoint(path)


def test_not_a_ddptrain_checkpoint(tmp_path):
    path = save_checkpoint(tmp_path / checkpoint_name(1), {"weights": torch.zeros(2)})
    with pytest.raises(CheckpointError, match="not a ddptrain checkpoint"):
        load_checkpoint(path)


def test_latest_falls_back_to_newest_valid_with_a_warning(tmp_path):
    for step in (1, 2, 3):
        _write(tmp_path, step)
    newest = tmp_path / checkpoint_name(3)
    newest.write_bytes(newest.read_bytes()[:50])
    with (
        pytest.warns(CheckpointWarning, match="skipping checkpoint .*step_000000003.pt"),
        pytest.warns(CheckpointWarning, match="resuming from step_000000002.pt"),
    ):
        assert latest_valid_checkpoint(tmp_path) == tmp_path / checkpoint_name(2)
    assert newest.is_file()  # kept for inspection
    for step in (1, 2):
        (tmp_path / checkpoint_name(step)).write_bytes(b"garbage")
    with pytest.warns(CheckpointWarning), pytest.raises(CheckpointError, match="none of the 3 checkpoint"):
        latest_valid_checkpoint(tmp_path)


def test_resolve_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    assert resolve_checkpoint("auto", run_dir / "checkpoints") is None  # nothing yet: start fresh
    with pytest.raises(NothingToResumeError, match="trainer.resume=latest: no checkpoint in .*trainer.resume=auto"):
        resolve_checkpoint("latest", run_dir / "checkpoints")  # never a silent fresh start
    _write(run_dir / "checkpoints", 4)
    _write(run_dir / "checkpoints", 8)
    assert resolve_checkpoint("latest", run_dir / "checkpoints").name == checkpoint_name(8)
    assert resolve_checkpoint(str(run_dir), tmp_path / "elsewhere").name == checkpoint_name(8)
    explicit = run_dir / "checkpoints" / checkpoint_name(4)
    assert resolve_checkpoint(str(explicit), tmp_path) == explicit
    with pytest.raises(CheckpointError, match="no such file or directory"):
        resolve_checkpoint(str(tmp_path / "missing.pt"), tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="holds no checkpoint"):
        resolve_checkpoint(str(tmp_path / "empty"), tmp_path)


def test_resume_latest_in_a_fresh_default_run_dir_takes_the_newest_run_of_the_recipe(tmp_path):
    runs = tmp_path / "outputs" / "mnist"
    _write(runs / "2026-01-01_10-00-00" / "checkpoints", 4)
    newest = _write(runs / "2026-01-01_11-00-00" / "checkpoints", 2)
    _write(tmp_path / "outputs" / "other" / "2026-01-01_12-00-00" / "checkpoints", 9)  # another recipe
    os.utime(newest, (time.time() + 60, time.time() + 60))  # written last, whatever the step
    fresh = runs / "2026-01-01_12-30-00"
    fresh.mkdir()
    assert resolve_checkpoint("latest", fresh / "checkpoints", recipe="mnist") == newest
    assert resolve_checkpoint("auto", fresh / "checkpoints", recipe="mnist") is None  # auto: this run only
    (tmp_path / "outputs" / "fashion" / "new").mkdir(parents=True)
    with pytest.raises(NothingToResumeError, match="nor in any run of recipe fashion under"):
        resolve_checkpoint("latest", tmp_path / "outputs" / "fashion" / "new" / "checkpoints", recipe="fashion")
    named = tmp_path / "myrun"  # not under outputs/<recipe>/: only its own checkpoints count
    with pytest.raises(NothingToResumeError):
        resolve_checkpoint("latest", named / "checkpoints", recipe="mnist")


def test_prune_keeps_the_newest(tmp_path):
    for step in (1, 10, 2, 30):
        _write(tmp_path, step)
    deleted = prune_checkpoints(tmp_path, 2)
    assert [p.name for p in deleted] == [checkpoint_name(1), checkpoint_name(2)]
    assert [p.name for p in list_checkpoints(tmp_path)] == [checkpoint_name(10), checkpoint_name(30)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [checkpoint_name(10), checkpoint_name(10) + ".sha256", checkpoint_name(30), checkpoint_name(30) + ".sha256"]
    )


class _Payload:
    """Stands for arbitrary code in a pickle: loading it would import and construct this class."""

    def __reduce__(self):
        return (print, ("this would have run",))


def test_checkpoint_carrying_pickled_code_is_refused(tmp_path):
    import torch

    from ddptrain.trainer.checkpoint import CheckpointError, load_checkpoint

    path = tmp_path / "step_000000001.pt"
    torch.save({"format_version": 1, "model": {}, "evil": _Payload()}, path)
    with pytest.raises(CheckpointError, match=r"carries pickled Python objects .*never runs code"):
        load_checkpoint(path)


class _Marker:
    """Unpickled, it would create the file ``path``."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_reading_a_best_checkpoints_monitor_entry_runs_no_code_from_it(tmp_path):
    """Picking the best checkpoint reads each one's ``monitor`` entry: a file that carries code is
    no candidate (None), and the code never runs."""
    marker = tmp_path / "ran"
    path = tmp_path / "step_000000001.pt"
    torch.save({"monitor": {"name": "val/loss", "mode": "min", "value": 0.1}, "evil": _Marker(marker)}, path)
    assert monitor_entry(path) is None and not marker.exists()
    good = save_checkpoint(
        tmp_path / "step_000000002.pt", _state(2, monitor={"name": "val/loss", "mode": "min", "value": 0.2})
    )
    assert monitor_entry(good) == {"name": "val/loss", "mode": "min", "value": 0.2}


def test_removing_a_checkpoint_that_is_partly_or_wholly_gone_is_not_an_error(tmp_path):
    path = save_checkpoint(tmp_path / "step_000000001.pt", _state(1))
    os.unlink(f"{path}.sha256")
    remove_checkpoint(path)
    assert list(tmp_path.iterdir()) == []
    remove_checkpoint(tmp_path / "step_000000002.dcp")  # a DCP directory deleted by someone else
    remove_checkpoint(path)


def test_a_checkpoint_and_its_digest_are_readable_by_others_like_any_file(tmp_path):
    """The temporary file they are written to is private (mkstemp: 0600); what it becomes is 0644,
    so another user of a shared file system (an evaluation job, a colleague) can read it."""
    path = save_checkpoint(tmp_path / "step_000000001.pt", _state(1))
    assert os.stat(path).st_mode & 0o777 == 0o644
    assert os.stat(f"{path}.sha256").st_mode & 0o777 == 0o644


def test_a_write_that_fails_leaves_nothing_behind(tmp_path):
    with pytest.raises(Exception, match="lambda"):
        save_checkpoint(tmp_path / "step_000000001.pt", {"step": 1, "fn": lambda: 0})  # cannot be pickled
    assert sorted(p.name for p in tmp_path.iterdir()) == []
