"""N ranks as threads of one process: distributed code under test in milliseconds, not seconds.

:class:`ThreadedProcessGroup` implements the whole :class:`~ddptrain.comm.ProcessGroup`
interface — point-to-point, every collective and reduce op, async :class:`Work` handles with
futures, timeouts, subgroups — for ranks that are threads sharing one :class:`ThreadedWorld`.
Tensors are real; the bytes move by copies in memory. :func:`run_threaded` runs a function on N
such ranks, each thread with its own default group, so code that calls ``ddptrain.comm``'s
functional API, builds ``DistributedDataParallel`` or runs the ``Trainer`` works unchanged::

    def body(rank, world_size):
        t = torch.tensor([float(rank)])
        ddptrain.comm.all_reduce(t)
        return t.item()

    assert run_threaded(body, 4) == [6.0] * 4

Semantics follow the real backends, so tests mean what they say:

* A collective is asynchronous: the call hands in a snapshot of this rank's input and returns;
  the last rank to arrive combines all inputs (in rank order, deterministically) and writes every
  rank's outputs before their futures complete. Until then outputs must not be read.
* Ranks that call different collectives at the same position (other operation, op, root, shape
  or dtype) all fail with a :class:`~ddptrain.comm.CommError` listing each rank's call.
* A rank that never arrives makes its peers' ``wait()`` time out after the group's timeout with
  a :class:`~ddptrain.comm.CommTimeoutError` naming the missing ranks.
* When a rank raises, the world is aborted: its peers' pending and later operations fail with
  :class:`PeerFailedError`, and :func:`run_threaded` re-raises the first rank's own exception.

Process-wide state stays shared, unlike real ranks: torch's global RNG and thread count. Seed
with explicit generators, and avoid models whose result depends on the global RNG per rank
(dropout) unless the test allows for it. :func:`run_threaded` runs torch with one intra-op thread
(restored afterwards): the rank threads are the parallelism, and torch's pool on top of them only
contends (on a loaded 2-core machine a tiny run took 15 s instead of 0.3 s).
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from ..comm.api import thread_default_group
from ..comm.process_group import ProcessGroup, check_list_len, check_same_shape
from ..comm.types import (
    CommError,
    CompletedWork,
    FutureWork,
    ReduceOp,
    Work,
    as_timedelta,
    check_avg_dtype,
    fold_into,
    to_reduce_op,
)

__all__ = ["ThreadedProcessGroup", "ThreadedWorld", "PeerFailedError", "run_threaded"]


class PeerFailedError(CommError):
    """An operation could not complete because another rank of the threaded world failed."""


@dataclass
class _Call:
    """One rank's part in one collective: what must agree, its input snapshots, its outputs."""

    rank: int
    signature: tuple
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]
    future: torch.futures.Future = field(default_factory=torch.futures.Future)


def _describe(signature: tuple) -> str:
    op, *details = signature
    return f"{op}(" + ", ".join(str(d) for d in details) + ")"


class ThreadedWorld:
    """What the ranks of one group share: arrivals per collective, mailboxes, the abort flag.

    Args:
        size: number of ranks.
        timeout: default timeout of every operation (seconds or timedelta).
        global_ranks: the global rank of each member (a subgroup's are a subset of the world's).
        name: the group's name, shown in errors.
    """

    def __init__(self, size: int, timeout: Any = 30.0, global_ranks: Sequence[int] | None = None, name: str = "world"):
        if size < 1:
            raise ValueError(f"a threaded world needs at least 1 rank, got {size}")
        self.size = size
        self.timeout = as_timedelta(timeout)
        self.global_ranks = list(range(size)) if global_ranks is None else list(global_ranks)
        self.name = name
        self._lock = threading.Lock()
        self._arrivals: dict[int, dict[int, _Call]] = {}
        self._mail: dict[tuple[int, int, int], deque] = {}
        self._receivers: dict[tuple[int, int, int], deque] = {}
        self._subworlds: dict[str, ThreadedWorld] = {}
        self._aborted: str | None = None

    # -- collectives ------------------------------------------------------------------------
    def arrive(self, seq: int, call: _Call, combine: Callable[[dict[int, _Call]], None]) -> None:
        """Hand in ``call`` for collective ``seq``; the last rank to arrive completes everyone."""
        with self._lock:
            if self._aborted is not None:
                call.future.set_exception(PeerFailedError(self._aborted))
                return
            calls = self._arrivals.setdefault(seq, {})
            calls[call.rank] = call
            if len(calls) < self.size:
                return
            del self._arrivals[seq]
        self._complete(seq, calls, combine)

    def _complete(self, seq: int, calls: dict[int, _Call], combine) -> None:
        signatures = {c.signature for c in calls.values()}
        error: BaseException | None = None
        if len(signatures) > 1:
            lines = [f"  rank {self.global_ranks[r]}: {_describe(calls[r].signature)}" for r in sorted(calls)]
            error = CommError(
                f"collective #{seq} of group {self.name!r}: the ranks called mismatched collectives; every rank "
                "must call the same operation with the same op/root and tensors of the same shape and dtype:\n"
                + "\n".join(lines)
            )
        else:
            try:
                combine(calls)
            except Exception as exc:  # noqa: BLE001 - every rank's work must fail, not one thread
                error = exc
        for call in calls.values():
            if error is None:
                call.future.set_result(call.outputs)
            else:
                call.future.set_exception(error)

    def missing(self, seq: int, op_name: str) -> str:
        """A sentence naming the ranks that have not reached collective ``seq`` (for timeouts)."""
        with self._lock:
            arrived = set(self._arrivals.get(seq, {}))
        absent = [self.global_ranks[r] for r in range(self.size) if r not in arrived]
        if not absent:
            return ""
        return f" Rank(s) {absent} never arrived at this {op_name} (collective #{seq} of the group)."

    # -- point to point ---------------------------------------------------------------------
    def post_send(self, src: int, dst: int, tag: int, tensor: torch.Tensor) -> None:
        """Deliver a copy of ``tensor`` to a waiting receive, or keep it until one comes."""
        key = (src, dst, tag)
        with self._lock:
            if self._aborted is not None:
                raise PeerFailedError(self._aborted)
            waiting = self._receivers.get(key)
            if waiting:
                target, future = waiting.popleft()
            else:
                self._mail.setdefault(key, deque()).append(tensor.detach().clone())
                return
        _deliver(target, tensor, future)

    def post_recv(self, src: int, dst: int, tag: int, target: torch.Tensor, future: torch.futures.Future) -> None:
        """Fill ``target`` from the oldest matching message, now or when it is sent."""
        key = (src, dst, tag)
        with self._lock:
            if self._aborted is not None:
                future.set_exception(PeerFailedError(self._aborted))
                return
            queued = self._mail.get(key)
            if not queued:
                self._receivers.setdefault(key, deque()).append((target, future))
                return
            message = queued.popleft()
        _deliver(target, message, future)

    # -- groups and failure -----------------------------------------------------------------
    def subworld(self, ranks: Sequence[int], name: str, timeout: timedelta) -> ThreadedWorld:
        """The shared world of a subgroup (made by the first member to ask)."""
        with self._lock:
            sub = self._subworlds.get(name)
            if sub is None:
                sub = ThreadedWorld(len(ranks), timeout, [self.global_ranks[r] for r in ranks], name)
                if self._aborted is not None:
                    sub._aborted = self._aborted
                self._subworlds[name] = sub
        return sub

    def abort(self, reason: str) -> None:
        """Fail every pending and later operation of this world and its subgroups with ``reason``."""
        with self._lock:
            if self._aborted is not None:
                return
            self._aborted = reason
            pending = [c.future for calls in self._arrivals.values() for c in calls.values()]
            pending += [f for waiting in self._receivers.values() for _, f in waiting]
            self._arrivals.clear()
            self._receivers.clear()
            subs = list(self._subworlds.values())
        for future in pending:
            if not future.done():
                future.set_exception(PeerFailedError(reason))
        for sub in subs:
            sub.abort(reason)


def _deliver(target: torch.Tensor, message: torch.Tensor, future: torch.futures.Future) -> None:
    if target.numel() != message.numel():
        future.set_exception(
            CommError(f"recv: the message has {message.numel()} elements but the buffer {target.numel()}")
        )
        return
    target.copy_(message.view_as(target))
    future.set_result([target])


def _signature(op: str, *details: Any, tensors: Sequence[torch.Tensor] = ()) -> tuple:
    return (op, *details, *(f"shape {tuple(t.shape)} {str(t.dtype).replace('torch.', '')}" for t in tensors))


def _reduced(op: ReduceOp, tensors: Sequence[torch.Tensor], size: int) -> torch.Tensor:
    """``op`` over ``tensors`` in rank order (AVG divides the sum by ``size``)."""
    acc = tensors[0].clone()
    for t in tensors[1:]:
        fold_into(op, acc, t)
    if op is ReduceOp.AVG:
        acc.div_(size)
    return acc


class ThreadedProcessGroup(ProcessGroup):
    """One rank's handle on a :class:`ThreadedWorld` (each rank thread makes its own).

    Args:
        world: the world the ranks share.
        rank: this rank, ``0 <= rank < world.size``.
        device: where the group's tensors live (``ProcessGroup.device``).
    """

    backend = "threaded"

    def __init__(self, world: ThreadedWorld, rank: int, device: torch.device | str = "cpu"):
        if not 0 <= rank < world.size:
            raise ValueError(f"rank {rank} is outside the threaded world of size {world.size}")
        super().__init__(rank, world.size, world.global_ranks, world.timeout, world.name, device)
        self.world = world
        self._seq = 0

    def _collective(self, signature: tuple, inputs, outputs, combine) -> Work:
        op_name = signature[0]
        self.check_alive(op_name)
        self._seq += 1
        seq = self._seq
        call = _Call(self._rank, signature, [t.detach().clone() for t in inputs], list(outputs))
        work = FutureWork(
            op_name,
            list(outputs),
            call.future,
            self.timeout,
            describe=f"(collective #{seq} of group {self.name!r}) ",
            explain_timeout=lambda: self.world.missing(seq, op_name),
        )
        self.world.arrive(seq, call, combine)
        return work

    # -- point to point ---------------------------------------------------------------------
    def _send(self, tensor, dst, tag=0):
        self._check_peer(dst, "send", "dst")
        self.check_alive("send")
        self.world.post_send(self._rank, dst, tag, tensor)
        return CompletedWork("send", [tensor])  # buffered, as gloo's small sends

    def _recv(self, tensor, src, tag=0):
        self._check_peer(src, "recv", "src")
        self.check_alive("recv")
        future: torch.futures.Future = torch.futures.Future()
        self.world.post_recv(src, self._rank, tag, tensor, future)
        return FutureWork("recv", [tensor], future, self.timeout, describe=f"from rank {self.global_ranks[src]} ")

    # -- collectives ------------------------------------------------------------------------
    def _broadcast(self, tensor, src):
        self._check_peer(src, "broadcast", "src")

        def combine(calls):
            for call in calls.values():
                call.outputs[0].copy_(calls[src].inputs[0])

        return self._collective(_signature("broadcast", f"src={src}", tensors=[tensor]), [tensor], [tensor], combine)

    def _all_reduce(self, tensor, op=ReduceOp.SUM):
        op = to_reduce_op(op)
        check_avg_dtype(op, tensor, "all_reduce")

        def combine(calls):
            result = _reduced(op, [calls[r].inputs[0] for r in sorted(calls)], self._size)
            for call in calls.values():
                call.outputs[0].copy_(result)

        return self._collective(_signature("all_reduce", op.name, tensors=[tensor]), [tensor], [tensor], combine)

    def _reduce(self, tensor, dst, op=ReduceOp.SUM):
        self._check_peer(dst, "reduce", "dst")
        op = to_reduce_op(op)
        check_avg_dtype(op, tensor, "reduce")

        def combine(calls):
            calls[dst].outputs[0].copy_(_reduced(op, [calls[r].inputs[0] for r in sorted(calls)], self._size))

        outputs = [tensor] if self._rank == dst else []
        return self._collective(
            _signature("reduce", op.name, f"dst={dst}", tensors=[tensor]), [tensor], outputs, combine
        )

    def _all_gather(self, tensor_list, tensor):
        check_list_len("all_gather", "tensor_list", tensor_list, self._size)
        check_same_shape("all_gather", "tensor_list", tensor, tensor_list)

        def combine(calls):
            for call in calls.values():
                for r, out in enumerate(call.outputs):
                    out.copy_(calls[r].inputs[0])

        return self._collective(_signature("all_gather", tensors=[tensor]), [tensor], tensor_list, combine)

    def _gather(self, tensor, gather_list, dst):
        self._check_peer(dst, "gather", "dst")
        if self._rank == dst:
            check_list_len("gather", "gather_list", gather_list, self._size)
            check_same_shape("gather", "gather_list", tensor, gather_list)

        def combine(calls):
            for r, out in enumerate(calls[dst].outputs):
                out.copy_(calls[r].inputs[0])

        outputs = list(gather_list) if self._rank == dst else []
        return self._collective(_signature("gather", f"dst={dst}", tensors=[tensor]), [tensor], outputs, combine)

    def _scatter(self, tensor, scatter_list, src):
        self._check_peer(src, "scatter", "src")
        if self._rank == src:
            check_list_len("scatter", "scatter_list", scatter_list, self._size)
            check_same_shape("scatter", "scatter_list", tensor, scatter_list)

        def combine(calls):
            for r, call in calls.items():
                call.outputs[0].copy_(calls[src].inputs[r])

        inputs = list(scatter_list) if self._rank == src else []
        return self._collective(_signature("scatter", f"src={src}", tensors=[tensor]), inputs, [tensor], combine)

    def _reduce_scatter(self, output, input_list, op=ReduceOp.SUM):
        check_list_len("reduce_scatter", "input_list", input_list, self._size)
        check_same_shape("reduce_scatter", "input_list", output, input_list)
        op = to_reduce_op(op)
        check_avg_dtype(op, output, "reduce_scatter")

        def combine(calls):
            for r, call in calls.items():
                call.outputs[0].copy_(_reduced(op, [calls[q].inputs[r] for q in sorted(calls)], self._size))

        signature = _signature("reduce_scatter", op.name, tensors=[output])
        return self._collective(signature, input_list, [output], combine)

    def _all_to_all(self, output_list, input_list):
        check_list_len("all_to_all", "output_list", output_list, self._size)
        check_list_len("all_to_all", "input_list", input_list, self._size)
        dtype = input_list[0].dtype
        if any(t.dtype != dtype for t in list(input_list) + list(output_list)):
            raise ValueError("all_to_all: every input and output tensor must have the same dtype")

        def combine(calls):
            for r, call in calls.items():
                for q, out in enumerate(call.outputs):
                    incoming = calls[q].inputs[r]
                    if incoming.numel() != out.numel():
                        raise CommError(
                            f"all_to_all: rank {self.global_ranks[q]} sends {incoming.numel()} elements to rank "
                            f"{self.global_ranks[r]}, which expects {out.numel()}"
                        )
                    out.copy_(incoming.view_as(out))

        signature = _signature("all_to_all", str(dtype).replace("torch.", ""))
        return self._collective(signature, input_list, output_list, combine)

    def _barrier(self):
        return self._collective(("barrier",), [], [], lambda calls: None)

    # -- groups -----------------------------------------------------------------------------
    def _new_subgroup(self, ranks, name, timeout):
        if self._rank not in ranks:
            return None
        sub = self.world.subworld(ranks, name, timeout)
        return ThreadedProcessGroup(sub, list(ranks).index(self._rank), self.device)


def run_threaded(
    fn: Callable,
    world_size: int,
    *args: Any,
    timeout_s: float = 60.0,
    comm_timeout_s: float | None = None,
    device: torch.device | str = "cpu",
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks that are threads.

    Each thread gets its own :class:`ThreadedProcessGroup` as its default group (the functional
    API, ``DistributedDataParallel`` and the ``Trainer`` find it without ``init_process_group``).

    Args:
        timeout_s: limit for the whole run; past it the ranks' operations are failed and
            ``LaunchTimeoutError`` says where each unfinished rank was.
        comm_timeout_s: timeout of each operation (default: three quarters of ``timeout_s``),
            so a collective a peer never calls fails with the missing rank named.
        device: the groups' ``device``.

    Returns:
        ``fn``'s return values, indexed by rank.

    Raises:
        The first failing rank's own exception (with a note naming the rank); peers that failed
        only because of it (:class:`PeerFailedError`) are not reported.
    """
    world = ThreadedWorld(world_size, comm_timeout_s or max(1.0, 0.75 * timeout_s))
    results: list[Any] = [None] * world_size
    failures: list[tuple[int, BaseException]] = []
    lock = threading.Lock()

    def rank_main(rank: int) -> None:
        try:
            with thread_default_group(ThreadedProcessGroup(world, rank, device)):
                results[rank] = fn(rank, world_size, *args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - reported by the caller's thread
            with lock:
                failures.append((rank, exc))
            world.abort(f"rank {rank} failed with {type(exc).__name__}: {exc}")

    threads = [
        threading.Thread(target=rank_main, args=(r,), name=f"ddptrain-rank{r}", daemon=True) for r in range(world_size)
    ]
    intra_op_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + timeout_s
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        _raise_if_stuck(threads, world, timeout_s)
    finally:
        torch.set_num_threads(intra_op_threads)
    if failures:
        rank, exc = next(((r, e) for r, e in failures if not isinstance(e, PeerFailedError)), failures[0])
        if hasattr(exc, "add_note"):
            exc.add_note(f"(raised on rank {rank} of {world_size}, ddptrain.testing.run_threaded)")
        raise exc
    return results


def _raise_if_stuck(threads: list[threading.Thread], world: ThreadedWorld, timeout_s: float) -> None:
    stuck = [r for r, t in enumerate(threads) if t.is_alive()]
    if not stuck:
        return
    frames = sys._current_frames()
    where = "\n".join(
        f"--- rank {r} ---\n" + "".join(traceback.format_stack(frames[threads[r].ident])[-6:])
        for r in stuck
        if threads[r].ident in frames
    )
    world.abort(f"run_threaded timed out after {timeout_s:g} s")
    for r in stuck:
        threads[r].join(2.0)
    from ..launch import LaunchTimeoutError

    raise LaunchTimeoutError(
        f"run_threaded: rank(s) {stuck} did not finish within {timeout_s:g} s; their operations were failed. "
        f"Where they were:\n{where}"
    )
