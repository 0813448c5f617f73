"""The functional API: ``torch.distributed``'s names and argument order over ddptrain groups.

``import ddptrain.comm as dist`` runs the tutorial's code unchanged. Ranks given as ``src``/``dst``
are global ranks, as in torch; ``group=None`` means the default (world) group. Every call with
``async_op=True`` (and ``isend``/``irecv``) returns a :class:`Work`; otherwise it blocks, bounded
by the group's timeout.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch

from .. import envvars
from .backends import create_backend
from .ledger import DTYPES, Ledger
from .ledger_check import PeerCheck
from .process_group import ProcessGroup
from .ring import ring_all_reduce as _ring_all_reduce
from .stacks import enable_stack_dumps
from .store import DEFAULT_INIT_TIMEOUT, Store, rendezvous, wait_for_all_ranks
from .types import CommTimeoutError, GroupError, ReduceOp, Work, as_timedelta, to_reduce_op


class _NonMember:
    """What ``new_group`` returns on ranks outside the new group; any use is refused."""

    def __init__(self, ranks: Sequence[int], rank: int):
        self.ranks = list(ranks)
        self.rank = rank

    def __repr__(self):
        return f"<not a member: rank {self.rank} is outside group {self.ranks}>"


class GroupMember:
    NON_GROUP_MEMBER = _NonMember


class _State:
    """The functional API's default group and settings (one per process, or per thread in tests)."""

    def __init__(self, world: ProcessGroup | None = None):
        self.world = world
        self.store: Store | None = None
        self.groups_created = 0
        self.check_collectives: bool | str = True  # True: the ledger check; "sync": before each call
        # The ledger directory rank 0 made in the temporary folder (no DDPTRAIN_LEDGER_DIR given):
        # removed when the world group is destroyed cleanly; a crash leaves it for the post-mortem.
        self.made_ledger_dir: str | None = None


_process_state = _State()
_thread_state = threading.local()


class _CurrentState:
    """Reads and writes go to this thread's state if it has one (ranks run as threads by
    ``ddptrain.testing.run_threaded``), else to the process's."""

    @staticmethod
    def _target() -> _State:
        return getattr(_thread_state, "state", None) or _process_state

    def __getattr__(self, name):
        return getattr(self._target(), name)

    def __setattr__(self, name, value):
        setattr(self._target(), name, value)


_state = _CurrentState()


@contextlib.contextmanager
def thread_default_group(group: ProcessGroup):
    """Make ``group`` this thread's default group (for ranks that are threads of one process).

    Inside the block ``init_process_group`` is not needed: ``get_rank()``, the collectives with
    ``group=None`` and ``is_initialized()`` see ``group``; other threads are unaffected.
    """
    previous = getattr(_thread_state, "state", None)
    _thread_state.state = _State(group)
    try:
        yield group
    finally:
        _thread_state.state = previous


def is_initialized() -> bool:
    return _state.world is not None


def init_process_group(
    backend: str | None = None,
    init_method: str | None = None,
    timeout=None,
    world_size: int = -1,
    rank: int = -1,
    store: Store | None = None,
    group_name: str = "world",
    check_collectives: bool | None = None,
    init_timeout=None,
    master_addr: str | None = None,
) -> ProcessGroup:
    """Join the job: rendezvous with every rank, then build the default group.

    Args:
        backend: ``"gloo"`` (default), ``"nccl"`` or ``"mpi"``.
        init_method: ``env://`` (default), ``tcp://host:port`` or ``file:///path``. Ignored with
            a warning by ``mpi``, whose ranks come from ``mpirun``.
        timeout: seconds or timedelta for every collective (default 30 min); also for the
            rendezvous unless ``init_timeout`` is given.
        init_timeout: how long to wait for every rank to arrive (e.g. long, for slow schedulers,
            while ``timeout`` stays short so a stuck training collective fails fast).
        world_size, rank: ``-1`` reads ``WORLD_SIZE``/``RANK`` from the environment.
        store: an existing :class:`Store` instead of ``init_method`` (needs rank and world_size).
        master_addr: with ``store``, the store's host: gloo talks on the interface that routes to
            it, which the other hosts can reach (default ``MASTER_ADDR``, else loopback).
        check_collectives: how mismatched collectives (operation, size, dtype, root) are caught.
            ``True`` (default; ``DDPTRAIN_CHECK_COLLECTIVES=1``): every ``DDPTRAIN_CHECK_EVERY``
            collectives each rank compares its peers' ledgers (memory-mapped files, no message):
            no cost on the call, and ``async_op=True`` returns before the peers arrive, as in
            torch; a mismatch that hangs or crashes the backend is explained by the timeout's
            ledger forensics. ``"sync"``: one small all-reduce before each call of this API
            agrees on the arguments first (about 1 ms on loopback gloo; asynchronous calls then
            wait for every rank). ``False``: no check (the ledger is still kept).

    Returns:
        The default :class:`ProcessGroup` (also reachable as ``get_process_group()``).
    """
    if _state.world is not None:
        raise GroupError(
            "init_process_group called twice: the default group already exists "
            f"({_state.world!r}); call destroy_process_group() first."
        )
    backend = (backend or "gloo").lower()
    from .backends import BACKENDS

    if backend not in BACKENDS:  # before the rendezvous: a typo must not wait out the init timeout
        raise ValueError(
            f"unknown backend {backend!r}; available backends: {', '.join(sorted(BACKENDS))} "
            "(gloo for CPU tensors, nccl for CUDA tensors, mpi through mpi4py)"
        )
    if check_collectives is None:
        check_collectives = check_mode()
    _state.check_collectives = check_collectives
    timeout_td = as_timedelta(timeout, DEFAULT_INIT_TIMEOUT)
    if backend == "mpi":
        if init_method is not None or store is not None:
            warnings.warn(
                "backend 'mpi' takes rank and world size from the MPI launcher; "
                f"init_method={init_method!r} / store are ignored",
                stacklevel=2,
            )
        pg = create_backend("mpi", None, rank, world_size, timeout_td)
        _attach_ledger(pg, None, check_collectives)
        _state.world, _state.store = pg, None
        return pg
    if store is not None:
        if init_method is not None:
            raise ValueError("pass either init_method or store to init_process_group, not both")
        if rank < 0 or world_size < 1:
            raise ValueError(
                f"init_process_group(store=...) needs rank and world_size, got rank={rank}, world_size={world_size}"
            )
        wait_for_all_ranks(store, rank, world_size, as_timedelta(init_timeout, timeout_td), "an explicit store")
        master_addr = master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
    else:
        info = rendezvous(init_method, rank, world_size, as_timedelta(init_timeout, timeout_td))
        store, rank, world_size, master_addr = info.store, info.rank, info.world_size, info.master_addr
    pg = create_backend(backend, store.prefixed("world"), rank, world_size, timeout_td, master_addr)
    pg.name = group_name
    _attach_ledger(pg, store, check_collectives)
    _state.world, _state.store = pg, store
    return pg


def check_mode() -> bool | str:
    """``DDPTRAIN_CHECK_COLLECTIVES``: True (the ledger check), ``"sync"`` or False."""
    value = (envvars.get_str("DDPTRAIN_CHECK_COLLECTIVES") or "").strip().lower()
    if value == "sync":
        return "sync"
    try:
        return envvars.get_flag("DDPTRAIN_CHECK_COLLECTIVES")
    except ValueError:
        raise ValueError(
            f"DDPTRAIN_CHECK_COLLECTIVES={value!r}: use 1 (the ledger check, default), sync "
            "(check every call before it runs) or 0 (no check)"
        ) from None


def _ledger_directory(pg: ProcessGroup, store: Store | None) -> str | None:
    """Rank 0's ``DDPTRAIN_LEDGER_DIR`` (ranks started apart, e.g. by torchrun, may each have
    picked another run directory), else a temporary directory rank 0 makes; shared through the
    store or an MPI broadcast. None with ``DDPTRAIN_LEDGER_DIR=off``."""
    mine = None
    if pg.rank() == 0:
        import tempfile

        mine = envvars.get_str("DDPTRAIN_LEDGER_DIR")
        if not mine:
            mine = _state.made_ledger_dir = tempfile.mkdtemp(prefix="ddptrain-ledger-")
    if store is not None:
        if mine:
            store.set("ledger_dir", mine)
        chosen = store.get("ledger_dir", pg.timeout).decode()
    elif pg.backend == "mpi":
        box = {}
        pg._thread.submit(lambda: box.setdefault("dir", pg.comm.bcast(mine, root=0)), []).wait()
        chosen = box["dir"]
    else:
        chosen = envvars.get_str("DDPTRAIN_LEDGER_DIR")
    return None if not chosen or chosen.lower() == "off" else chosen


def _attach_ledger(pg: ProcessGroup, store: Store | None, check) -> None:
    """Give the world group its file-backed ledger, stack dumps on SIGUSR1 and the ledger check."""
    directory = _ledger_directory(pg, store)
    rank = pg.global_ranks[pg.rank()]
    if directory is not None:  # first: a rank whose ledger file exists answers SIGUSR1 with its stack
        Path(directory).mkdir(parents=True, exist_ok=True)
        enable_stack_dumps(directory, rank)
    pg.ledger = Ledger(rank, pg.size(), directory)
    if directory is None:
        return
    if check is True:
        pg._ledger_hook = PeerCheck(directory, int(envvars.get_float("DDPTRAIN_CHECK_EVERY")))


def destroy_process_group(group=None) -> None:
    """Destroy ``group`` (default: the world group and with it the functional API's state)."""
    if group is None or group is _state.world:
        if _state.world is not None:
            _state.world.destroy()
        if _state.made_ledger_dir:  # peers that still read it tolerate a missing ledger file
            shutil.rmtree(_state.made_ledger_dir, ignore_errors=True)
        _state.world, _state.store, _state.groups_created, _state.made_ledger_dir = None, None, 0, None
    elif isinstance(group, ProcessGroup):
        group.destroy()


def get_process_group() -> ProcessGroup:
    """The default group; :class:`GroupError` if ``init_process_group`` has not run."""
    return _resolve(None, "get_process_group")


def get_store() -> Store:
    _resolve(None, "get_store")
    if _state.store is None:
        raise GroupError(f"the default group's backend ({_state.world.backend}) uses no key-value store")
    return _state.store


def _resolve(group, op: str) -> ProcessGroup:
    if isinstance(group, _NonMember):
        raise GroupError(
            f"{op}: rank {group.rank} is not a member of group {group.ranks}; only its "
            "members may use it (new_group returned a non-member marker on this rank)"
        )
    if group is None:
        if _state.world is None:
            raise GroupError(
                f"{op}: the default process group is not initialised; call ddptrain.comm.init_process_group(...) first."
            )
        group = _state.world
    if not isinstance(group, ProcessGroup):
        raise TypeError(f"{op}: group must be a ddptrain ProcessGroup or None, got {type(group).__name__}")
    group.check_alive(op)
    return group


def get_rank(group=None) -> int:
    if group is None and _state.world is None:
        return -1  # torch.distributed warns and returns -1 outside a job; scripts test for it
    return _resolve(group, "get_rank").rank()


def get_world_size(group=None) -> int:
    if group is None and _state.world is None:
        return -1
    return _resolve(group, "get_world_size").size()


def get_backend(group=None) -> str:
    return _resolve(group, "get_backend").backend


def new_group(ranks: Sequence[int] | None = None, timeout=None, backend: str | None = None):
    """Create a group of the given global ranks. Every rank of the world must call it, in the
    same order, as in torch; non-members get a marker that refuses any use."""
    world = _resolve(None, "new_group")
    size = world.size()
    ranks = list(range(size)) if ranks is None else sorted(int(r) for r in ranks)
    if len(set(ranks)) != len(ranks) or any(not 0 <= r < size for r in ranks) or not ranks:
        raise ValueError(f"new_group: ranks {ranks} must be distinct global ranks in [0, {size})")
    if backend is not None and backend.lower() != world.backend:
        raise ValueError(
            f"new_group: backend {backend!r} differs from the world's {world.backend!r}; "
            "subgroups use the world's backend"
        )
    _state.groups_created += 1
    name = f"group{_state.groups_created}"
    sub = world.new_subgroup(ranks, name, as_timedelta(timeout, world.timeout))
    return sub if sub is not None else _NonMember(ranks, world.rank())


_OP_CODES = {
    name: i
    for i, name in enumerate(["broadcast", "all_reduce", "reduce", "all_gather", "gather", "scatter", "reduce_scatter"])
}
# The ledger's fixed table: codes must mean the same dtype on every rank, whatever each rank used first.
_DTYPE_CODES = {dt: i for i, dt in enumerate(DTYPES) if dt is not None}


def _check_uniform(
    pg: ProcessGroup, op_name: str, tensor: torch.Tensor, detail: int = 0, async_op: bool = False
) -> None:
    """Agree across ranks on (operation, numel, dtype, detail); raise naming every rank's view.

    One all-reduce of MAX over ``[x, -x]`` gives each field's maximum and minimum at once: equal
    means every rank agrees. Only on disagreement do we all-gather the full picture (all ranks
    disagree together, so all take that path and none is left waiting).

    ``async_op=True`` calls are checked too: a rank may call a collective synchronously while its
    peer calls it asynchronously, so every call must pay the same check. The price is that an
    asynchronous call returns only once every rank has called it (switch the check off for code
    that overlaps an asynchronous collective with point-to-point traffic its peers do first).
    """
    if _state.check_collectives != "sync" or pg.size() == 1:
        return
    dtype_code = _DTYPE_CODES.get(tensor.dtype, 99)
    fields = torch.tensor([_OP_CODES[op_name], tensor.numel(), dtype_code, detail], dtype=torch.int64)
    both = torch.cat([fields, -fields]).to(pg.device)
    pg.label_next_collective("argument check")
    try:
        pg.all_reduce(both, ReduceOp.MAX).wait()
    except CommTimeoutError as exc:  # name the user's collective, not the check's all-reduce
        raise CommTimeoutError(
            f"{op_name}: not every rank of group {pg.name!r} called it in time "
            f"(timed out agreeing on its arguments). {exc}"
        ) from exc
    both = both.cpu()
    if torch.equal(both[:4], -both[4:]):
        return
    views = [torch.zeros(4, dtype=torch.int64, device=pg.device) for _ in range(pg.size())]
    pg.all_gather(views, fields.to(pg.device)).wait()
    names = {v: k for k, v in _OP_CODES.items()}
    dtypes = {v: k for k, v in _DTYPE_CODES.items()}
    lines = [
        f"  rank {pg.global_ranks[i]}: {names.get(int(v[0]), '?')} of {int(v[1])} elements, "
        f"dtype {dtypes.get(int(v[2]), 'unknown to this rank')}, op/root {int(v[3])}"
        for i, v in enumerate(views)
    ]
    raise ValueError(
        f"{op_name}: the ranks of group {pg.name!r} called mismatched collectives; every rank must "
        "call the same operation with tensors of the same size and dtype (and the same op/root):\n"
        + "\n".join(lines)
        + "\nFix the call so all ranks agree (e.g. pad to a common size), or "
        "all_gather the sizes first."
    )


def _finish(work: Work, async_op: bool):
    if async_op:
        return work
    work.wait()
    return None


# -- point to point -------------------------------------------------------------------------
def isend(tensor: torch.Tensor, dst: int, group=None, tag: int = 0) -> Work:
    pg = _resolve(group, "isend")
    return pg.send(tensor, pg.group_rank(dst, "dst"), tag)


def irecv(tensor: torch.Tensor, src: int | None = None, group=None, tag: int = 0) -> Work:
    pg = _resolve(group, "irecv")
    if src is None:
        raise ValueError("irecv/recv need src: receiving from any source is not supported")
    return pg.recv(tensor, pg.group_rank(src, "src"), tag)


def send(tensor: torch.Tensor, dst: int, group=None, tag: int = 0) -> None:
    isend(tensor, dst, group, tag).wait()


def recv(tensor: torch.Tensor, src: int | None = None, group=None, tag: int = 0) -> int:
    irecv(tensor, src, group, tag).wait()
    return src


# -- collectives ----------------------------------------------------------------------------
def broadcast(tensor, src, group=None, async_op=False):
    pg = _resolve(group, "broadcast")
    _check_uniform(pg, "broadcast", tensor, src, async_op)
    return _finish(pg.broadcast(tensor, pg.group_rank(src, "src")), async_op)


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
    pg = _resolve(group, "all_reduce")
    _check_uniform(pg, "all_reduce", tensor, list(ReduceOp).index(to_reduce_op(op)), async_op)
    return _finish(pg.all_reduce(tensor, op), async_op)


def reduce(tensor, dst, op=ReduceOp.SUM, group=None, async_op=False):
    pg = _resolve(group, "reduce")
    _check_uniform(pg, "reduce", tensor, dst * 8 + list(ReduceOp).index(to_reduce_op(op)), async_op)
    return _finish(pg.reduce(tensor, pg.group_rank(dst, "dst"), op), async_op)


def all_gather(tensor_list, tensor, group=None, async_op=False):
    pg = _resolve(group, "all_gather")
    _check_uniform(pg, "all_gather", tensor, 0, async_op)
    return _finish(pg.all_gather(tensor_list, tensor), async_op)


def gather(tensor, gather_list=None, dst=0, group=None, async_op=False):
    pg = _resolve(group, "gather")
    _check_uniform(pg, "gather", tensor, dst, async_op)
    return _finish(pg.gather(tensor, gather_list, pg.group_rank(dst, "dst")), async_op)


def scatter(tensor, scatter_list=None, src=0, group=None, async_op=False):
    pg = _resolve(group, "scatter")
    _check_uniform(pg, "scatter", tensor, src, async_op)
    return _finish(pg.scatter(tensor, scatter_list, pg.group_rank(src, "src")), async_op)


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False):
    pg = _resolve(group, "reduce_scatter")
    _check_uniform(pg, "reduce_scatter", output, list(ReduceOp).index(to_reduce_op(op)), async_op)
    return _finish(pg.reduce_scatter(output, input_list, op), async_op)


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
    pg = _resolve(group, "all_to_all")
    return _finish(pg.all_to_all(output_tensor_list, input_tensor_list), async_op)


def barrier(group=None, async_op=False, device_ids=None):
    return _finish(_resolve(group, "barrier").barrier(), async_op)


def ring_all_reduce(tensor, op=ReduceOp.SUM, group=None):
    """All-reduce in place with ddptrain's ring algorithm over ``isend/irecv`` (see ``comm.ring``)."""
    return _ring_all_reduce(_resolve(group, "ring_all_reduce"), tensor, op)
