"""Which checkpoint file a request means: the one resolver of ``trainer.resume``,
``trainer.init_from``, ``Trainer.test(checkpoint=...)`` and ``ddptrain.load_model``.

The values (:func:`resolve_checkpoint`): ``latest`` / ``last``, ``auto``, ``best``, a run or
checkpoint directory, a file. A corrupt newer checkpoint is skipped with a warning for an older
valid one; a ``best`` is chosen by the monitored value each best checkpoint stores. In a job,
rank 0 resolves and every rank gets its answer (:func:`agree_on_checkpoint`); the launcher runs
the same resolution before any worker starts (:func:`.checkpointer.preflight_resume`).
"""

from __future__ import annotations

import warnings
from pathlib import Path

from ...comm.objects import broadcast_object
from ...comm.process_group import ProcessGroup
from ...rundir import BEST_DIR, RunDir
from .dcp import is_dcp_checkpoint
from .files import (
    CheckpointError,
    CheckpointWarning,
    NothingToResumeError,
    PathLike,
    list_checkpoints,
    load_checkpoint,
    load_step,
    monitor_entry,
)

__all__ = [
    "resolve_checkpoint",
    "agree_on_checkpoint",
    "find_checkpoint",
    "latest_valid_checkpoint",
    "best_checkpoint",
    "newest_run_checkpoint",
]

LOAD_MODEL_WHICH = ("best", "latest")


def latest_valid_checkpoint(directory: PathLike) -> Path | None:
    """The newest checkpoint in ``directory`` that loads and verifies; ``None`` if there is none.

    Corrupt newer ones are skipped with a :class:`CheckpointWarning` naming each and why.

    Raises:
        CheckpointError: checkpoints exist but none of them is valid.
    """
    candidates = list_checkpoints(directory)
    problems = []
    for path in reversed(candidates):
        try:
            load_checkpoint(path)
        except CheckpointError as exc:
            problems.append(f"{path.name}: {exc}")
            warnings.warn(f"skipping checkpoint {path}: {exc}", CheckpointWarning, stacklevel=2)
            continue
        if problems:
            warnings.warn(
                f"resuming from {path.name}, the newest valid checkpoint in {directory}",
                CheckpointWarning,
                stacklevel=2,
            )
        return path
    if candidates:
        raise CheckpointError(
            f"none of the {len(candidates)} checkpoint(s) in {directory} is valid:\n  " + "\n  ".join(problems)
        )
    return None


def resolve_checkpoint(
    resume: str, checkpoint_dir: PathLike, key: str = "trainer.resume", recipe: str | None = None
) -> Path | None:
    """Turn ``trainer.resume`` (or ``trainer.init_from``: ``key``) into a checkpoint file.

    Args:
        resume: ``latest`` or ``last``: the newest valid checkpoint in ``checkpoint_dir``; when it
            holds none and the run directory is one of ``outputs/<recipe>/`` (the default place,
            fresh for every run), the newest run of that recipe there that has one. ``auto``: the
            newest valid in ``checkpoint_dir``, or ``None`` (start from scratch: a requeued job's
            first start). ``best``: the best in ``checkpoint_dir/best`` by its stored monitored
            value. A directory: its newest valid (or its ``checkpoints/``'s; a ``best``
            directory: its best). A file.
        checkpoint_dir: this run's checkpoint directory (``<run dir>/checkpoints``).
        key: the config key, for messages.
        recipe: the run's ``recipe.name`` (where ``latest`` may look for earlier runs).

    Returns:
        The file, or ``None`` for ``auto`` when ``checkpoint_dir`` holds no checkpoint at all.

    Raises:
        NothingToResumeError: ``latest`` found no checkpoint anywhere it may look, or the path does not exist.
        CheckpointError: a path that does not exist, a directory without a valid checkpoint, or
            ``best`` without a best checkpoint.
    """
    if resume == "auto":
        return latest_valid_checkpoint(checkpoint_dir)
    if resume in ("latest", "last"):
        found = latest_valid_checkpoint(checkpoint_dir)
        runs = _runs_of_recipe(Path(checkpoint_dir).parent, recipe)
        if found is None and runs is not None:
            found = newest_run_checkpoint(runs, exclude=Path(checkpoint_dir).parent)
        if found is None:
            where = f"{checkpoint_dir}" + ("" if runs is None else f" nor in any run of recipe {recipe} under {runs}")
            raise NothingToResumeError(
                f"{key}={resume}: no checkpoint in {where}. Pass {key}=<run dir or checkpoint file>; "
                f"{key}=auto to resume when this run's directory has a checkpoint and start from scratch "
                "otherwise (requeued jobs); or leave it out to start from scratch."
            )
        return found
    if resume == "best":
        return best_checkpoint(Path(checkpoint_dir) / BEST_DIR, f"{key}=best")
    path = Path(resume).expanduser()
    if path.is_dir() and not is_dcp_checkpoint(path):
        if path.name == BEST_DIR:
            return best_checkpoint(path, f"{key}={resume}")
        for directory in (path, RunDir(path).checkpoints):
            if list_checkpoints(directory):
                return latest_valid_checkpoint(directory)
        raise CheckpointError(
            f"{key}={resume}: the directory holds no checkpoint (step_*.pt, step_*.dcp), "
            "nor does its checkpoints/ folder"
        )
    if not path.exists():  # a wrong path is the user's input, like an unknown key: a config error (rc 2)
        raise NothingToResumeError(
            f"{key}={resume}: no such file or directory. Pass a checkpoint file, a run directory, 'latest' or 'best'"
        )
    return path


def _runs_of_recipe(run_dir: Path, recipe: str | None) -> Path | None:
    """``outputs/<recipe>/`` when ``run_dir`` is one of its runs (the default place), else None."""
    parent = Path(run_dir).resolve().parent
    return parent if recipe and parent.name == recipe and parent.parent.name == "outputs" else None


def newest_run_checkpoint(runs: PathLike, exclude: PathLike | None = None) -> Path | None:
    """The newest valid checkpoint of the run directories in ``runs`` (by the time it was written),
    ``exclude`` left out; None if none has one."""
    skip = None if exclude is None else Path(exclude).resolve()
    newest = []
    for run in Path(runs).iterdir():
        found = list_checkpoints(RunDir(run).checkpoints) if run.is_dir() and run.resolve() != skip else []
        if found:
            newest.append((found[-1].stat().st_mtime, RunDir(run).checkpoints))
    for _, directory in sorted(newest, reverse=True):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # another run's corrupt files: skipped here, named when chosen
            try:
                return latest_valid_checkpoint(directory)
            except CheckpointError:
                continue
    return None


def best_checkpoint(directory: PathLike, what: str = "best") -> Path:
    """The best valid checkpoint in ``directory`` (a run's ``checkpoints/best``) by the monitored
    value each stores (lowest for mode ``min``, highest for ``max``; on a tie the earlier step).

    Raises:
        CheckpointError: no best checkpoint there (saying how to get one), checkpoints of
            different monitors, or none of them valid.
    """
    directory = Path(directory)
    entries = [(p, monitor_entry(p)) for p in list_checkpoints(directory)]
    entries = [(p, e) for p, e in entries if e is not None]
    if not entries:
        latest = list_checkpoints(directory.parent)
        raise CheckpointError(
            f"{what}: there is no best checkpoint in {directory}. Best checkpoints are kept only when "
            "the run sets trainer.checkpoint.monitor=<metric> (with trainer.checkpoint.mode and "
            "trainer.checkpoint.save_top_k)"
            + (f"; this run has latest checkpoints: use 'latest' ({latest[-1].name})." if latest else ".")
        )
    monitors = sorted({(e["name"], e["mode"]) for _, e in entries})
    if len(monitors) > 1:
        raise CheckpointError(f"{what}: {directory} mixes checkpoints of several monitors {monitors}; pass a file")
    sign = 1.0 if monitors[0][1] == "min" else -1.0
    ranked = sorted(entries, key=lambda pe: (sign * float(pe[1]["value"]), int(load_step(pe[0]))))
    problems = []
    for path, _ in ranked:
        try:
            load_checkpoint(path)
            return path
        except CheckpointError as exc:
            problems.append(str(exc))
            warnings.warn(f"skipping best checkpoint {path}: {exc}", CheckpointWarning, stacklevel=2)
    raise CheckpointError(f"{what}: none of the best checkpoints in {directory} is valid:\n  " + "\n  ".join(problems))


def agree_on_checkpoint(
    process_group: ProcessGroup, value: str, directory: Path, key: str, recipe: str | None = None
) -> str | None:
    """Rank 0 resolves ``value`` (``key``'s: see :func:`resolve_checkpoint`) and every rank gets
    its answer, or its error (collective)."""
    if process_group.rank() == 0:
        try:
            found, error = resolve_checkpoint(value, directory, key, recipe), None
        except CheckpointError as exc:
            found, error = None, (type(exc) is NothingToResumeError, str(exc))
        choice = (None if found is None else str(found), error)
    else:
        choice = None
    path, error = broadcast_object(process_group, choice, 0)
    if error:
        nothing_to_resume, message = error
        raise (NothingToResumeError if nothing_to_resume else CheckpointError)(message)
    return path


def find_checkpoint(source: str | Path, which: str = "latest") -> Path:
    """The checkpoint file ``source`` designates for ``ddptrain.load_model``: a file as is; a run
    directory, its ``checkpoints/`` or its ``checkpoints/best``: the newest valid (``latest``) or
    the best by the stored monitored value (``best``).

    Raises:
        CheckpointError: nothing there, or ``best`` in a run that kept no best checkpoints.
    """
    if which not in LOAD_MODEL_WHICH:
        raise ValueError(f"which={which!r} must be 'best' or 'latest'")
    path = Path(source).expanduser()
    if path.is_file() or (path.is_dir() and is_dcp_checkpoint(path)):
        return path
    if not path.is_dir():
        raise CheckpointError(f"{source}: no such file or directory (pass a run directory or a checkpoint file)")
    if path.name == BEST_DIR or which == "latest":
        found = resolve_checkpoint(str(path), path, key=f"load_model({which!r})")
    else:
        found = resolve_checkpoint("best", RunDir.checkpoints_in(path), key=f"load_model({str(path)!r}, which)")
    if found is None:
        raise CheckpointError(f"{source}: no checkpoint found")
    return found
