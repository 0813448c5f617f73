"""Communication hooks: how a bucket's gradients are combined across ranks.

A hook is ``hook(state, bucket: GradBucket) -> torch.futures.Future[Tensor]``; the future's value
is the bucket's averaged gradients (flat, same length). Register with
``DistributedDataParallel.register_comm_hook(state, hook)``. When ``state`` is ``None`` the hooks
below use the DDP module's process group.

Built in: plain all-reduce (what DDP does without a hook), fp16 and bf16 compression (divide
before the sum, so the half-precision sum cannot overflow), PowerSGD (low-rank compression
with error feedback), and ddptrain's ring all-reduce over point-to-point messages.
"""

from __future__ import annotations

import inspect
import math

import torch

from ..comm.process_group import ProcessGroup
from ..comm.ring import RingAllReducer
from ..comm.types import ReduceOp
from .buckets import GradBucket


def check_comm_hook(hook) -> None:
    """Refuse what torch DDP's ``register_comm_hook`` refuses, with its exception types and words:
    a hook that is not callable, whose ``bucket`` parameter is annotated as something other than a
    GradBucket (torch's or ours), or whose return annotation is not a ``torch.futures.Future``.
    Unannotated hooks pass (what they return is checked when they run)."""
    if not callable(hook):
        raise TypeError(f"Communication hook must be callable. Got {type(hook).__name__} {hook!r}.")
    try:
        sig = inspect.signature(hook, eval_str=True)
    except (NameError, TypeError, ValueError, SyntaxError):  # unresolvable names, or no signature at all
        try:
            sig = inspect.signature(hook)
        except (TypeError, ValueError):
            return
    params = list(sig.parameters.values())
    bucket = sig.parameters.get("bucket") or (params[1] if len(params) > 1 else None)
    if bucket is not None and not _is_grad_bucket_annotation(bucket.annotation):
        raise ValueError(
            "Communication hook: bucket annotation should be dist.GradBucket. "
            f"Got {bucket.annotation!r}: a hook is called as hook(state, bucket) with a GradBucket."
        )
    if not _is_future_annotation(sig.return_annotation):
        raise ValueError(
            "Communication hook: return annotation should be torch.futures.Future[torch.Tensor]. "
            f"Got {sig.return_annotation!r}."
        )


def _is_grad_bucket_annotation(annotation) -> bool:
    import torch.distributed as tdist

    if annotation is inspect.Parameter.empty or annotation is GradBucket:
        return True
    if tdist.is_available() and annotation is tdist.GradBucket:
        return True
    return isinstance(annotation, str) and annotation.split(".")[-1] == "GradBucket"


def _is_future_annotation(annotation) -> bool:
    if annotation is inspect.Signature.empty:
        return True
    if isinstance(annotation, str):
        return annotation.replace(" ", "").split("[")[0].split(".")[-1] == "Future"
    origin = getattr(annotation, "__origin__", annotation)
    return isinstance(origin, type) and issubclass(origin, torch._C.Future)


def _group(state, bucket: GradBucket) -> ProcessGroup:
    if isinstance(state, ProcessGroup):
        return state
    pg = getattr(state, "process_group", None)
    return pg if isinstance(pg, ProcessGroup) else bucket.process_group


def allreduce_hook(state, bucket: GradBucket) -> torch.futures.Future:
    """Average the bucket with one all-reduce (divide first, then SUM)."""
    pg = _group(state, bucket)
    buffer = bucket.buffer().div_(pg.size())
    return pg.all_reduce(buffer, ReduceOp.SUM).get_future().then(lambda fut: fut.value()[0])


def _compress_hook(dtype: torch.dtype):
    def hook(state, bucket: GradBucket) -> torch.futures.Future:
        pg = _group(state, bucket)
        buffer = bucket.buffer()
        compressed = buffer.to(dtype).div_(pg.size())

        def decompress(fut):
            buffer.copy_(fut.value()[0])
            return buffer

        return pg.all_reduce(compressed, ReduceOp.SUM).get_future().then(decompress)

    hook.__name__ = f"{str(dtype).split('.')[-1]}_compress_hook"
    hook.__doc__ = f"Send the bucket as {dtype} (half the bytes), divided by the world size before the sum."
    return hook


fp16_compress_hook = _compress_hook(torch.float16)
bf16_compress_hook = _compress_hook(torch.bfloat16)

COMPRESSIONS = {"bf16": (torch.bfloat16, bf16_compress_hook), "fp16": (torch.float16, fp16_compress_hook)}
"""The choices of ``dist.grad_compression`` (besides ``none``): the dtype gradients travel in,
and the hook that sends plain DDP's buckets in it (ZeRO's reduce-scatter takes the dtype)."""


def ring_allreduce_hook(state: RingAllReducer, bucket: GradBucket) -> torch.futures.Future:
    """Average the bucket with ddptrain's ring all-reduce (divide first, then SUM round the ring).

    ``state`` is a :class:`~ddptrain.comm.ring.RingAllReducer`: its one worker thread runs the
    rings one after another, in the order DDP launches buckets, which is the same on every
    rank — so the ranks' point-to-point messages always pair up. Register with
    ``ddp.register_comm_hook(RingAllReducer(ddp.process_group), ring_allreduce_hook)``
    (config: ``dist.algorithm=ring``).
    """
    if not isinstance(state, RingAllReducer):
        raise TypeError(
            f"ring_allreduce_hook needs a RingAllReducer as its state (it owns the thread that keeps "
            f"buckets in order), got {type(state).__name__}: register it with "
            "ddp.register_comm_hook(RingAllReducer(ddp.process_group), ring_allreduce_hook)."
        )
    buffer = bucket.buffer().div_(state.group.size())
    return state(buffer, ReduceOp.SUM).get_future().then(lambda fut: fut.value()[0])


class PowerSGDState:
    """State of :func:`powerSGD_hook` (one per DDP module).

    Args:
        process_group: group to reduce over (``None``: the DDP module's).
        matrix_approximation_rank: rank ``r`` of the low-rank approximation (1-4 is typical).
        start_powerSGD_iter: iterations of plain all-reduce before compression starts (lets the
            model leave its noisy start; torch's default is 1000).
        use_error_feedback: add last iteration's compression error back before compressing.
        warm_start: reuse last iteration's Q as the start of the power iteration.
        seed: seed of the random initial Q (same on every rank).
    """

    def __init__(
        self,
        process_group: ProcessGroup | None = None,
        matrix_approximation_rank: int = 1,
        start_powerSGD_iter: int = 1000,
        use_error_feedback: bool = True,
        warm_start: bool = True,
        seed: int = 0,
    ):
        if matrix_approximation_rank < 1:
            raise ValueError(f"matrix_approximation_rank must be >= 1, got {matrix_approximation_rank}")
        self.process_group = process_group
        self.rank = matrix_approximation_rank
        self.start_iter = start_powerSGD_iter
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.seed = seed
        self.iter = 0
        self.errors: dict[int, torch.Tensor] = {}
        self.qs: dict[int, torch.Tensor] = {}

    def maybe_increase_iter(self, bucket: GradBucket) -> None:
        if bucket.is_last():
            self.iter += 1


def _orthogonalize(m: torch.Tensor) -> None:
    """Gram-Schmidt on the columns of ``m``, in place (r is small, so this is cheap)."""
    for i in range(m.shape[1]):
        col = m[:, i]
        if i:
            col -= m[:, :i] @ (m[:, :i].T @ col)
        col /= col.norm().clamp_min(1e-8)


def powerSGD_hook(state: PowerSGDState, bucket: GradBucket) -> torch.futures.Future:
    """Compress the bucket to rank ``r`` with one step of power iteration (Vogels et al., 2019).

    The bucket is viewed as a near-square matrix M (zero padded). With error feedback,
    ``M += error``; then ``P = M Q``, all-reduce P, orthonormalise it, ``Q = Mᵀ P``, all-reduce Q,
    and the average is ``P Qᵀ / world_size``; ``error = M - P Qᵀ / world_size`` is kept locally.
    Two small all-reduces replace one of the whole bucket. Before ``start_powerSGD_iter`` it
    is a plain all-reduce.
    """
    pg = _group(state, bucket)
    world = pg.size()
    buffer = bucket.buffer()
    if state.iter < state.start_iter:
        state.maybe_increase_iter(bucket)
        return allreduce_hook(pg, bucket)
    n = buffer.numel()
    side = max(1, math.isqrt(n - 1) + 1) if n > 1 else 1
    cols = max(1, math.ceil(n / side))
    r = min(state.rank, side, cols)
    work_dtype = torch.float32 if buffer.dtype in (torch.float16, torch.bfloat16) else buffer.dtype
    m = torch.zeros(side * cols, dtype=work_dtype, device=buffer.device)
    m[:n] = buffer
    idx = bucket.index()
    if state.use_error_feedback:
        if idx in state.errors and state.errors[idx].numel() == m.numel():
            m += state.errors[idx]
    m = m.view(side, cols)
    if not state.warm_start or idx not in state.qs or state.qs[idx].shape != (cols, r):
        gen = torch.Generator().manual_seed(state.seed + idx)
        state.qs[idx] = torch.randn(cols, r, generator=gen, dtype=work_dtype).to(buffer.device)
    q = state.qs[idx]
    p = m @ q
    pg.all_reduce(p, ReduceOp.SUM).wait()
    _orthogonalize(p)
    q = m.T @ p
    pg.all_reduce(q, ReduceOp.SUM).wait()
    q.div_(world)
    approx = p @ q.T
    if state.use_error_feedback:
        state.errors[idx] = (m - approx).reshape(-1).clone()
    state.qs[idx] = q
    buffer.copy_(approx.reshape(-1)[:n])
    state.maybe_increase_iter(bucket)
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(buffer)
    return fut
