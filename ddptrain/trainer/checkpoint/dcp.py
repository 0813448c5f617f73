"""Checkpoints in torch's distributed format (``trainer.checkpoint.format=dcp``).

A DCP checkpoint is a directory, ``step_<step>.dcp/``, that ``torch.distributed.checkpoint``
reads by itself: ``.metadata`` (where every tensor's pieces lie), one ``__<rank>_0.distcp`` data
file per rank that wrote something, and ``SHA256SUMS`` (``sha256sum -c SHA256SUMS`` verifies it by
hand; :func:`load_dcp` checks it before reading anything).

**What goes where.** The model's tensors are stored under their bare names (no ``module.``), at
the top level, as torchtitan and torchtune expect: with no ddptrain import and no process group::

    import torch.distributed.checkpoint as dcp
    state = model.state_dict()
    dcp.load(state, checkpoint_id="run/checkpoints/step_000000300.dcp")
    model.load_state_dict(state)

Every other tensor of the checkpoint dict (:meth:`.checkpointer.Checkpointer.state_dict`) is stored
as ``ddptrain.<its path>`` (``ddptrain.optimizer.state.0.exp_avg``); the rest of the dict (its
plain values and its shape, with each tensor replaced by a reference to its key) is one entry,
``ddptrain.skeleton``. :func:`load_dcp` puts them together again: it returns the same dict a
``.pt`` checkpoint holds, so every reader (resume, ``ddptrain.load_model``, ``ddptrain.export``)
treats both formats alike.

**Who writes what.** Each rank passes the same dict. Replicated tensors (the weights, the
optimizer state of plain DDP) are written once, each by one rank, spread over the ranks (DCP's
deduplication). ZeRO's optimizer state is passed as each rank's own pieces
(:func:`sharded_optimizer_entry`), each with its position in the whole tensor; reading assembles the
whole tensors, which any world size cuts again. The skeleton is rank 0's.

**When it is visible.** Every rank writes into ``.step_<step>.dcp.<token>.tmp/``; once all have
written, rank 0 writes ``.metadata`` and ``SHA256SUMS`` and renames the directory. A process killed
mid-write leaves the temporary directory, which nothing reads and the next save of that name
deletes, and the previous checkpoint stays the latest.

**Safety.** Plain values load with ``torch.load(weights_only=True)``, as ``.pt`` checkpoints do.
DCP's ``.metadata`` is a pickle of DCP's own classes; it is read by an unpickler that admits only
those (and torch's sizes and dtypes), so no code from a checkpoint runs.

The coordination (plans out to the ranks, write results back to rank 0) uses ddptrain's own
collectives, so it works over every backend (gloo, nccl, mpi) and needs no ``torch.distributed``
process group.
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import pickle
import secrets
import shutil
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem, SavePlan
from torch.distributed.checkpoint.storage import WriteResult

from ...comm.objects import all_gather_object, broadcast_object
from ...comm.process_group import ProcessGroup
from ...ddp.zero import is_per_element
from ...errors import CheckpointError, CheckpointWarning
from .background import host_snapshot

__all__ = [
    "SUFFIX",
    "SKELETON_KEY",
    "is_dcp_checkpoint",
    "save_dcp",
    "load_dcp",
    "sharded_optimizer_entry",
    "DcpWrite",
]

SUFFIX = ".dcp"
"""A DCP checkpoint's directory name ends with this (``step_<step>.dcp``)."""
PREFIX = "ddptrain."
"""The keys of every tensor outside the model's state dict start with this."""
SKELETON_KEY = "ddptrain.skeleton"
"""The entry holding the checkpoint dict's plain values and shape."""
MANIFEST = "SHA256SUMS"
_TENSOR_REF = "__ddptrain.dcp.tensor__"  # (marker, key): where the skeleton had a tensor
_WRITTEN = ".written-"  # a background save's per-rank results, in the temporary directory


def is_dcp_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` names a DCP checkpoint directory (by its name; it may not exist)."""
    return Path(path).name.endswith(SUFFIX)


# == ZeRO's pieces as DCP chunks ===================================================================
def sharded_optimizer_entry(group: ProcessGroup, groups_entry: dict[str, Any], shard: dict[str, Any]) -> dict[str, Any]:
    """The ``optimizer`` entry of a DCP checkpoint of a ZeRO run: torch's ``state_dict`` layout
    (``{"state": {index: {key: value}}, "param_groups": ...}``), the same on every rank, in which
    each element-wise tensor holds only this rank's elements, with their position in the whole
    parameter-shaped tensor, and each other value (Adam's ``step``) is whole. Collective (one
    object all-gather of shapes and dtypes; no tensor data moves).

    Args:
        groups_entry: the consolidated entry's other keys (``param_groups``).
        shard: this rank's :meth:`ddptrain.ddp.zero.ZeroOptimizer.shard_state_dict`.
    """
    mine = {
        k: {
            "shape": list(piece["shape"]),
            "elementwise": {key: v.dtype for key, v in piece["state"].items() if is_per_element(v)},
            "whole": {key: v for key, v in piece["state"].items() if not is_per_element(v)},
        }
        for k, piece in shard["params"].items()
    }
    described: dict[int, dict[str, Any]] = {}
    for ranks_params in all_gather_object(group, mine):
        for k, description in ranks_params.items():
            described.setdefault(int(k), description)
    state: dict[int, dict[str, Any]] = {}
    for k, description in sorted(described.items()):
        piece = shard["params"].get(k)
        entry = dict(description["whole"])
        for key, dtype in description["elementwise"].items():
            if piece is None:
                entry[key] = _no_chunk(description["shape"], dtype)
            else:
                entry[key] = _chunked(piece["state"][key], description["shape"], piece["lo"], piece["hi"])
        state[k] = entry
    return {"state": state, **{key: v for key, v in groups_entry.items() if key not in ("state", "shards")}}


def flat_range_chunks(shape: tuple[int, ...], lo: int, hi: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The elements ``[lo, hi)`` of a row-major tensor of ``shape`` as rectangular chunks
    ``(offsets, sizes)``, in order: each chunk is a contiguous run of those elements."""
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [((lo,), (hi - lo,))] if shape else [((), ())]
    row = math.prod(shape[1:])
    first_full, end_full = -(-lo // row), hi // row  # whole rows [first_full, end_full)
    if first_full > end_full:  # inside one row
        r = lo // row
        return [((r, *o), (1, *s)) for o, s in flat_range_chunks(shape[1:], lo - r * row, hi - r * row)]
    chunks = []
    if lo < first_full * row:  # the end of the row before the first whole one
        r = first_full - 1
        chunks += [((r, *o), (1, *s)) for o, s in flat_range_chunks(shape[1:], lo - r * row, row)]
    if end_full > first_full:
        chunks.append(((first_full, *(0,) * (len(shape) - 1)), (end_full - first_full, *shape[1:])))
    if hi > end_full * row:  # the start of the row after the last whole one
        chunks += [((end_full, *o), (1, *s)) for o, s in flat_range_chunks(shape[1:], 0, hi - end_full * row)]
    return chunks


def _chunked(values: torch.Tensor, shape: list[int], lo: int, hi: int) -> torch.Tensor:
    """Elements ``[lo, hi)`` of a tensor of ``shape`` (``values``, flat) as a
    :class:`torch.distributed.checkpoint.CheckpointableTensor`: a local tensor spanning the rows
    they touch (a copy), with the position of each of its chunks in the whole."""
    shape_t = tuple(shape)
    chunks = flat_range_chunks(shape_t, lo, hi)
    if len(shape_t) <= 1:
        local, first_row = values.detach().reshape((hi - lo,) if shape_t else ()).clone(), lo
    else:
        row = math.prod(shape_t[1:])
        first_row, end_row = lo // row, -(-hi // row)
        local = torch.zeros((end_row - first_row, *shape_t[1:]), dtype=values.dtype, device=values.device)
        local.view(-1)[lo - first_row * row : hi - first_row * row] = values.detach().reshape(-1)
    local_offsets = [(o[0] - first_row, *o[1:]) if o else () for o, _ in chunks]
    return _as_checkpointable(local, shape_t, [o for o, _ in chunks], local_offsets, [s for _, s in chunks])


def _no_chunk(shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    """A parameter-shaped tensor of which this rank holds no element."""
    return _as_checkpointable(torch.empty((0,) * len(shape), dtype=dtype), tuple(shape), [], [], [])


def _as_checkpointable(local: torch.Tensor, shape, global_offsets, local_offsets, local_sizes) -> torch.Tensor:
    local.global_shape = tuple(shape)  # type: ignore[attr-defined]
    local.global_offsets = tuple(map(tuple, global_offsets))  # type: ignore[attr-defined]
    local.local_offsets = tuple(map(tuple, local_offsets))  # type: ignore[attr-defined]
    local.local_sizes = tuple(map(tuple, local_sizes))  # type: ignore[attr-defined]
    return local


def _is_chunked(value: Any) -> bool:
    return torch.is_tensor(value) and hasattr(value, "global_offsets")


# == the checkpoint dict as DCP entries ============================================================
def _flatten(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], Any]:
    """``({key: tensor}, skeleton)``: every tensor of ``state`` under its DCP key (the model's under
    their own names), and ``state`` with each tensor replaced by ``(marker, key)``."""
    tensors: dict[str, torch.Tensor] = {}
    paths: dict[str, tuple] = {}

    def walk(value: Any, path: tuple) -> Any:
        if torch.is_tensor(value):
            key = path[1] if path[:1] == ("model",) and len(path) == 2 else PREFIX + ".".join(map(str, path))
            if key in paths or (path[:1] == ("model",) and key.startswith(PREFIX)):
                raise CheckpointError(
                    f"the checkpoint entries {paths.get(key, path)} and {path} would both be stored as {key!r} "
                    "in a DCP checkpoint (a model key must not start with 'ddptrain.'): rename the module, or use "
                    "trainer.checkpoint.format=torch"
                )
            tensors[key], paths[key] = value, path
            return (_TENSOR_REF, key)
        if isinstance(value, dict):
            return {k: walk(v, (*path, k)) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(walk(v, (*path, i)) for i, v in enumerate(value))
        return value

    return tensors, walk(state, ())


def _unflatten(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(skeleton, tuple) and len(skeleton) == 2 and skeleton[0] == _TENSOR_REF:
        return tensors[skeleton[1]]
    if isinstance(skeleton, dict):
        return {k: _unflatten(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, (list, tuple)):
        return type(skeleton)(_unflatten(v, tensors) for v in skeleton)
    return skeleton


# == saving ========================================================================================
@dataclass
class DcpWrite:
    """One rank's part of a DCP save, planned (collectively) and not yet written: :meth:`write`
    it, then rank 0 commits everyone's results (:meth:`commit`). A background save writes it in a thread."""

    path: Path
    """The checkpoint's final directory."""
    tmp: Path
    """Where the ranks write until rank 0 renames it to ``path``."""
    planner: DefaultSavePlanner
    writer: FileSystemWriter
    plan: SavePlan
    metadata: Metadata | None
    """Rank 0's: the global metadata, for :meth:`commit`."""

    def snapshot(self) -> None:
        """Replace the tensors this rank writes by host copies, and forget the others (a
        background save: training goes on changing the live ones)."""
        planned = {item.index.fqn for item in self.plan.items}
        mine = {key: v for key, v in self.planner.state_dict.items() if key in planned}
        copies = host_snapshot(mine)
        for key, value in mine.items():
            if _is_chunked(value):  # the copy keeps the positions of its chunks
                _as_checkpointable(
                    copies[key], value.global_shape, value.global_offsets, value.local_offsets, value.local_sizes
                )
        self.planner.state_dict = copies

    def write(self) -> tuple[list[WriteResult], dict[str, str]]:
        """Write this rank's data file; its write results and ``{file name: sha256}``. Local."""
        done = self.writer.write_data(self.plan, self.planner)
        done.wait()
        results = done.value()
        names = sorted({r.storage_data.relative_path for r in results})
        return results, {name: _sha256(self.tmp / name) for name in names}

    def publish(self, rank: int, written: tuple[list[WriteResult], dict[str, str]] | BaseException) -> None:
        """A background save's way to hand rank 0 what :meth:`write` returned, or why it failed:
        a file in the temporary directory (the training thread owns the collectives)."""
        if isinstance(written, BaseException):
            written = _Failed(f"{type(written).__name__}: {written}")
        tmp = self.tmp / f".written-{rank}.tmp"
        tmp.write_bytes(pickle.dumps(written))
        os.replace(tmp, self.tmp / f"{_WRITTEN}{rank}")

    def gather_published(self, world_size: int, timeout_s: float) -> list[tuple[list[WriteResult], dict[str, str]]]:
        """Rank 0: every rank's results (:meth:`publish`), waiting up to ``timeout_s`` for them.

        Raises:
            CheckpointError: a rank did not publish in time (it died, or its disk is that slow).
        """
        deadline = time.monotonic() + timeout_s
        files = [self.tmp / f"{_WRITTEN}{r}" for r in range(world_size)]
        while missing := [r for r, f in enumerate(files) if not f.is_file()]:
            if time.monotonic() > deadline:
                raise CheckpointError(
                    f"checkpoint {self.path}: rank(s) {missing} did not finish writing their part within "
                    f"{timeout_s:.0f} s (the group's timeout); the checkpoint was not made visible and the "
                    "previous one stays the latest"
                )
            time.sleep(0.02)
        everyone = [pickle.loads(f.read_bytes()) for f in files]  # our own ranks' files, of this save
        for f in files:
            f.unlink()
        failed = {r: w.why for r, w in enumerate(everyone) if isinstance(w, _Failed)}
        if failed:
            raise CheckpointError(
                f"checkpoint {self.path}: rank(s) {sorted(failed)} failed to write their part ({failed}); the "
                "checkpoint was not made visible and the previous one stays the latest"
            )
        return everyone

    def commit(self, everyone: list[tuple[list[WriteResult], dict[str, str]]]) -> Path:
        """Rank 0, once every rank has written: ``.metadata``, ``SHA256SUMS``, then the rename."""
        assert self.metadata is not None, "rank 0 commits"
        self.writer.finish(metadata=self.metadata, results=[results for results, _ in everyone])
        digests = {".metadata": _sha256(self.tmp / ".metadata")}
        for _, files in everyone:
            digests.update(files)
        manifest = "".join(f"{digest}  {name}\n" for name, digest in sorted(digests.items()))
        (self.tmp / MANIFEST).write_text(manifest)
        _fsync_dir(self.tmp)
        old = None
        if self.path.exists():  # this step was saved before: its directory goes once the new one is in place
            old = self.path.with_name(f".{self.path.name}.{secrets.token_hex(4)}.old.tmp")
            os.replace(self.path, old)
        os.replace(self.tmp, self.path)
        _fsync_dir(self.path.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return self.path


@dataclass
class _Failed:
    """What a rank publishes when its background write failed."""

    why: str


def plan_dcp(path: str | os.PathLike, state: dict[str, Any], group: ProcessGroup) -> DcpWrite:
    """Plan a DCP save of ``state`` to ``path`` (collective; every rank passes its own ``state``
    of the same shape). Rank 0 clears what a killed save of this name left."""
    path = Path(path)
    rank = group.rank()
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        for stale in path.parent.glob(f".{path.name}.*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp_name = f".{path.name}.{secrets.token_hex(4)}.tmp"
        (path.parent / tmp_name).mkdir()
    else:
        tmp_name = None
    tmp = path.parent / broadcast_object(group, tmp_name)  # also: no rank writes before the directory exists
    seen = all_gather_object(group, tmp.is_dir())
    if not all(seen):
        raise CheckpointError(
            f"trainer.checkpoint.format=dcp: rank(s) {[r for r, s in enumerate(seen) if not s]} do not see the "
            f"directory {tmp} that rank 0 made, so the ranks do not share {path.parent}'s file system, and every rank "
            "writes its part of a DCP checkpoint there. Put trainer.output_dir on a file system all ranks share, or "
            "use trainer.checkpoint.format=torch (rank 0 writes it, and a resume sends it to the other ranks)"
        )
    tensors, skeleton = _flatten(state)
    entries: dict[str, Any] = dict(tensors)
    if rank == 0:
        entries[SKELETON_KEY] = skeleton
    planner = DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    writer = FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=True)
    planner.set_up_planner(state_dict=entries, storage_meta=writer.storage_meta(), is_coordinator=rank == 0)
    writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
    local_plan = writer.prepare_local_plan(planner.create_local_plan())
    all_plans = all_gather_object(group, local_plan)
    metadata = None
    if rank == 0:
        global_plans, metadata = planner.create_global_plan(all_plans)
        global_plans = writer.prepare_global_plan(global_plans)
    else:
        global_plans = None
    mine = broadcast_object(group, global_plans)[rank]
    return DcpWrite(path, tmp, planner, writer, planner.finish_plan(mine), metadata)


def save_dcp(path: str | os.PathLike, state: dict[str, Any], group: ProcessGroup) -> Path:
    """Write ``state`` as a DCP checkpoint at ``path`` (collective: every rank writes its part;
    rank 0 makes it visible, and returns when it is; the others return once they have written)."""
    planned = plan_dcp(path, state, group)
    everyone = all_gather_object(group, planned.write())
    return planned.commit(everyone) if group.rank() == 0 else planned.path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# == loading =======================================================================================
class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata classes, torch's sizes, dtypes and layouts, and plain containers only."""

    _TORCH = {"Size", "device"}

    def find_class(self, module: str, name: str) -> Any:
        allowed = (
            module.startswith("torch.distributed.checkpoint.")
            or (module == "torch" and (name in self._TORCH or isinstance(getattr(torch, name, None), _TORCH_ENUMS)))
            or (module == "torch.serialization" and name == "_get_layout")
            or (module == "pathlib" and name in ("PosixPath", "WindowsPath"))
            or (module == "collections" and name == "OrderedDict")
        )
        if not allowed:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP's metadata")
        return super().find_class(module, name)


_TORCH_ENUMS = (torch.dtype, torch.layout, torch.memory_format)


class _Reader(FileSystemReader):
    """DCP's file reader, with the metadata read by :class:`_MetadataUnpickler`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with open(Path(self.path) / ".metadata", "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f".metadata holds a {type(metadata).__name__}, not DCP's Metadata")
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _LoadPlanner(DefaultLoadPlanner):
    """Plain values load with ``torch.load(weights_only=True)``: no code from the file runs."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)


def load_dcp(path: str | os.PathLike, *, tensors: bool = True) -> dict[str, Any]:
    """The checkpoint dict a DCP checkpoint holds, every tensor whole and on the CPU (ZeRO's pieces
    put together); with ``tensors=False`` only its plain values (each tensor left as a reference),
    which reads no tensor data. Local: no collective, no process group.

    Raises:
        CheckpointError: missing or incomplete directory, a file that does not match
            ``SHA256SUMS``, or not a checkpoint ddptrain wrote.
    """
    path = Path(path)
    _verify(path)
    reader = _Reader(path)
    try:
        metadata = reader.read_metadata()
    except Exception as exc:  # noqa: BLE001 - pickle and IO errors of every kind: an unreadable checkpoint
        raise CheckpointError(f"checkpoint {path}: its .metadata cannot be read ({type(exc).__name__}: {exc})") from exc
    if SKELETON_KEY not in metadata.state_dict_metadata:
        raise CheckpointError(
            f"{path} is a DCP checkpoint that ddptrain did not write (it has no {SKELETON_KEY} entry): load it "
            "with torch.distributed.checkpoint.load into your model's state_dict"
        )
    template: dict[str, Any] = {SKELETON_KEY: None}
    if tensors:
        for key, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                template[key] = torch.empty(md.size, dtype=md.properties.dtype)
    with warnings.catch_warnings():  # DCP warns that it loads without a process group: that is the point
        warnings.simplefilter("ignore")
        try:
            dcp.load(template, storage_reader=reader, planner=_LoadPlanner(), no_dist=True)
        except Exception as exc:  # noqa: BLE001 - DCP wraps every failure in its own CheckpointException
            raise CheckpointError(f"checkpoint {path} cannot be read: {' '.join(str(exc).split())[:400]}") from exc
    skeleton = template.pop(SKELETON_KEY)
    if not tensors:
        return skeleton
    return _unflatten(skeleton, template)


def _verify(path: Path) -> None:
    """Check every file ``SHA256SUMS`` lists; warn when there is none (not written by ddptrain)."""
    if not (path / ".metadata").is_file():
        raise CheckpointError(
            f"checkpoint {path} is not a complete DCP checkpoint: it has no .metadata "
            f"({'the directory does not exist' if not path.is_dir() else 'its save did not finish'})"
        )
    manifest = path / MANIFEST
    if not manifest.is_file():
        warnings.warn(
            f"checkpoint {path} has no {MANIFEST}: its integrity cannot be verified",
            CheckpointWarning,
            stacklevel=3,
        )
        return
    for name, expected in _manifest_entries(manifest):
        file = path / name
        actual = _sha256(file) if file.is_file() else "missing"
        if actual != expected:
            raise CheckpointError(
                f"checkpoint {path} is corrupt or incomplete: {name} "
                f"{'is missing' if actual == 'missing' else f'has SHA-256 {actual[:16]}...'}, but {MANIFEST} "
                f"records {expected[:16]}.... It was not loaded and nothing was deleted."
            )


def _manifest_entries(manifest: Path) -> Iterator[tuple[str, str]]:
    for line in manifest.read_text().splitlines():
        if line.strip():
            digest, name = line.split(maxsplit=1)
            yield name.strip(), digest
