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
import functools
from collections.abc import Sequence
from datetime import timedelta

import torch

from .ledger import Ledger, call_site
from .types import GroupError, ReduceOp, Work


def _reduce_code(op) -> int:
    from .types import to_reduce_op

    return list(ReduceOp).index(to_reduce_op(op))


def _arg(args, kwargs, i: int, name: str, default=None):
    return args[i] if len(args) > i else kwargs.get(name, default)


# What the ledger records of each collective: (its main tensor, its root or reduce op), from the
# arguments of the ProcessGroup method (group ranks, as the backends take them).
_LEDGER_FIELDS = {
    "broadcast": lambda a, k: (_arg(a, k, 0, "tensor"), _arg(a, k, 1, "src", 0)),
    "all_reduce": lambda a, k: (_arg(a, k, 0, "tensor"), _reduce_code(_arg(a, k, 1, "op", ReduceOp.SUM))),
    "reduce": lambda a, k: (
        _arg(a, k, 0, "tensor"),
        _arg(a, k, 1, "dst", 0) * 8 + _reduce_code(_arg(a, k, 2, "op", ReduceOp.SUM)),
    ),
    "all_gather": lambda a, k: (_arg(a, k, 1, "tensor"), 0),
    "gather": lambda a, k: (_arg(a, k, 0, "tensor"), _arg(a, k, 2, "dst", 0)),
    "scatter": lambda a, k: (_arg(a, k, 0, "tensor"), _arg(a, k, 2, "src", 0)),
    "reduce_scatter": lambda a, k: (_arg(a, k, 0, "output"), _reduce_code(_arg(a, k, 2, "op", ReduceOp.SUM))),
    # split sizes may differ between ranks: only the number of tensors must agree
    "all_to_all": lambda a, k: (None, len(_arg(a, k, 1, "input_list") or ())),
    "barrier": lambda a, k: (None, 0),
}


# False only to measure what the ledger costs (scripts/bench_ledger.py): the ledger is always on.
LEDGER_ON = True


def _recorded(op: str, method):
    """``method`` of a backend, writing one ledger record before it starts the collective."""
    fields = _LEDGER_FIELDS[op]

    @functools.wraps(method)
    def collective(self, *args, **kwargs):
        if not LEDGER_ON:
            return method(self, *args, **kwargs)
        tensor, detail = fields(args, kwargs)
        self._ledger_seq += 1
        self.ledger.record(self._ledger_seq, self.name, op, tensor, detail, call_site(2))
        if self._ledger_hook is not None:
            self._ledger_hook(self, self._ledger_seq)
        return method(self, *args, **kwargs)

    collective._ledger_recorded = True
    return collective


def _sharing_ledger(method):
    """``new_subgroup``, handing this rank's ledger to the new group."""

    @functools.wraps(method)
    def new_subgroup(self, *args, **kwargs):
        group = method(self, *args, **kwargs)
        if group is not None:
            group.ledger = self.ledger
            group._ledger_hook = self._ledger_hook
        return group

    new_subgroup._ledger_recorded = True
    return new_subgroup


class ProcessGroup(abc.ABC):
    """A set of ranks that communicate; one per backend instance.

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
    _ledger_seq = 0  # collectives of this group recorded on this rank
    # called as hook(group, seq) after each record (the functional API's periodic ledger check)
    _ledger_hook = None

    def __init_subclass__(cls, **kwargs):
        """Every backend's collectives write to the ledger (:mod:`ddptrain.comm.ledger`) first."""
        super().__init_subclass__(**kwargs)
        for op in _LEDGER_FIELDS:
            method = cls.__dict__.get(op)
            if method is not None and not getattr(method, "_ledger_recorded", False):
                setattr(cls, op, _recorded(op, method))
        method = cls.__dict__.get("new_subgroup")
        if method is not None and not getattr(method, "_ledger_recorded", False):
            cls.new_subgroup = _sharing_ledger(method)

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

    # -- point to point ---------------------------------------------------------------------
    @abc.abstractmethod
    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Work: ...

    @abc.abstractmethod
    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Work: ...

    # -- collectives ------------------------------------------------------------------------
    @abc.abstractmethod
    def broadcast(self, tensor: torch.Tensor, src: int) -> Work: ...

    @abc.abstractmethod
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> Work: ...

    @abc.abstractmethod
    def reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp = ReduceOp.SUM) -> Work: ...

    @abc.abstractmethod
    def all_gather(self, tensor_list: list[torch.Tensor], tensor: torch.Tensor) -> Work: ...

    @abc.abstractmethod
    def gather(self, tensor: torch.Tensor, gather_list: list[torch.Tensor] | None, dst: int) -> Work: ...

    @abc.abstractmethod
    def scatter(self, tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None, src: int) -> Work: ...

    @abc.abstractmethod
    def reduce_scatter(
        self, output: torch.Tensor, input_list: list[torch.Tensor], op: ReduceOp = ReduceOp.SUM
    ) -> Work: ...

    @abc.abstractmethod
    def all_to_all(self, output_list: list[torch.Tensor], input_list: list[torch.Tensor]) -> Work: ...

    @abc.abstractmethod
    def barrier(self) -> Work: ...

    @abc.abstractmethod
    def new_subgroup(self, ranks: Sequence[int], name: str, timeout: timedelta) -> ProcessGroup | None:
        """Collectively create a group of the given *group* ranks; ``None`` on non-members."""


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
