"""The ``ProcessGroup`` interface that every backend implements and the rest of ddptrain uses.

Ranks passed to a ``ProcessGroup`` method (``src``, ``dst``) are *group* ranks, 0..size-1.
The functional API (``ddptrain.comm.broadcast(..., src=...)``) takes *global* ranks, as
``torch.distributed`` does, and translates.

Every operation returns a :class:`~ddptrain.comm.types.Work`. A backend may complete it on a
library thread (gloo, NCCL) or on a communication thread of its own fed by a queue (MPI): callers
only ever ``wait()`` or chain ``get_future()``.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from datetime import timedelta

import torch

from .ledger import Ledger, call_site
from .types import GroupError, ReduceOp, Work, to_reduce_op

# A fixed table: a reduce op's code must be the same on every rank.
_REDUCE_CODES = {op: i for i, op in enumerate(ReduceOp)}


def _reduce_code(op) -> int:
    return _REDUCE_CODES[to_reduce_op(op)]


class Traffic:
    """The bytes one rank handed to communication, by operation (shared by its groups).

    Counted: the tensor of every collective (the one the ledger records; for ``all_to_all`` its
    inputs) and of every ``send``. That is the payload, not what the wire carries, which depends on
    the backend's algorithm: a ring all-reduce of ``n`` bytes sends ``2(W-1)/W * n`` per rank, a
    broadcast sends ``n`` from its root. Received bytes are not counted.
    """

    def __init__(self) -> None:
        self.by_op: dict[str, int] = {}

    def add(self, op: str, *tensors: torch.Tensor | None) -> None:
        nbytes = sum(t.numel() * t.element_size() for t in tensors if t is not None)
        self.by_op[op] = self.by_op.get(op, 0) + nbytes

    @property
    def total(self) -> int:
        """Every byte counted so far."""
        return sum(self.by_op.values())


# False only to measure what the ledger costs (scripts/bench_ledger.py): the ledger is always on.
LEDGER_ON = True


class ProcessGroup(abc.ABC):
    """A set of ranks that communicate; one per backend instance.

    Backends implement ``_op``; callers use ``op``. Every operation has a public method here
    (``all_reduce``, ``broadcast``, ``send``, ``new_subgroup``, ...) and a protected hook of the
    same name with a leading underscore (``_all_reduce``, ``_broadcast``, ``_send``,
    ``_new_subgroup``, ...) that takes the same arguments. A backend implements the hooks and
    never overrides the public methods: the public method is where the collective ledger
    (:mod:`ddptrain.comm.ledger`) records the call, so a collective reached any other way is
    missing from the forensics. Code that needs an operation inside a backend calls the public
    method too (a delegating group, ``tests/recording_group.py``, implements each hook by calling
    the inner group's public method).

    Each public collective, before its hook runs (before the backend checks its arguments, so a
    call that the backend refuses is recorded as well): writes one record (group, sequence
    number, operation, tensor, root or reduce op, the caller's call site, the label given by
    :meth:`label_next_collective`), then calls the ledger hook (the functional API's periodic
    check). Point-to-point operations are not recorded: the ledger compares every member's n-th
    collective, and a send has a counterpart on one rank only. ``new_subgroup`` hands this
    rank's ledger and ledger hook to the new group.

    Attributes:
        backend: backend name (``"gloo"``, ``"nccl"``, ``"mpi"``).
        global_ranks: the global rank of each member, in group-rank order.
        timeout: default timeout of this group's operations.
        device: where tensors given to this group must live (the CPU, or for nccl the CUDA
            device that was current when the group was made). Code that makes tensors of its
            own to exchange (flags, orders, checksums) makes them here.
    """

    backend: str = "?"
    _ledger: Ledger | None = None
    _traffic: Traffic | None = None
    _ledger_seq = 0  # collectives of this group recorded on this rank
    # called as hook(group, seq) after each record (the functional API's periodic ledger check)
    _ledger_hook = None

    @property
    def ledger(self) -> Ledger:
        """This rank's collective ledger (shared by its groups); in memory until one is given."""
        if self._ledger is None:
            self._ledger = Ledger(self._rank, self._size)
        return self._ledger

    @ledger.setter
    def ledger(self, value: Ledger) -> None:
        self._ledger = value

    def label_next_collective(self, label: str) -> None:
        """Attach ``label`` (e.g. ``DDP bucket 3``) to the ledger record of this rank's next collective."""
        self.ledger.label = label

    @property
    def traffic(self) -> Traffic:
        """The bytes this rank handed to communication (:class:`Traffic`; shared by its groups)."""
        if self._traffic is None:
            self._traffic = Traffic()
        return self._traffic

    def _record(self, op: str, tensor: torch.Tensor | None, detail: int) -> None:
        """One ledger record for collective ``op`` (``detail``: its root or reduce op), then the hook."""
        self.traffic.add(op, tensor)
        if not LEDGER_ON:
            return
        self._ledger_seq += 1
        # frames: call_site, _record, the public method, its caller (the walk starts there)
        self.ledger.record(self._ledger_seq, self.name, op, tensor, detail, call_site(3))
        if self._ledger_hook is not None:
            self._ledger_hook(self, self._ledger_seq)

    def __init__(
        self,
        rank: int,
        size: int,
        global_ranks: Sequence[int],
        timeout: timedelta,
        name: str = "world",
        device: torch.device | str = "cpu",
    ):
        self._rank = rank
        self.device = torch.device(device)
        self._size = size
        self.global_ranks = list(global_ranks)
        self.timeout = timeout
        self.name = name
        self._destroyed = False

    # -- identity ---------------------------------------------------------------------------
    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, backend={self.backend!r}, rank={self._rank}, "
            f"size={self._size}, global_ranks={self.global_ranks})"
        )

    def group_rank(self, global_rank: int, what: str = "rank") -> int:
        """Translate a global rank into this group's rank, refusing ranks outside the group."""
        try:
            return self.global_ranks.index(global_rank)
        except ValueError:
            raise GroupError(
                f"{what} {global_rank} is not a member of group {self.name!r} (global ranks "
                f"{self.global_ranks}); pass a rank of the group."
            ) from None

    def check_alive(self, op: str) -> None:
        if self._destroyed:
            raise GroupError(
                f"{op} on process group {self.name!r} after it was destroyed "
                "(destroy_process_group); create a new group or initialise again."
            )

    def _check_peer(self, peer: int, op: str, what: str) -> None:
        if not 0 <= peer < self._size:
            raise GroupError(f"{op}: {what}={peer} is outside group {self.name!r} of size {self._size}")

    def destroy(self) -> None:
        """Release the backend's resources; any later operation raises :class:`GroupError`."""
        self._destroyed = True

    # -- point to point (not recorded: see the class docstring) -----------------------------
    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Work:
        self.traffic.add("send", tensor)
        return self._send(tensor, dst, tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Work:
        return self._recv(tensor, src, tag)

    # -- collectives: record, then the backend's hook ---------------------------------------
    def broadcast(self, tensor: torch.Tensor, src: int) -> Work:
        self._record("broadcast", tensor, src)
        return self._broadcast(tensor, src)

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> Work:
        self._record("all_reduce", tensor, _reduce_code(op))
        return self._all_reduce(tensor, op)

    def reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp = ReduceOp.SUM) -> Work:
        # root and reduce op in one field, root * 8 + op code (Record.describe unpacks it)
        self._record("reduce", tensor, dst * 8 + _reduce_code(op))
        return self._reduce(tensor, dst, op)

    def all_gather(self, tensor_list: list[torch.Tensor], tensor: torch.Tensor) -> Work:
        self._record("all_gather", tensor, 0)
        return self._all_gather(tensor_list, tensor)

    def gather(self, tensor: torch.Tensor, gather_list: list[torch.Tensor] | None, dst: int) -> Work:
        self._record("gather", tensor, dst)
        return self._gather(tensor, gather_list, dst)

    def scatter(self, tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None, src: int) -> Work:
        self._record("scatter", tensor, src)
        return self._scatter(tensor, scatter_list, src)

    def reduce_scatter(self, output: torch.Tensor, input_list: list[torch.Tensor], op: ReduceOp = ReduceOp.SUM) -> Work:
        self._record("reduce_scatter", output, _reduce_code(op))
        return self._reduce_scatter(output, input_list, op)

    def all_to_all(self, output_list: list[torch.Tensor], input_list: list[torch.Tensor]) -> Work:
        # split sizes may differ between ranks: only the number of tensors must agree
        self.traffic.add("all_to_all", *(input_list or ()))
        self._record("all_to_all", None, len(input_list or ()))
        return self._all_to_all(output_list, input_list)

    def barrier(self) -> Work:
        self._record("barrier", None, 0)
        return self._barrier()

    def new_subgroup(self, ranks: Sequence[int], name: str, timeout: timedelta) -> ProcessGroup | None:
        """Collectively create a group of the given *group* ranks; ``None`` on non-members.
        The new group records to this rank's ledger."""
        group = self._new_subgroup(ranks, name, timeout)
        if group is not None:
            group.ledger = self.ledger
            group._traffic = self.traffic
            group._ledger_hook = self._ledger_hook
        return group

    # -- what each backend implements (same arguments as the public methods) ---------------
    @abc.abstractmethod
    def _send(self, tensor: torch.Tensor, dst: int, tag: int) -> Work: ...

    @abc.abstractmethod
    def _recv(self, tensor: torch.Tensor, src: int, tag: int) -> Work: ...

    @abc.abstractmethod
    def _broadcast(self, tensor: torch.Tensor, src: int) -> Work: ...

    @abc.abstractmethod
    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> Work: ...

    @abc.abstractmethod
    def _reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp) -> Work: ...

    @abc.abstractmethod
    def _all_gather(self, tensor_list: list[torch.Tensor], tensor: torch.Tensor) -> Work: ...

    @abc.abstractmethod
    def _gather(self, tensor: torch.Tensor, gather_list: list[torch.Tensor] | None, dst: int) -> Work: ...

    @abc.abstractmethod
    def _scatter(self, tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None, src: int) -> Work: ...

    @abc.abstractmethod
    def _reduce_scatter(self, output: torch.Tensor, input_list: list[torch.Tensor], op: ReduceOp) -> Work: ...

    @abc.abstractmethod
    def _all_to_all(self, output_list: list[torch.Tensor], input_list: list[torch.Tensor]) -> Work: ...

    @abc.abstractmethod
    def _barrier(self) -> Work: ...

    @abc.abstractmethod
    def _new_subgroup(self, ranks: Sequence[int], name: str, timeout: timedelta) -> ProcessGroup | None: ...


def check_list_len(op: str, name: str, lst, size: int) -> None:
    if lst is None or len(lst) != size:
        got = "None" if lst is None else f"{len(lst)} tensors"
        raise ValueError(f"{op}: {name} must hold one tensor per rank of the group ({size}), got {got}")


def check_same_shape(op: str, name: str, reference: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    for i, t in enumerate(tensors):
        if t.shape != reference.shape or t.dtype != reference.dtype:
            raise ValueError(
                f"{op}: {name}[{i}] has shape {tuple(t.shape)} and dtype {t.dtype}, but the tensor "
                f"has shape {tuple(reference.shape)} and dtype {reference.dtype}; they must match"
            )
