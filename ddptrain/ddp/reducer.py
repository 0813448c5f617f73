"""The reducer: gradient hooks, bucket launches during backward, and the finalize step.

Lifecycle of one synchronised iteration (see ``DistributedDataParallel.forward``):

1. ``prepare_for_forward`` — refuse to go on if the previous backward left buckets unreduced
   (a parameter got no gradient), and rebuild the buckets once, after the first iteration, in
   the order gradients actually arrived (rank 0's order, broadcast).
2. ``prepare_for_backward(outputs)`` — reset counters; with ``find_unused_parameters`` walk the
   autograd graph from the outputs and mark the parameters it does not reach as ready.
3. During backward, each parameter's post-accumulate-grad hook copies its gradient into its
   bucket's flat buffer and counts the bucket down; a bucket at zero is launched (async
   all-reduce or the registered comm hook), buckets strictly in order so every rank issues
   the same collectives in the same order.
4. The hook of the first gradient queues ``finalize`` on the autograd engine; it runs when the
   whole backward is done, waits for every bucket and writes the averaged gradients back (or
   the gradients already *are* views into the buckets: ``gradient_as_bucket_view``).

Large gradients are reduced where they lie. Copying a gradient into the flat buffer and the
result back costs two passes over memory, which on a CPU-bound rank costs as much as a large part
of the all-reduce itself; coalescing only pays for small tensors (one collective instead of
many). So, without a comm hook and without ``gradient_as_bucket_view``, a gradient of at least
``DIRECT_MIN_BYTES`` is averaged in place (one pass) and all-reduced as its own tensor, while the
bucket's small gradients still travel together through the flat buffer. Which tensors go direct
depends only on the bucket layout, so every rank issues the same collectives in the same order.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..comm.process_group import ProcessGroup
from ..comm.types import ReduceOp
from .buckets import FIRST_BUCKET_CAP_MB, MB, Bucket, assign_buckets, make_buckets

# Gradients at least this big are all-reduced in place instead of through the flat buffer.
DIRECT_MIN_BYTES = 1 << 20


@dataclass
class IterationStats:
    """What one synchronised backward did, for the trainer's logs and for benchmarks.

    Times are ``time.perf_counter()`` seconds; ``launch_offsets_s`` are relative to the first
    gradient hook, ``None`` for a bucket that was never launched.
    """

    iteration: int
    bucket_bytes: list[int]
    bucket_num_params: list[int]
    backward_start: float = 0.0
    backward_end: float = 0.0
    launch_times: list[float | None] = field(default_factory=list)
    finalize_wait_s: float = 0.0
    rebuilt_buckets: bool = False

    @property
    def launch_offsets_s(self) -> list[float | None]:
        return [None if t is None else t - self.backward_start for t in self.launch_times]

    @property
    def comm_wait_s(self) -> float:
        return self.finalize_wait_s


class GradBucket:
    """What a communication hook receives: one bucket's flat gradient buffer and its parameters.

    Mirrors ``torch.distributed.GradBucket``: ``buffer()``, ``index()``, ``is_last()``,
    ``parameters()``, ``gradients()`` (views into the buffer) and ``set_buffer()``.
    """

    def __init__(self, bucket: Bucket, params: Sequence[torch.Tensor], is_last: bool, process_group: ProcessGroup):
        self._bucket = bucket
        self._params = [params[i] for i in bucket.param_indices]
        self._is_last = is_last
        self.process_group = process_group

    def index(self) -> int:
        return self._bucket.index

    def buffer(self) -> torch.Tensor:
        return self._bucket.buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._bucket.buffer.copy_(tensor)

    def is_last(self) -> bool:
        return self._is_last

    def parameters(self) -> list[torch.Tensor]:
        return list(self._params)

    def gradients(self) -> list[torch.Tensor]:
        return list(self._bucket.views)


CommHook = Callable[[object, GradBucket], torch.futures.Future]


class Reducer:
    """Averages gradients across ``process_group`` while backward runs."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        names: Sequence[str],
        process_group: ProcessGroup,
        bucket_cap_bytes: int,
        gradient_as_bucket_view: bool = False,
        find_unused_parameters: bool = False,
    ):
        self.params = list(params)
        self.names = list(names)
        self.pg = process_group
        self.world_size = process_group.size()
        self.bucket_cap_bytes = bucket_cap_bytes
        self.as_view = gradient_as_bucket_view
        self.find_unused = find_unused_parameters
        self.comm_hook: CommHook | None = None
        self.comm_hook_state: object = None
        self.all_reduce_fn: Callable[[torch.Tensor], object] = lambda t: self.pg.all_reduce(t, ReduceOp.SUM)
        self.direct_min_bytes = DIRECT_MIN_BYTES
        self._sizes = [p.numel() * p.element_size() for p in self.params]
        self._keys = [(p.dtype, p.device) for p in self.params]
        self._install_buckets(assign_buckets(self._sizes, self._keys, bucket_cap_bytes))
        self.iteration = 0
        self.rebuilt = False
        self._should_rebuild = False
        self._ready = [False] * len(self.params)
        self._ready_order: list[int] = []
        self._expect_hooks = False
        self._finalized = False
        self._callback_queued = False
        self._next_bucket = 0
        self._locally_used = torch.zeros(len(self.params), dtype=torch.int32)
        self._incomplete: list[str] | None = None
        self.last_stats: IterationStats | None = None
        self._stats: IterationStats | None = None
        self._hook_handles = [
            p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(self.params)
        ]

    # -- buckets ----------------------------------------------------------------------------
    def _install_buckets(self, assignment: list[list[int]]) -> None:
        self.assignment = assignment
        self.buckets = make_buckets(self.params, assignment)
        self._locate = {}
        for b in self.buckets:
            for pos, i in enumerate(b.param_indices):
                self._locate[i] = (b.index, pos)
            b.segments = _segments([self._sizes[i] >= self.direct_min_bytes for i in b.param_indices])
        if self.as_view:
            for b in self.buckets:
                for pos, i in enumerate(b.param_indices):
                    p = self.params[i]
                    if p.grad is not None:
                        b.views[pos].copy_(p.grad)
                    p.grad = b.views[pos] if p.grad is not None else None

    def _rebuild(self) -> None:
        """Re-bucket once in the order gradients arrived on rank 0, so all ranks agree."""
        seen = set(self._ready_order)
        order = self._ready_order + [i for i in range(len(self.params)) if i not in seen]
        order_t = torch.tensor(order, dtype=torch.int64, device=self.pg.device)
        self.pg.broadcast(order_t, 0).wait()
        order = order_t.cpu().tolist()
        self._install_buckets(
            assign_buckets(
                self._sizes,
                self._keys,
                self.bucket_cap_bytes,
                first_cap_bytes=min(int(FIRST_BUCKET_CAP_MB * MB), self.bucket_cap_bytes),
                order=order,
                reverse=False,
            )
        )
        self.rebuilt = True
        self._should_rebuild = False

    # -- iteration --------------------------------------------------------------------------
    def prepare_for_forward(self) -> bool:
        """Check the previous iteration and rebuild buckets when due; True if it rebuilt."""
        if self._incomplete is not None:
            missing, self._incomplete = self._incomplete, None
            raise RuntimeError(
                "DDP expected every parameter to receive a gradient in the previous backward, but "
                f"these did not: {', '.join(missing)}. Their buckets were never all-reduced, so "
                "gradients would be wrong. Either make the forward use these parameters, or "
                "construct DistributedDataParallel(..., find_unused_parameters=True) (slower: it "
                "walks the autograd graph every iteration), or set requires_grad=False on "
                "parameters that should not train."
            )
        if self._should_rebuild and not self.rebuilt:
            self._rebuild()
            return True
        return False

    def prepare_for_backward(self, outputs, sync: bool) -> None:
        self._expect_hooks = sync
        self._callback_queued = False
        self._finalized = False
        if not sync:
            return
        for b in self.buckets:
            b.pending = len(b.param_indices)
            b.work = None
            b.launched_at = None
            b.direct = {}
        self._ready = [False] * len(self.params)
        self._ready_order = []
        self._next_bucket = 0
        self._stats = IterationStats(
            self.iteration,
            [b.nbytes for b in self.buckets],
            [len(b.param_indices) for b in self.buckets],
            launch_times=[None] * len(self.buckets),
        )
        if self.find_unused:
            self._locally_used.zero_()
            reached = _reachable_params(outputs)
            for i, p in enumerate(self.params):
                if id(p) not in reached:
                    self._mark_ready(i, used=False)

    def _make_hook(self, index: int):
        def hook(param: torch.Tensor) -> None:
            if not self._expect_hooks:
                if self._finalized:  # a gradient arrived after this iteration was already reduced
                    self._raise_ready_twice(index)
                return  # inside no_sync(), or a forward whose backward is not synchronised
            if not self._callback_queued:
                self._callback_queued = True
                self._stats.backward_start = time.perf_counter()
                torch.autograd.Variable._execution_engine.queue_callback(self._finalize)
            self._mark_ready(index, used=True)

        return hook

    def _raise_ready_twice(self, i: int) -> None:
        raise RuntimeError(
            f"parameter {self.names[i]!r} was marked ready twice in one backward pass: its "
            "gradient hook fired again after its bucket was already counted. This happens with "
            "reentrant activation checkpointing (torch.utils.checkpoint(..., use_reentrant=True)) "
            "or when a parameter takes part in two backward passes of one forward. Use "
            "use_reentrant=False, or run the extra backward inside no_sync()."
        )

    def _mark_ready(self, i: int, used: bool) -> None:
        if self._ready[i]:
            self._raise_ready_twice(i)
        self._ready[i] = True
        self._ready_order.append(i)
        b_idx, pos = self._locate[i]
        bucket = self.buckets[b_idx]
        view = bucket.views[pos]
        grad = self.params[i].grad
        if used:
            self._locally_used[i] = 1
        # Without a comm hook the average is taken here, fused with the copy (one pass over the
        # gradient, as torch's reducer does); hooks get the raw sum and divide themselves.
        scale = 1.0 / self.world_size if self.comm_hook is None else None
        if self._direct_mode() and bucket.segments[pos] is None:  # a large gradient: reduced in place
            if used and self._owns_its_storage(grad, view):
                bucket.direct[pos] = grad.mul_(scale)
            else:  # no usable gradient: its slot in the flat buffer stands in (zeros or a copy)
                if grad is None:
                    view.zero_()
                else:
                    torch.mul(grad, scale, out=view)
                bucket.direct[pos] = view
        elif grad is None:
            view.zero_()
        elif grad.data_ptr() != view.data_ptr():
            if scale is None:
                view.copy_(grad)
            else:
                torch.mul(grad, scale, out=view)
            if self.as_view:
                self.params[i].grad = view
        elif scale is not None:
            view.mul_(scale)  # gradient_as_bucket_view: the gradient already lives in the bucket
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        # Strictly in bucket order: every rank must issue the same collectives in the same order.
        while self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].pending == 0:
            bucket = self.buckets[self._next_bucket]
            bucket.launched_at = time.perf_counter()
            if self._stats is not None:
                self._stats.launch_times[bucket.index] = bucket.launched_at
            if self.comm_hook is None and self._direct_mode():
                bucket.work = [
                    self.all_reduce_fn(self._segment_tensor(bucket, pos, seg))
                    for pos, seg in enumerate(bucket.segments)
                    if seg != "in-run"
                ]
            elif self.comm_hook is None:
                bucket.work = self.all_reduce_fn(bucket.buffer)  # already divided in _mark_ready
            else:
                is_last = self._next_bucket == len(self.buckets) - 1
                bucket.work = self.comm_hook(self.comm_hook_state, GradBucket(bucket, self.params, is_last, self.pg))
            self._next_bucket += 1

    def _finalize(self) -> None:
        """Runs once the autograd engine finished backward: wait, then write gradients back."""
        stats = self._stats
        stats.backward_end = time.perf_counter()
        self._expect_hooks = False
        self._finalized = True
        if self._next_bucket < len(self.buckets):
            for b in self.buckets[: self._next_bucket]:
                _wait(b.work)
            self._incomplete = [self.names[i] for i in range(len(self.params)) if not self._ready[i]]
            return
        used = None
        if self.find_unused:
            used = self._locally_used.to(self.pg.device, copy=True)
            self.pg.all_reduce(used, ReduceOp.SUM).wait()
            used = used.cpu()
        for b in self.buckets:
            result = _wait(b.work)
            if isinstance(result, torch.Tensor) and result.data_ptr() != b.buffer.data_ptr():
                b.buffer.copy_(result.view_as(b.buffer))
            for pos, i in enumerate(b.param_indices):
                if used is not None and int(used[i]) == 0:
                    continue  # unused on every rank: leave the gradient as it was (None stays None)
                p, view = self.params[i], b.views[pos]
                if pos in b.direct and b.direct[pos] is not view:
                    continue  # reduced in place: the gradient already holds the average
                if self.as_view:
                    if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                        p.grad = view
                elif p.grad is None:
                    p.grad = view.clone()
                else:
                    p.grad.copy_(view)
        stats.finalize_wait_s = time.perf_counter() - stats.backward_end
        stats.rebuilt_buckets = self.rebuilt
        self.last_stats = stats
        self.iteration += 1
        if not self.rebuilt:
            self._should_rebuild = True

    # -- join support -----------------------------------------------------------------------
    def shadow_iteration(self) -> None:
        """Issue the collectives of one synchronised backward with zero gradients (for join)."""
        for b in self.buckets:
            b.buffer.zero_()
            b.pending = 0
            b.direct = {pos: b.views[pos] for pos, seg in enumerate(b.segments) if seg is None}
        self._next_bucket = 0
        self._stats = None
        self._launch_ready_buckets()
        if self.find_unused:
            used = torch.zeros(len(self.params), dtype=torch.int32, device=self.pg.device)
            self.pg.all_reduce(used, ReduceOp.SUM).wait()
        for b in self.buckets:
            _wait(b.work)
        if not self.rebuilt:
            self._should_rebuild = True

    def _owns_its_storage(self, grad: torch.Tensor | None, view: torch.Tensor) -> bool:
        """Whether ``grad`` may be averaged and reduced in place: a dense, contiguous tensor of the
        bucket's dtype and device that is the whole of a storage no other gradient of this
        iteration uses (autograd may hand two parameters views of one tensor as gradients)."""
        if (
            grad is None
            or grad.layout != torch.strided
            or not grad.is_contiguous()
            or grad.dtype != view.dtype
            or grad.device != view.device
            or grad.storage_offset() != 0
        ):
            return False
        storage = grad.untyped_storage()
        if storage.nbytes() != grad.numel() * grad.element_size():
            return False
        # Autograd can give two parameters gradients that are views of one buffer (e.g. for
        # ``(p1.view(-1) + p2.view(-1)) * x``); then no gradient of it may change in place. Such
        # a storage has more than two users here: each gradient plus our ``storage`` handle.
        try:
            return torch._C._storage_Use_Count(storage._cdata) <= 2
        except AttributeError:  # a torch without the private counter: stay on the copying path
            return False

    def _direct_mode(self) -> bool:
        """Whether large gradients are reduced in place this iteration (see the module doc)."""
        return self.comm_hook is None and not self.as_view

    @staticmethod
    def _segment_tensor(bucket: Bucket, pos: int, seg) -> torch.Tensor:
        if seg is None:
            return bucket.direct[pos].view(-1)
        end = seg  # a run of small gradients: one contiguous slice of the flat buffer
        stop = bucket.offsets[end] + bucket.views[end].numel()
        return bucket.buffer[bucket.offsets[pos] : stop]

    def remove_hooks(self) -> None:
        for h in self._hook_handles:
            h.remove()
        self._hook_handles = []


def _segments(is_large: Sequence[bool]) -> list:
    """Per bucket position: None for a gradient reduced on its own; for the first of a run of
    consecutive small ones the position of the run's last one; "in-run" for the rest of the run."""
    out: list = []
    for pos, large in enumerate(is_large):
        if large:
            out.append(None)
        elif pos > 0 and not is_large[pos - 1]:
            out.append("in-run")
            start = max(p for p in range(pos) if out[p] != "in-run")
            out[start] = pos
        else:
            out.append(pos)
    return out


def _wait(work):
    """Wait for a Work or a Future (or a list of them); return the reduced tensor if a future
    produced one."""
    if isinstance(work, list):
        for w in work:
            _wait(w)
        return None
    if work is None:
        return None
    if isinstance(work, torch.futures.Future):
        value = work.wait()
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        return value
    work.wait()
    return None


def _reachable_params(outputs) -> set:
    """ids of the parameters whose AccumulateGrad node the autograd graph of ``outputs`` reaches."""
    roots = [t.grad_fn for t in _tensors_in(outputs) if t.grad_fn is not None]
    seen, reached, stack = set(), set(), roots
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        var = getattr(fn, "variable", None)
        if var is not None:
            reached.add(id(var))
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return reached


def _tensors_in(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors_in(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors_in(x)
