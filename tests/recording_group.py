"""A process group that watches DDP from outside: what it sends, and when.

``RecordingGroup(inner, watch=params)`` delegates every operation to ``inner`` (a real group)
and records, per ``all_reduce`` call, the dtype and size on the wire, how many of the watched
parameters still had ``grad is None`` (gradients autograd had yet to produce — zero the
gradients with ``set_to_none=True`` before backward), which watched parameter's gradient the
tensor *is* (reduced in place) if any, and every ``wait()`` on the returned work with the number
of gradients still missing at that moment. ``sends`` counts point-to-point sends (the ring).
Tests read these records, not the reducer's own bookkeeping.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ddptrain.comm.process_group import ProcessGroup
from ddptrain.comm.types import ReduceOp


@dataclass
class AllReduceCall:
    dtype: torch.dtype
    numel: int
    grads_missing: int  # watched parameters whose gradient autograd had not produced yet
    is_grad_of: int | None  # index (in ``watch``) of the parameter whose .grad this tensor is
    done_on_return: bool
    waits_with_grads_missing: list[int] = field(default_factory=list)  # per wait(): gradients still missing


class _WatchedWork:
    """The inner work, with ``wait()`` recorded."""

    def __init__(self, inner, on_wait):
        self._inner = inner
        self._on_wait = on_wait

    def wait(self, timeout=None):
        self._on_wait()
        return self._inner.wait(timeout)

    def __getattr__(self, name):
        return getattr(self._inner, name)


class RecordingGroup(ProcessGroup):
    """Delegates to ``inner``; ``all_reduces`` lists what went on the wire (see the module doc).

    Each hook (``_all_reduce``, ...) calls ``inner``'s public method, so both groups' ledgers
    record the collective, as for any group used through its public methods."""

    def __init__(self, inner: ProcessGroup, watch=()):
        super().__init__(inner.rank(), inner.size(), inner.global_ranks, inner.timeout, inner.name, inner.device)
        self.backend = inner.backend
        self.inner = inner
        self.watch = list(watch)
        self.all_reduces: list[AllReduceCall] = []
        self.sends = 0

    def grads_missing(self) -> int:
        return sum(p.grad is None for p in self.watch)

    def _grad_index(self, tensor: torch.Tensor) -> int | None:
        for i, p in enumerate(self.watch):
            grad = p.grad
            if grad is not None and grad.data_ptr() == tensor.data_ptr() and grad.numel() == tensor.numel():
                return i
        return None

    def _all_reduce(self, tensor, op=ReduceOp.SUM):
        missing, grad_index = self.grads_missing(), self._grad_index(tensor)
        work = self.inner.all_reduce(tensor, op)
        call = AllReduceCall(tensor.dtype, tensor.numel(), missing, grad_index, work.is_completed())
        self.all_reduces.append(call)
        return _WatchedWork(work, lambda: call.waits_with_grads_missing.append(self.grads_missing()))

    def _send(self, tensor, dst, tag=0):
        self.sends += 1
        return self.inner.send(tensor, dst, tag)

    def _recv(self, tensor, src, tag=0):
        return self.inner.recv(tensor, src, tag)

    def _broadcast(self, tensor, src):
        return self.inner.broadcast(tensor, src)

    def _reduce(self, tensor, dst, op=ReduceOp.SUM):
        return self.inner.reduce(tensor, dst, op)

    def _all_gather(self, tensor_list, tensor):
        return self.inner.all_gather(tensor_list, tensor)

    def _gather(self, tensor, gather_list, dst):
        return self.inner.gather(tensor, gather_list, dst)

    def _scatter(self, tensor, scatter_list, src):
        return self.inner.scatter(tensor, scatter_list, src)

    def _reduce_scatter(self, output, input_list, op=ReduceOp.SUM):
        return self.inner.reduce_scatter(output, input_list, op)

    def _all_to_all(self, output_list, input_list):
        return self.inner.all_to_all(output_list, input_list)

    def _barrier(self):
        return self.inner.barrier()

    def _new_subgroup(self, ranks, name, timeout):
        return self.inner.new_subgroup(ranks, name, timeout)
