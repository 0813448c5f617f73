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

from .types import GroupError, ReduceOp, Work


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
