"""Checkpoint files: names, atomic writes, integrity checks, safe loading, pruning.

A checkpoint is ``step_<step>.pt`` (``torch.save`` of plain types and tensors, so it loads with
``torch.load(weights_only=True)``) plus ``step_<step>.pt.sha256`` in ``sha256sum`` format
(``sha256sum -c`` verifies it by hand). Both are written to temporary files and renamed, the
digest first: a crash leaves either the previous state or a complete pair, never a half file
under the final name (a killed write leaves ``.step_<step>.pt.*.tmp``, which nothing reads and the
next write of that name deletes).
``torch.load`` alone notices truncation but not a flipped byte inside a tensor; the digest
catches both.

A checkpoint of a ZeRO run with ``trainer.checkpoint.sharded=true`` also has one file per rank
beside it, ``step_<step>.pt.optim-<rank>-of-<world size>`` (with its digest), holding that rank's
shard of the optimizer state; the checkpoint's ``optimizer`` entry then holds the ``param_groups``
and ``"shards": <world size>``. :func:`load_checkpoint` reads them back into the consolidated
format, so every reader sees one layout; :func:`remove_checkpoint` deletes them with it.

With ``trainer.checkpoint.format=dcp`` a checkpoint is a directory, ``step_<step>.dcp/``, in
torch's distributed format (:mod:`.dcp`); :func:`load_checkpoint`, :func:`list_checkpoints`,
:func:`monitor_entry` and :func:`remove_checkpoint` take both kinds, so readers need not know.

These are primitives on paths, with no collectives and no knowledge of a run: the
:class:`~.checkpointer.Checkpointer` decides what to write where, and :mod:`.resolve` which
file a ``trainer.resume`` value means.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import io
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO, Union

import torch

from ...config import ConfigError
from ...errors import CheckpointError, CheckpointWarning, NothingToResumeError
from .dcp import SUFFIX as DCP_SUFFIX
from .dcp import is_dcp_checkpoint, load_dcp

__all__ = [
    "CheckpointError",
    "model_weights",
    "CheckpointWarning",
    "NothingToResumeError",
    "FORMAT_VERSION",
    "checkpoint_name",
    "load_step",
    "save_checkpoint",
    "load_checkpoint",
    "list_checkpoints",
    "monitor_entry",
    "prune_checkpoints",
    "remove_checkpoint",
    "optimizer_shard_path",
]

FORMAT_VERSION = 1
"""Version of the dictionary layout written by :meth:`.checkpointer.Checkpointer.state_dict`."""
REQUIRED_KEYS = ("format_version", "step", "epoch", "world_size", "model", "optimizer", "sampler", "rng")
_NAME = re.compile(r"^step_(\d+)\.(pt|dcp)$")
FORMATS = ("torch", "dcp")
"""``trainer.checkpoint.format``'s values: one ``torch.save`` file, or torch's distributed format."""
PathLike = Union[str, os.PathLike]  # noqa: UP007 - a runtime alias, usable on Python 3.10


def checkpoint_name(step: int, format: str = "torch") -> str:
    """Name of the checkpoint written after ``step`` optimizer steps, in ``format`` (:data:`FORMATS`)."""
    return f"step_{step:09d}{DCP_SUFFIX if format == 'dcp' else '.pt'}"


@contextlib.contextmanager
def _atomic_file(path: Path) -> Iterator[BinaryIO]:
    """A temporary file beside ``path`` to write into; when the block ends cleanly it is synced,
    made 0644 and renamed to ``path``, otherwise deleted. A killed process leaves the temporary
    file, never a half file under ``path``."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def save_checkpoint(path: PathLike, state: dict[str, Any]) -> Path:
    """Write ``state`` to ``path`` atomically, with its SHA-256 digest beside it.

    The serialization streams into a temporary file and the digest at once (no second copy of the
    checkpoint in memory); the digest is renamed under its final name before the data file is, so
    a checkpoint under its final name always has its digest.

    Returns:
        The path written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):  # a killed write of this name
        stale.unlink(missing_ok=True)
    with _atomic_file(path) as f:
        hashed = _HashingWriter(f)
        torch.save(state, hashed)
        with _atomic_file(path.with_name(path.name + ".sha256")) as digest:
            digest.write(f"{hashed.hexdigest()}  {path.name}\n".encode())
    return path


class _HashingWriter(io.RawIOBase):
    """A write-only file that hashes what passes through it on its way to ``file``."""

    def __init__(self, file: Any):
        super().__init__()
        self._file, self._sha = file, hashlib.sha256()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self._sha.update(data)
        return self._file.write(data)

    def hexdigest(self) -> str:
        return self._sha.hexdigest()


def optimizer_shard_path(path: PathLike, rank: int, world_size: int) -> Path:
    """Where rank ``rank`` of ``world_size`` writes its shard of a sharded checkpoint's optimizer state."""
    path = Path(path)
    return path.with_name(f"{path.name}.optim-{rank}-of-{world_size}")


def load_checkpoint(path: PathLike, map_location: Any = "cpu") -> dict[str, Any]:
    """Load and verify a checkpoint written by :func:`save_checkpoint`; a sharded optimizer entry
    comes back consolidated, from the shard files beside it (each verified the same way).

    Loads with ``torch.load(weights_only=True)``: no code from the file runs. A DCP checkpoint
    directory (:mod:`.dcp`) comes back as the same dict, every tensor whole.

    Raises:
        CheckpointError: missing, truncated or corrupt file (digest mismatch, unreadable archive),
            or not a ddptrain checkpoint, or a missing or corrupt optimizer shard; the message lists
            other checkpoints next to it.
    """
    path = Path(path)
    state = load_dcp(path) if is_dcp_checkpoint(path) else _load_verified(path, map_location)
    if not isinstance(state, dict) or any(k not in state for k in REQUIRED_KEYS):
        missing = [k for k in REQUIRED_KEYS if not isinstance(state, dict) or k not in state]
        raise CheckpointError(f"{path} is not a ddptrain checkpoint: keys {missing} are missing.{_others(path)}")
    if state["format_version"] != FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has checkpoint format {state['format_version']!r}; this ddptrain reads format {FORMAT_VERSION}"
        )
    if isinstance(state["optimizer"], dict) and "shards" in state["optimizer"]:
        state["optimizer"] = _consolidated(path, state["optimizer"])
    return state


def _consolidated(path: Path, entry: dict[str, Any]) -> dict[str, Any]:
    """A sharded optimizer entry with its shard files read and put together (torch's format)."""
    from ...ddp.zero import consolidate_shards

    world_size = int(entry["shards"])
    shards = []
    for rank in range(world_size):
        shard_path = optimizer_shard_path(path, rank, world_size)
        if not shard_path.is_file():
            raise CheckpointError(
                f"checkpoint {path} keeps its optimizer state in {world_size} shard files beside it "
                f"(trainer.checkpoint.sharded), and {shard_path.name} is missing: copy a checkpoint "
                f"with its {path.name}.optim-* files.{_others(path)}"
            )
        shards.append(_load_verified(shard_path))
    try:
        return consolidate_shards(entry, shards)
    except ValueError as exc:
        raise CheckpointError(f"checkpoint {path}: {exc}") from None


def _load_verified(path: Path, map_location: Any = "cpu") -> Any:
    """``torch.load(weights_only=True)`` of ``path`` after checking it against its digest file."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist{_others(path)}")
    data = path.read_bytes()
    sidecar = path.with_name(path.name + ".sha256")
    if sidecar.is_file():
        expected = sidecar.read_text().split()[0] if sidecar.read_text().strip() else ""
        actual = hashlib.sha256(data).hexdigest()
        if actual != expected:
            raise CheckpointError(
                f"checkpoint {path} is corrupt or truncated: its SHA-256 is {actual[:16]}..., but "
                f"{sidecar.name} records {expected[:16] or 'nothing'}... ({len(data)} bytes on disk). "
                f"It was not loaded and nothing was deleted.{_others(path)}"
            )
    else:
        warnings.warn(
            f"checkpoint {path} has no {sidecar.name}: its integrity cannot be verified beyond what torch.load checks",
            CheckpointWarning,
            stacklevel=2,
        )
    try:
        state = torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    except Exception as exc:  # torch raises RuntimeError, EOFError, UnpicklingError... for bad files
        detail = str(exc).splitlines()[0] if str(exc) else "no detail"
        if "weights only load failed" in str(exc).lower():
            raise CheckpointError(
                f"checkpoint {path} carries pickled Python objects (code) beyond tensors and plain "
                f"values, and ddptrain never runs code from a checkpoint (torch.load(weights_only=True) "
                f"refused it: {_unsafe_global(str(exc))}). Load it yourself only if you trust its author, "
                "and re-save the state dicts as plain tensors."
            ) from exc
        raise CheckpointError(
            f"checkpoint {path} cannot be read ({type(exc).__name__}: {detail}): "
            f"it is truncated, corrupt, or not a torch checkpoint. It was not loaded and nothing was "
            f"deleted.{_others(path)}"
        ) from exc
    return state


def _unsafe_global(text: str) -> str:
    """The line of torch's message that names the refused global, else its first line."""
    for line in text.splitlines():
        if "GLOBAL" in line or "Unsupported global" in line:
            return line.strip()
    return text.splitlines()[0]


def _others(path: Path) -> str:
    others = [p for p in list_checkpoints(path.parent) if p != path] if path.parent.is_dir() else []
    if not others:
        return ""
    names = ", ".join(p.name for p in reversed(others[-3:]))
    return (
        f" Other checkpoints in {path.parent}: {names}; resume from one with "
        f"trainer.resume=<path>, or trainer.resume=latest to take the newest valid one."
    )


def list_checkpoints(directory: PathLike) -> list[Path]:
    """Checkpoints in ``directory``, oldest (fewest steps) first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def monitor_entry(path: PathLike) -> dict[str, Any] | None:
    """The ``monitor`` entry (``{"name", "mode", "value"}``) a best checkpoint stores; ``None`` if
    it has none or cannot be read. Reads no tensor (memory-mapped, or a DCP checkpoint's plain values)."""
    try:
        if is_dcp_checkpoint(path):
            state = load_dcp(path, tensors=False)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # unreadable: not a candidate; load_checkpoint says why when it is chosen
        return None
    entry = state.get("monitor") if isinstance(state, dict) else None
    return dict(entry) if isinstance(entry, dict) and {"name", "mode", "value"} <= set(entry) else None


def load_step(path: PathLike) -> int:
    """The step in a checkpoint's name (``step_<step>.pt`` or ``step_<step>.dcp``)."""
    match = _NAME.match(Path(path).name)
    if match is None:
        raise ValueError(f"{path} is not named step_<step>.pt or step_<step>.dcp")
    return int(match.group(1))


def prune_checkpoints(directory: PathLike, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` checkpoints (and their digests); return the deleted."""
    deleted = []
    for path in list_checkpoints(directory)[:-keep_last] if keep_last > 0 else []:
        remove_checkpoint(path)
        deleted.append(path)
    return deleted


def remove_checkpoint(path: PathLike) -> None:
    """Delete a checkpoint, its optimizer shards and their digests (any may already be gone)."""
    path = Path(path)
    if is_dcp_checkpoint(path):
        shutil.rmtree(path, ignore_errors=True)
        return
    shards = list(path.parent.glob(f"{glob.escape(path.name)}.optim-*")) if path.parent.is_dir() else []
    for p in (*shards, path, path.with_name(path.name + ".sha256")):
        try:
            p.unlink()
        except FileNotFoundError:
            pass


def model_weights(checkpoint: dict[str, Any], path: str | Path, ema: bool = False) -> dict[str, Any]:
    """The module's state dict in ``checkpoint`` (read from ``path``): the trained weights, or
    with ``ema`` their moving average (the checkpoint's ``"ema"`` entry, same keys).

    Raises:
        ConfigError: ``ema`` and the checkpoint holds no EMA weights.
    """
    if not ema:
        return checkpoint["model"]
    if not checkpoint.get("ema"):
        raise ConfigError(
            f"{path} holds no EMA weights: its run did not set trainer.ema.decay. Load the trained "
            "weights (ema=False), or train with trainer.ema.decay=0.999 to keep an average."
        )
    return checkpoint["ema"]["weights"]
