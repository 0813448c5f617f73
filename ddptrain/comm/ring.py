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


def ring_all_reduce(group: ProcessGroup, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
    """All-reduce ``tensor`` in place across ``group`` with the ring algorithm; returns it."""
    op = to_reduce_op(op)
    check_avg_dtype(op, tensor, "ring_all_reduce")
    group.check_alive("ring_all_reduce")
    p, rank = group.size(), group.rank()
    if p == 1 or tensor.numel() == 0:
        return tensor
    work_tensor = tensor if tensor.is_contiguous() else tensor.contiguous()
    chunks = list(torch.tensor_split(work_tensor.view(-1), p))
    scratch = torch.empty_like(chunks[0])
    right, left = (rank + 1) % p, (rank - 1) % p

    def exchange(send_idx: int, recv_into: torch.Tensor) -> None:
        works = []
        if chunks[send_idx].numel():
            works.append(group.send(chunks[send_idx], right, RING_TAG))
        if recv_into.numel():
            works.append(group.recv(recv_into, left, RING_TAG))
        for w in works:
            w.wait()

    for step in range(p - 1):  # reduce-scatter
        send_idx, recv_idx = (rank - step) % p, (rank - step - 1) % p
        incoming = scratch[: chunks[recv_idx].numel()]
        exchange(send_idx, incoming)
        if incoming.numel():
            _fold(op, chunks[recv_idx], incoming)
    for step in range(p - 1):  # all-gather: received chunks land in place
        send_idx, recv_idx = (rank + 1 - step) % p, (rank - step) % p
        exchange(send_idx, chunks[recv_idx])

    if op is ReduceOp.AVG:
        work_tensor.div_(p)
    if work_tensor is not tensor:
        tensor.copy_(work_tensor)
    return tensor


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
