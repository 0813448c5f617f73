"""The collective ledger: every rank's last collectives, in a ring buffer others can read.

Each rank records, for every collective it starts (from user code, DDP or the Trainer: the record
is made by :class:`~ddptrain.comm.process_group.ProcessGroup`'s public collective methods), the
group's sequence number, the operation, the tensor's shape and dtype, the root or reduce op, and
the call site: file:line of the first frame outside ddptrain and torch (DDP's buckets add a label,
``DDP bucket 3``). Records live in a memory-mapped file, ``<dir>/rank<N>.ledger``, when a ledger
directory is set (``DDPTRAIN_LEDGER_DIR``; the launchers set it, the CLI to ``<run dir>/ledger``):
the pages belong to the page cache, so a rank that is stopped, stuck or dead can still be read by
its peers, by the launcher and by ``python -m ddptrain.dump``. Without a directory the ring is
anonymous memory (only the rank itself reads it).

The same directory holds ``rank<N>.stack``, where a live rank writes its threads' Python stacks
when asked with ``SIGUSR1`` (:mod:`ddptrain.comm.stacks`; :mod:`ddptrain.comm.forensics` reads them).

Recording costs one frame walk (the classification of each code object is cached) and one
``struct.pack_into``: a few microseconds per collective (``scripts/bench_ledger.py``).
"""

from __future__ import annotations

import mmap
import os
import socket
import struct
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch

MAGIC = b"DDPLEDG1"
# magic, rank, world size, pid, capacity, record size, records written, hostname
_HEADER = struct.Struct("<8siiiIIq64s")
_COUNT_OFFSET = 8 + 4 * 5
HEADER_SIZE = 128
# seq, group, op, dtype, ndim, flags, numel, detail, shape[4], time, call site, label
_RECORD = struct.Struct("<q24sBBBBqq4id96s24s")
DEFAULT_CAPACITY = 1024

OPS = ("?", "broadcast", "all_reduce", "reduce", "all_gather", "gather", "scatter", "reduce_scatter", "all_to_all")
OPS += ("barrier",)
_OP_CODES = {name: i for i, name in enumerate(OPS)}
# A fixed table: codes must mean the same dtype on every rank.
DTYPES = (
    None,
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
_DTYPE_CODES = {dt: i for i, dt in enumerate(DTYPES) if dt is not None}
REDUCE_OPS = ("SUM", "PRODUCT", "MAX", "MIN", "AVG")


@dataclass(frozen=True)
class Record:
    """One collective as a rank started it."""

    seq: int
    group: str
    op: str
    dtype: str
    shape: tuple
    numel: int
    detail: int
    time: float
    site: str
    label: str

    def fingerprint(self) -> tuple:
        """What every rank must agree on for this collective to be the same one."""
        return (self.op, self.dtype, self.numel, self.detail)

    def describe(self) -> str:
        what = "barrier" if self.op == "barrier" else f"{self.op} of {self.dtype}{list(self.shape)}"
        if self.op == "all_to_all":
            what = f"all_to_all of {self.detail} tensors"
        elif self.op in ("all_reduce", "reduce_scatter"):
            what += f" {REDUCE_OPS[self.detail] if 0 <= self.detail < 5 else self.detail}"
        elif self.op in ("broadcast", "scatter", "gather"):
            what += f" root {self.detail}"
        elif self.op == "reduce":
            what += f" root {self.detail // 8} {REDUCE_OPS[self.detail % 8] if self.detail % 8 < 5 else '?'}"
        label = f" [{self.label}]" if self.label else ""
        return f"{what}{label} from {self.site}"


# -- call sites ------------------------------------------------------------------------------------
_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SKIPPED = tuple(os.path.join(_PKG, sub) + os.sep for sub in ("comm", "ddp", "testing", "launch")) + (
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
    os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep,
)
_USER, _FALLBACK, _SKIP = 0, 1, 2
_kinds: dict = {}  # code object -> _USER / _FALLBACK (ddptrain's Trainer, data) / _SKIP
_sites: dict = {}  # (code object, line) -> encoded "file:line in function"


def frame_kind(filename: str) -> int:
    """Whether a frame is user code, another part of ddptrain (a fallback site), or skipped."""
    path = os.path.abspath(filename)
    if path.startswith(_SKIPPED) or filename.startswith("<"):  # <string>: python -c, spawn's bootstrap
        return _SKIP
    if path.startswith(_PKG + os.sep):
        return _FALLBACK
    return _USER


def short_path(filename: str) -> str:
    """A path relative to the working directory when under it (ddptrain's own: ``ddptrain/...``),
    else as it is."""
    if filename.startswith(_PKG + os.sep):
        return "ddptrain" + filename[len(_PKG) :]
    try:
        rel = os.path.relpath(filename)
    except ValueError:
        return filename
    return filename if rel.startswith("..") else rel


def _site(code, line: int) -> bytes:
    key = (code, line)
    site = _sites.get(key)
    if site is None:
        where = f"{short_path(code.co_filename)}:{line}".encode()
        if len(where) > 80:
            where = b"..." + where[-77:]
        site = _sites[key] = (where + f" in {code.co_name}".encode())[:96]
    return site


def call_site(depth: int = 2) -> bytes:
    """file:line of the first frame outside ddptrain and torch (else of the first ddptrain frame
    outside the communication layer, e.g. the Trainer's), walking out from ``depth`` frames up."""
    frame = sys._getframe(depth)
    fallback = None
    kinds = _kinds
    while frame is not None:
        code = frame.f_code
        kind = kinds.get(code)
        if kind is None:
            kind = kinds[code] = frame_kind(code.co_filename)
        if kind == _USER:
            return _site(code, frame.f_lineno)
        if kind == _FALLBACK and fallback is None:
            fallback = (code, frame.f_lineno)
        frame = frame.f_back
    return _site(*fallback) if fallback else b"?"


# -- the ring ----------------------------------------------------------------------------------
class Ledger:
    """One rank's ring of collective records (see the module docstring)."""

    def __init__(self, rank: int = 0, world_size: int = 1, directory: str | Path | None = None, capacity: int = 0):
        self.rank = rank
        self.world_size = world_size
        self.capacity = capacity or DEFAULT_CAPACITY
        self.directory = Path(directory) if directory else None
        size = HEADER_SIZE + self.capacity * _RECORD.size
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(ledger_path(self.directory, rank), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.ftruncate(fd, size)
                self._buf = mmap.mmap(fd, size)
            finally:
                os.close(fd)
        else:
            self._buf = mmap.mmap(-1, size)
        host = socket.gethostname().encode()[:64]
        _HEADER.pack_into(self._buf, 0, MAGIC, rank, world_size, os.getpid(), self.capacity, _RECORD.size, 0, host)
        self.count = 0
        self.label = ""  # attached to the next record only (DDP's bucket index)

    def record(self, seq: int, group: str, op: str, tensor, detail: int, site: bytes) -> None:
        """Append one collective (``tensor`` may be None: barrier)."""
        if tensor is None:
            dtype, numel, shape, ndim = 0, 0, (0, 0, 0, 0), 0
        else:
            dims = tensor.shape
            ndim = len(dims)
            shape = (tuple(dims) + (0, 0, 0, 0))[:4]
            dtype, numel = _DTYPE_CODES.get(tensor.dtype, 255), tensor.numel()
        label, self.label = self.label, ""
        slot = HEADER_SIZE + (self.count % self.capacity) * _RECORD.size
        _RECORD.pack_into(
            self._buf,
            slot,
            seq,
            group.encode()[:24],
            _OP_CODES.get(op, 0),
            dtype,
            ndim,
            0,
            numel,
            detail,
            *shape,
            time.time(),
            site,
            label.encode()[:24],
        )
        self.count += 1
        struct.pack_into("<q", self._buf, _COUNT_OFFSET, self.count)

    def records(self) -> list[Record]:
        return parse(self._buf)[1]

    def close(self) -> None:
        try:
            self._buf.close()
        except (BufferError, ValueError):
            pass


def ledger_path(directory: str | Path, rank: int) -> Path:
    return Path(directory) / f"rank{rank}.ledger"


@dataclass
class LedgerFile:
    """What a rank's ledger file says: who wrote it, and its records oldest first."""

    rank: int
    world_size: int
    pid: int
    host: str
    records: list[Record]


def _record_from(raw: tuple) -> Record:
    seq, group, op, dtype, ndim, _flags, numel, detail, s0, s1, s2, s3, t, site, label = raw
    dt = DTYPES[dtype] if 0 < dtype < len(DTYPES) else None
    return Record(
        seq=seq,
        group=group.rstrip(b"\0").decode(errors="replace"),
        op=OPS[op] if op < len(OPS) else "?",
        dtype=str(dt).replace("torch.", "") if dt is not None else "?",
        shape=(s0, s1, s2, s3)[: min(ndim, 4)],
        numel=numel,
        detail=detail,
        time=t,
        site=site.rstrip(b"\0").decode(errors="replace"),
        label=label.rstrip(b"\0").decode(errors="replace"),
    )


def parse(buf) -> tuple[tuple, list[Record]]:
    """(header fields, records oldest first) of a ledger's bytes."""
    magic, rank, world, pid, capacity, rsize, count, host = _HEADER.unpack_from(buf, 0)
    if magic != MAGIC or rsize != _RECORD.size:
        raise ValueError("not a ddptrain ledger (or one of another version)")
    out = []
    for i in range(max(0, count - capacity), count):
        out.append(_record_from(_RECORD.unpack_from(buf, HEADER_SIZE + (i % capacity) * rsize)))
    return (rank, world, pid, host.rstrip(b"\0").decode(errors="replace")), out


def read_ledger(path: str | Path) -> LedgerFile | None:
    """A ledger file's contents, or None if it is missing or not a ledger."""
    try:
        data = Path(path).read_bytes()
        (rank, world, pid, host), records = parse(data)
    except (OSError, ValueError, struct.error):
        return None
    return LedgerFile(rank, world, pid, host, records)


def read_all(directory: str | Path) -> dict[int, LedgerFile]:
    """Every rank's ledger in ``directory``, by rank."""
    found = {}
    for path in sorted(Path(directory).glob("rank*.ledger")):
        led = read_ledger(path)
        if led is not None:
            found[led.rank] = led
    return found
