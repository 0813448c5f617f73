"""Ring all-reduce over point-to-point messages (the tutorial's section 0x07, done properly).

The tensor is cut into ``p`` chunks. In ``p-1`` reduce-scatter steps every rank sends one chunk
to its right neighbour and folds the chunk arriving from its left one into its own copy; after
them rank ``r`` holds the fully reduced chunk ``(r+1) % p``. In ``p-1`` all-gather steps the
reduced chunks travel once more round the ring. Each rank sends ``2(p-1)/p · N`` elements in
``2(p-1)`` messages, which is the bandwidth-optimal bound.

Works on any :class:`ProcessGroup` with ``send``/``recv``, for any world size (1 included),
lengths that do not divide by ``p`` (chunks of unequal, possibly zero, length), every dtype, and
SUM, PRODUCT, MAX, MIN, AVG (AVG: floating dtypes only). Integer results are exact and equal the
backend's own all-reduce; floating-point sums may differ in the last bits (another order).
"""

from __future__ import annotations

import torch

from .process_group import ProcessGroup
from .types import ReduceOp, check_avg_dtype, to_reduce_op

RING_TAG = 7919  # keeps ring messages apart from a user's own send/recv tags

_FOLD = {
    ReduceOp.SUM: torch.Tensor.add_,
    ReduceOp.AVG: torch.Tensor.add_,
    ReduceOp.PRODUCT: torch.Tensor.mul_,
    ReduceOp.MAX: lambda acc, x: torch.maximum(acc, x, out=acc),
    ReduceOp.MIN: lambda acc, x: torch.minimum(acc, x, out=acc),
}


def _fold(op: ReduceOp, acc: torch.Tensor, incoming: torch.Tensor) -> None:
    if acc.dtype == torch.bool:  # logical sum/max is "or", product/min is "and"
        if op in (ReduceOp.SUM, ReduceOp.MAX):
            acc.logical_or_(incoming)
        else:
            acc.logical_and_(incoming)
        return
    _FOLD[op](acc, incoming)


def ring_chunk_owned(rank: int, world_size: int) -> int:
    """The chunk that :func:`ring_reduce_scatter` leaves fully reduced on ``rank``: ``(rank+1) % p``."""
    return (rank + 1) % world_size


def ring_all_reduce(group: ProcessGroup, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
    """All-reduce ``tensor`` in place across ``group`` with the ring algorithm; returns it.

    It is :func:`ring_reduce_scatter` then :func:`ring_all_gather`, so a reduce-scatter alone
    leaves each rank's chunk with exactly the bits this all-reduce gives it."""
    op = to_reduce_op(op)
    check_avg_dtype(op, tensor, "ring_all_reduce")
    group.check_alive("ring_all_reduce")
    p = group.size()
    if p == 1 or tensor.numel() == 0:
        return tensor
    work_tensor = tensor if tensor.is_contiguous() else tensor.contiguous()
    ring_reduce_scatter(group, work_tensor, op)
    ring_all_gather(group, work_tensor)
    if op is ReduceOp.AVG:
        work_tensor.div_(p)
    if work_tensor is not tensor:
        tensor.copy_(work_tensor)
    return tensor


def ring_chunks(tensor: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    """The ring's chunks of a contiguous ``tensor``: ``torch.tensor_split`` of its flat view into
    ``world_size`` parts (the first ``numel % world_size`` one element longer)."""
    return list(torch.tensor_split(tensor.view(-1), world_size))


def ring_reduce_scatter(group: ProcessGroup, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> int:
    """The ring's first phase, in place on a contiguous ``tensor``: afterwards chunk
    :func:`ring_chunk_owned` of :func:`ring_chunks` holds the reduction over every rank (AVG: the
    sum; the caller divides); the other chunks hold partial results. Returns that chunk's index.

    Chunk ``c`` is folded rank after rank starting at rank ``c``, in ``p-1`` steps in which every
    rank sends one chunk to its right neighbour: the same order, so the same bits, on every call."""
    p, rank = group.size(), group.rank()
    owned = ring_chunk_owned(rank, p)
    if p == 1 or tensor.numel() == 0:
        return owned
    chunks = ring_chunks(tensor, p)
    scratch = torch.empty_like(chunks[0])
    for step in range(p - 1):
        send_idx, recv_idx = (rank - step) % p, (rank - step - 1) % p
        incoming = scratch[: chunks[recv_idx].numel()]
        _exchange(group, chunks[send_idx], incoming)
        if incoming.numel():
            _fold(op, chunks[recv_idx], incoming)
    return owned


def ring_all_gather(group: ProcessGroup, tensor: torch.Tensor) -> None:
    """The ring's second phase, in place on a contiguous ``tensor`` whose chunk
    :func:`ring_chunk_owned` is this rank's: afterwards every chunk holds its owner's values."""
    p, rank = group.size(), group.rank()
    if p == 1 or tensor.numel() == 0:
        return
    chunks = ring_chunks(tensor, p)
    for step in range(p - 1):  # received chunks land in place
        send_idx, recv_idx = (rank + 1 - step) % p, (rank - step) % p
        _exchange(group, chunks[send_idx], chunks[recv_idx])


def _exchange(group: ProcessGroup, send: torch.Tensor, recv_into: torch.Tensor) -> None:
    """Send ``send`` to the right neighbour while receiving ``recv_into`` from the left one."""
    p, rank = group.size(), group.rank()
    works = []
    if send.numel():
        works.append(group.send(send, (rank + 1) % p, RING_TAG))
    if recv_into.numel():
        works.append(group.recv(recv_into, (rank - 1) % p, RING_TAG))
    for w in works:
        w.wait()


class RingAllReducer:
    """``ring_all_reduce`` as an asynchronous SUM all-reduce: ``reducer(tensor) -> Work``.

    Calls run one after another on a worker thread of their own, in the order they were made,
    leaving the caller — the DDP reducer inside backward — free to go on. Ranks that make their
    calls in the same order (DDP launches buckets in the same order everywhere) therefore run
    the same rings in the same order. In DDP it is the state of
    ``ddptrain.ddp.comm_hooks.ring_allreduce_hook`` (config: ``dist.algorithm=ring``).
    """

    def __init__(self, group: ProcessGroup):
        import concurrent.futures

        self.group = group
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddptrain-ring")

    def __call__(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM):
        from .types import FutureWork

        fut: torch.futures.Future = torch.futures.Future()

        def run():
            try:
                ring_all_reduce(self.group, tensor, op)
                fut.set_result([tensor])
            except BaseException as exc:  # noqa: BLE001 - surface in the waiter
                fut.set_exception(exc)

        self._pool.submit(run)
        return FutureWork(
            "ring_all_reduce", [tensor], fut, self.group.timeout, describe=f"on group {self.group.name!r} "
        )
