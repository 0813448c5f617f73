"""The ``mpi`` backend, through mpi4py (PyTorch's wheels ship without their own MPI backend).

As in PyTorch's ProcessGroupMPI, every MPI call runs on one communication thread fed by a queue:
callers get a :class:`FutureWork` at once and the thread completes it. Collectives are posted in
the order they were queued — the same order on every rank, which MPI requires. Every operation is
posted non-blocking (``Isend``/``Irecv``, ``Iallreduce``, ``Ibcast``, ... ``Ibarrier``, MPI-3) and
completed while the thread polls, so a rank may send and receive at once (the ring all-reduce does)
without deadlock, and a collective that a peer never joins times out for its caller without
wedging the thread: later operations on other groups still run.

CPU tensors are handed to MPI as zero-copy NumPy views. CUDA tensors, and half-precision tensors
for reductions (MPI has no float16/bfloat16 arithmetic), are staged through a float32/host copy.
CUDA tensors go through *pinned* host buffers, with the stream rules of torch's own backends
(:class:`_Staging`): the caller's thread never blocks on the GPU; the copies run on the stream that
was current when the operation was called (its *launch stream*); the operation's future is
CUDA-aware, so ``wait()`` makes the waiting stream wait for the copy back, and a ``then()`` callback
(a DDP comm hook) runs after it.
Ranks and size come from the MPI launcher (``mpirun``/``mpiexec``); a configured world size that
differs is refused.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NamedTuple

import mpi4py  # noqa: F401 - absent mpi4py fails this module's import (backends._mpi explains it)
import torch

from ... import envvars
from ..forensics import explain_group
from ..process_group import ProcessGroup, check_list_len, check_same_shape
from ..types import CommError, FutureWork, ReduceOp, RendezvousError, Work, check_avg_dtype, to_reduce_op

# ``mpi4py.MPI``: importing it initialises MPI, so :func:`_init_mpi` imports it when the world group
# is made, after the MCA defaults below are in the environment. Every use of ``MPI`` in this module
# runs on or after that call.
MPI: Any = None

# Open MPI MCA defaults, set by :func:`_init_mpi` only where the environment has no value (a
# user's own setting wins). MCA parameters are read when MPI initialises, so a program that
# initialised MPI before making the group keeps its own settings.
# - coll_libnbc_iallreduce_algorithm=1 (ring): by default Open MPI's non-blocking all-reduce
#   (coll/libnbc) picks algorithms 3-5x slower than its blocking one for the 1-25 MiB buffers DDP
#   sends over shared memory (scripts/bench_comm.py --backend mpi); the ring matches the blocking one.
_MCA_DEFAULTS = {"OMPI_MCA_coll_libnbc_iallreduce_algorithm": "1"}

# Tags of the timeout probe, on each group's private control communicator (never the user's).
_PROBE_QUERY, _PROBE_REPLY = 1, 2
_PROBE_WAIT_S = 2.0
# How often an idle communication thread wakes to answer its peers' timeout probes.
_IDLE_WAKE_S = 0.05
# While requests are in flight the thread tests them, sleeping between rounds: 0.1 ms after any
# progress, doubling up to 1 ms while nothing completes. Open MPI only advances a non-blocking
# collective inside such calls, so the sleep bounds its latency; but on a rank whose cores are
# busy with backward, every wake-up is taken from compute (a fixed 0.2 ms cost ~8% of the 18M
# MLP's step time on 2 cores, measured with scripts/bench_ddp.py --backend mpi).
# Bounds: DDPTRAIN_MPI_POLL_MIN_S and DDPTRAIN_MPI_POLL_MAX_S (ddptrain.envvars), read when the thread starts.
# While a caller blocks on a result the thread polls without sleeping, but only for the first
# _EAGER_POLL_S of each wait: a collective that takes longer is waiting for a peer (one still in
# backward, evaluating, saving a checkpoint), and spinning then takes a core from that peer on a
# host with more ranks than cores (3 s of waiting cost 2.4 s of CPU). Past it the sleeps above
# apply, so a late peer's collective completes at most DDPTRAIN_MPI_POLL_MAX_S after it arrives.
_EAGER_POLL_S = 0.05

# The ``MPI.Op`` (by attribute name) of each reduction; AVG is a SUM divided afterwards.
_MPI_OP_NAMES = {
    ReduceOp.SUM: "SUM",
    ReduceOp.AVG: "SUM",
    ReduceOp.PRODUCT: "PROD",
    ReduceOp.MAX: "MAX",
    ReduceOp.MIN: "MIN",
}


def _init_mpi() -> None:
    """Set the MCA defaults a user has not set, then import ``mpi4py.MPI`` (initialising MPI)."""
    global MPI
    if MPI is None:
        for name, value in _MCA_DEFAULTS.items():
            os.environ.setdefault(name, value)
        from mpi4py import MPI as mpi

        MPI = mpi


def _mpi_op(op: ReduceOp):
    return getattr(MPI, _MPI_OP_NAMES[op])


class _Job(NamedTuple):
    """One item of the communication thread's queue."""

    fn: Callable[[], object]
    """Run on the thread: returns a :class:`_Posted` for a posted request, anything else when done
    at once. Its closure holds the buffers MPI reads and writes."""
    future: torch.futures.Future
    """Completed with ``outputs`` (or the failure) when the job is done."""
    outputs: object
    """The future's result: the tensors the operation writes."""
    stream: Any = None
    """CUDA: the operation's launch stream (:class:`_Staging`), current on the thread while the job
    completes (its copies back, its future's result), so that they are ordered after its launch."""


class _Posted(NamedTuple):
    """What a job's ``fn`` returns when it posted non-blocking request(s)."""

    request: Any
    """An ``MPI.Request`` or an :class:`_AllOf`; the job is done when its ``Test()`` is true."""
    on_done: Callable[[], None] | None
    """Run on the thread once the request completes, before the future (copy back, AVG's division)."""


class _Pending(NamedTuple):
    """A posted job whose request is still in flight."""

    request: Any
    """The job's :attr:`_Posted.request`."""
    future: torch.futures.Future
    """The job's future."""
    on_done: Callable[[], None] | None
    """The job's :attr:`_Posted.on_done`."""
    outputs: object
    """The future's result."""
    job_fn: Callable[[], object]
    """The job's ``fn``, kept so that the buffers its closure holds outlive the request (an input
    the caller did not keep, e.g. ``all_gather(out, make_tensor(), async_op=True)``)."""
    stream: Any = None
    """The job's :attr:`_Job.stream`."""


class _Reply(NamedTuple):
    """This rank's answer to a peer's timeout probe, in flight."""

    request: Any
    """The ``Isend`` of the answer."""
    buffer: Any
    """The NumPy array sent; kept until the send completes."""


class _ProbedGroup(NamedTuple):
    """A group whose peers' timeout probes this thread answers."""

    control: Any
    """The group's private control communicator, where probes arrive."""
    group: MPIProcessGroup
    """The group; its ``collectives_called`` is the answer."""


class _AllOf:
    """Several requests completed as one (a job that posts more than one message)."""

    def __init__(self, requests):
        self.requests = requests

    def Test(self) -> bool:  # noqa: N802 - the name of MPI.Request's method
        return MPI.Request.Testall(self.requests)


class _CommThread:
    """One thread that owns every MPI call of this process.

    Besides running the queued jobs it answers its peers' timeout probes: a rank whose collective
    timed out asks every peer, over the group's control communicator, how many collectives of the
    group it has called; the answers tell which ranks never arrived.
    """

    def __init__(self):
        # A _Job; () only wakes the loop (cuts its sleep short); None ends it.
        self._queue: queue.Queue[_Job | tuple[()] | None] = queue.Queue()
        self._pending: list[_Pending] = []
        self._groups: dict[int, _ProbedGroup] = {}  # by id(group)
        self._waiters, self._waiters_lock = 0, threading.Lock()
        self._wait_began = 0.0  # time.monotonic() of the latest waiting(+1)
        self._replies: list[_Reply] = []
        self._thread = threading.Thread(target=self._loop, name="ddptrain-mpi", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], object], outputs, stream=None) -> torch.futures.Future:
        """Queue ``fn``; the future completes with ``outputs``. ``stream``: the CUDA launch stream of
        an operation on CUDA tensors (then the future is CUDA-aware: see :class:`_Staging`)."""
        fut: torch.futures.Future = (
            torch.futures.Future() if stream is None else torch.futures.Future(devices=[stream.device])
        )
        self._queue.put(_Job(fn, fut, outputs, stream))
        return fut

    def waiting(self, delta: int) -> None:
        """A caller starts (+1) or stops (-1) blocking on a result. While anyone blocks, nothing
        on this rank computes that polling could slow down: the loop polls without sleeping for
        the first _EAGER_POLL_S of the wait."""
        with self._waiters_lock:
            self._waiters += delta
            if delta > 0:
                self._wait_began = time.monotonic()
        if delta > 0:
            self._queue.put(())  # cut the current sleep short

    def _loop(self) -> None:
        poll_min_s = envvars.get_float("DDPTRAIN_MPI_POLL_MIN_S")
        poll_max_s = envvars.get_float("DDPTRAIN_MPI_POLL_MAX_S")
        sleep = poll_min_s
        while True:
            try:
                if self._pending and self._waiters and time.monotonic() - self._wait_began < _EAGER_POLL_S:
                    item = self._queue.get_nowait()
                else:
                    item = self._queue.get(timeout=sleep if self._pending else _IDLE_WAKE_S)
            except queue.Empty:
                item = ()
            if item is None:
                return
            started = bool(item)
            if started:
                self._start(*item)
            # Invariant: the loop holds no reference to a job's buffers (see _start) when _poll may
            # complete it: once the waiter is done with them they are freed, not kept until this
            # thread next gets a core.
            item = None
            progressed = self._poll() or started
            sleep = poll_min_s if progressed else min(2 * sleep, poll_max_s)
            self._answer_probes()

    def _start(self, fn, fut, outputs, stream) -> None:
        """Run one queued job: post its request(s), or complete it at once.

        A method of its own so that nothing of the job outlives it in the loop's locals: a stale
        reference to a finished request would keep its tensors' memory alive."""
        try:
            result = fn()
            if isinstance(result, _Posted):
                self._pending.append(_Pending(result.request, fut, result.on_done, outputs, fn, stream))
            else:
                with _on_stream(stream):
                    fut.set_result(outputs)
        except BaseException as exc:  # noqa: BLE001 - hand every failure to the waiter
            fut.set_exception(exc)

    def stop(self, timeout_s: float = 2.0) -> None:
        """End the loop (requests still in flight are abandoned) so no MPI call overlaps finalize."""
        self._queue.put(None)
        self._thread.join(timeout_s)

    def register(self, group: MPIProcessGroup, control) -> None:
        """Answer probes about ``group`` arriving on ``control`` (called on this thread)."""
        self._groups[id(group)] = _ProbedGroup(control, group)

    def unregister(self, group: MPIProcessGroup) -> None:
        self._groups.pop(id(group), None)

    def _answer_probes(self) -> None:
        status = MPI.Status()
        for control, group in list(self._groups.values()):
            while control.Iprobe(source=MPI.ANY_SOURCE, tag=_PROBE_QUERY, status=status):
                asker = status.Get_source()
                control.Recv(torch.empty(1, dtype=torch.int64).numpy(), source=asker, tag=_PROBE_QUERY)
                answer = torch.tensor([group.collectives_called], dtype=torch.int64).numpy()
                self._replies.append(_Reply(control.Isend(answer, dest=asker, tag=_PROBE_REPLY), answer))
        self._replies = [reply for reply in self._replies if not reply.request.Test()]

    def _poll(self) -> bool:
        """Test the requests in flight and complete the finished ones; True if any finished.

        A finished job leaves ``_pending`` (and with it the buffers its ``fn`` holds) before its
        waiter is woken: what the waiter frees afterwards is freed at once."""
        still, finished = [], []
        for entry in self._pending:
            outcome = self._test(*entry)
            if outcome is None:
                still.append(entry)
            else:
                finished.append(outcome)
        self._pending, entry = still, None
        for fut, outputs, error, stream in finished:
            if error is None:
                with _on_stream(stream):  # a CUDA-aware future records its event on the launch stream
                    fut.set_result(outputs)
            else:
                fut.set_exception(error)
        return bool(finished)

    @staticmethod
    def _test(req, fut, on_done, outputs, _job_fn, stream):
        """``(future, outputs, error, stream)`` for a finished request, None while it runs (its
        locals, the job's buffers among them, die with this call; see _start)."""
        try:
            if not req.Test():
                return None
            if on_done is not None:
                with _on_stream(stream):  # copies back: on the launch stream (_Staging)
                    on_done()
            return fut, outputs, None, stream
        except BaseException as exc:  # noqa: BLE001 - hand every failure to the waiter
            return fut, outputs, exc, stream


_thread: _CommThread | None = None


def _comm_thread() -> _CommThread:
    global _thread
    if _thread is None:
        _thread = _CommThread()
        # Stop it before mpi4py finalises MPI at exit (atexit runs handlers in reverse order of
        # registration, and mpi4py registered its own when it was imported, before this one).
        atexit.register(_thread.stop)
    return _thread


def _on_stream(stream):
    """``torch.cuda.stream(stream)`` for a CUDA launch stream; nothing for None (CPU tensors)."""
    return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)


class _Staging:
    """The host side of one operation: the host copies MPI reads and writes, and how they reach
    the operation's CUDA tensors without blocking the caller (module doc).

    Made on the caller's thread. CUDA inputs are copied into pinned host buffers with non-blocking
    copies on the launch stream (the caller's current stream), and an event is recorded after them;
    the communication thread waits for those events (:meth:`ready`) before MPI reads the buffers.
    Results are copied back (by the job's ``on_done``, which the thread runs on the launch stream)
    with non-blocking copies too. torch's pinned-memory allocator keeps a buffer from being reused
    until the copies queued on it have run, so a buffer the job drops is safe to free."""

    def __init__(self, *tensors: torch.Tensor):
        cuda = next((t.device for t in tensors if t is not None and t.is_cuda), None)
        self.stream = None if cuda is None else torch.cuda.current_stream(cuda)
        self._events: list[Any] = []

    def host(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A contiguous host tensor with ``t``'s values (in ``dtype``): a copy, queued on the launch
        stream for a CUDA tensor (:meth:`ready` waits for it), or made now for a CPU one."""
        dtype = dtype or t.dtype
        if not t.is_cuda:
            return t.detach().to("cpu", dtype).contiguous()
        host = torch.empty(t.shape, dtype=dtype, pin_memory=True)
        host.copy_(t.detach(), non_blocking=True)
        event = torch.cuda.Event()
        event.record(self.stream)
        self._events.append(event)
        return host

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A host tensor MPI writes (pinned when the operation's tensors are on CUDA)."""
        return torch.empty(shape, dtype=dtype, pin_memory=self.stream is not None)

    def ready(self) -> None:
        """On the communication thread, before MPI reads: wait for the copies to the host."""
        for event in self._events:
            event.synchronize()

    def staged(self, t: torch.Tensor, for_reduce: bool):
        """(buffer MPI can use, function copying the result back into ``t``, or None): ``t``'s own
        memory when MPI can use it (a contiguous CPU tensor, not bfloat16, not float16 in a
        reduction: MPI has no arithmetic for them), else a host copy in float32 or ``t``'s dtype."""
        needs_float = for_reduce and t.dtype in (torch.float16, torch.bfloat16)
        if not t.is_cuda and t.is_contiguous() and not needs_float and t.dtype != torch.bfloat16:
            return t.detach().numpy(), None
        host = self.host(t, torch.float32 if (needs_float or t.dtype == torch.bfloat16) else t.dtype)
        return host.numpy(), (lambda: t.copy_(host, non_blocking=t.is_cuda))


class _MPIWork(FutureWork):
    """A work whose ``wait`` tells the communication thread to poll eagerly meanwhile (at the end
    of DDP's backward the last bucket's latency is all that is left)."""

    def __init__(self, thread: _CommThread, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._comm_thread = thread

    def _wait(self, timeout):
        if self.is_completed():
            return super()._wait(timeout)
        self._comm_thread.waiting(+1)
        try:
            return super()._wait(timeout)
        finally:
            self._comm_thread.waiting(-1)


class MPIProcessGroup(ProcessGroup):
    """A ddptrain group over an MPI communicator."""

    backend = "mpi"

    def __init__(self, comm, global_ranks, timeout: timedelta, name: str = "world"):
        super().__init__(comm.Get_rank(), comm.Get_size(), global_ranks, timeout, name)
        self.comm = comm
        self.collectives_called = 0  # what this rank answers to a peer's timeout probe
        self._thread = _comm_thread()
        self._control = None

        def make_control():  # collective over the group: queued, so every member does it in order
            # A blocking Dup: Open MPI 5's Idup beside other non-blocking collectives on the same
            # communicator can fail with MPI_ERR_TRUNCATE.
            self._control = comm.Dup()
            self._thread.register(self, self._control)

        self._thread.submit(make_control, [])

    def _run(self, op_name: str, outputs, fn, staging: _Staging | None = None) -> Work:
        """Queue ``fn`` on the communication thread; ``staging``: the operation's host copies, whose
        CUDA ones it waits for before ``fn`` posts anything."""
        self.check_alive(op_name)
        explain = None
        if op_name not in ("send", "recv"):
            self.collectives_called += 1
            seq = self.collectives_called
            explain = lambda: self._missing_ranks(op_name, seq) + explain_group(self)  # noqa: E731
        stream = None if staging is None else staging.stream
        if stream is not None:
            post = fn

            def fn():
                staging.ready()
                return post()

        fut = self._thread.submit(fn, outputs, stream)
        return _MPIWork(
            self._thread,
            op_name,
            outputs,
            fut,
            self.timeout,
            explain_timeout=explain,
            explain_failure=lambda: explain_group(self),
            describe=f"on group {self.name!r} (mpi, rank {self._rank} of {self._size}) ",
        )

    def _missing_ranks(self, op: str, seq: int) -> str:
        """Ask every peer how many collectives of this group it has called: those below ``seq``
        never arrived at this one; those that do not answer within a few seconds are dead or
        wedged. '' if nothing can be told."""
        peers = [r for r in range(self._size) if r != self._rank]
        if not peers or self._control is None:
            return ""
        query = torch.tensor([seq], dtype=torch.int64).numpy()
        answers = {r: torch.full((1,), -1, dtype=torch.int64).numpy() for r in peers}

        posted = threading.Event()

        def post():
            if id(self) not in self._thread._groups:  # the control communicator is not ready yet
                return None
            posted.set()
            reqs = []
            for r in peers:
                reqs.append(self._control.Isend(query, dest=r, tag=_PROBE_QUERY))
                reqs.append(self._control.Irecv(answers[r], source=r, tag=_PROBE_REPLY))
            return _Posted(_AllOf(reqs), None)  # this job (kept until done) holds query and answers

        done = threading.Event()
        self._thread.submit(post, []).add_done_callback(lambda _f: done.set())
        done.wait(min(_PROBE_WAIT_S, self.timeout.total_seconds()))
        if not posted.is_set():
            return (
                " This rank's MPI communication thread is itself blocked (creating a group), so "
                "the peers could not be asked which of them are missing."
            )
        behind = [self.global_ranks[r] for r in peers if 0 <= int(answers[r][0]) < seq]
        silent = [self.global_ranks[r] for r in peers if int(answers[r][0]) < 0]
        parts = []
        if behind:
            parts.append(f" Rank(s) {behind} never arrived at this {op} (collective #{seq} of the group).")
        if silent:
            parts.append(
                f" Rank(s) {silent} did not answer within {_PROBE_WAIT_S:g} s (dead, or stuck outside "
                "ddptrain's communication thread)."
            )
        if not parts:
            parts.append(" Every rank reached this collective; it may have called it with different arguments.")
        return "".join(parts)

    # -- point to point ---------------------------------------------------------------------
    def _send(self, tensor, dst, tag=0):
        self._check_peer(dst, "send", "dst")
        staging = _Staging(tensor)
        buf, _ = staging.staged(tensor, False)
        return self._run("send", [tensor], lambda: _Posted(self.comm.Isend(buf, dest=dst, tag=tag), None), staging)

    def _recv(self, tensor, src, tag=0):
        self._check_peer(src, "recv", "src")
        staging = _Staging(tensor)
        buf, back = staging.staged(tensor, False)
        return self._run("recv", [tensor], lambda: _Posted(self.comm.Irecv(buf, source=src, tag=tag), back), staging)

    # -- collectives ------------------------------------------------------------------------
    def _broadcast(self, tensor, src):
        self._check_peer(src, "broadcast", "src")
        staging = _Staging(tensor)
        buf, back = staging.staged(tensor, False)
        return self._run("broadcast", [tensor], lambda: _Posted(self.comm.Ibcast(buf, root=src), back), staging)

    def _reduce_op(self, op, tensor, name):
        op = to_reduce_op(op)
        check_avg_dtype(op, tensor, name)
        return op

    def _after_reduce(self, op, buf, back):
        """What completes a reduction: AVG's division, then the copy back of a staged tensor."""
        if op is not ReduceOp.AVG and back is None:
            return None

        def done():
            if op is ReduceOp.AVG:
                buf[...] /= self._size
            if back:
                back()

        return done

    def _all_reduce(self, tensor, op=ReduceOp.SUM):
        op = self._reduce_op(op, tensor, "all_reduce")
        staging = _Staging(tensor)
        buf, back = staging.staged(tensor, True)
        done = self._after_reduce(op, buf, back)
        return self._run(
            "all_reduce",
            [tensor],
            lambda: _Posted(self.comm.Iallreduce(MPI.IN_PLACE, buf, op=_mpi_op(op)), done),
            staging,
        )

    def _reduce(self, tensor, dst, op=ReduceOp.SUM):
        self._check_peer(dst, "reduce", "dst")
        op = self._reduce_op(op, tensor, "reduce")
        staging = _Staging(tensor)
        buf, back = staging.staged(tensor, True)
        if self._rank == dst:
            done = self._after_reduce(op, buf, back)
            return self._run(
                "reduce",
                [tensor],
                lambda: _Posted(self.comm.Ireduce(MPI.IN_PLACE, buf, op=_mpi_op(op), root=dst), done),
                staging,
            )
        return self._run(
            "reduce", [tensor], lambda: _Posted(self.comm.Ireduce(buf, None, op=_mpi_op(op), root=dst), None), staging
        )

    def _all_gather(self, tensor_list, tensor):
        check_list_len("all_gather", "tensor_list", tensor_list, self._size)
        check_same_shape("all_gather", "tensor_list", tensor, tensor_list)
        staging = _Staging(tensor, *tensor_list)
        send, _ = staging.staged(tensor, False)
        flat = staging.empty((self._size,) + tuple(send.shape), torch.from_numpy(send[:0]).dtype)

        def unpack():
            for out, row in zip(tensor_list, flat):
                out.copy_(row.view_as(out), non_blocking=out.is_cuda)

        return self._run(
            "all_gather", tensor_list, lambda: _Posted(self.comm.Iallgather(send, flat.numpy()), unpack), staging
        )

    def _gather(self, tensor, gather_list, dst):
        self._check_peer(dst, "gather", "dst")
        staging = _Staging(tensor, *(gather_list or []))
        send, _ = staging.staged(tensor, False)
        is_root = self._rank == dst
        if is_root:
            check_list_len("gather", "gather_list", gather_list, self._size)
            check_same_shape("gather", "gather_list", tensor, gather_list)
        flat = staging.empty((self._size,) + tuple(send.shape), torch.from_numpy(send[:0]).dtype) if is_root else None

        def unpack():
            for out, row in zip(gather_list, flat):
                out.copy_(row.view_as(out), non_blocking=out.is_cuda)

        return self._run(
            "gather",
            gather_list or [],
            lambda: _Posted(
                self.comm.Igather(send, flat.numpy() if is_root else None, root=dst), unpack if is_root else None
            ),
            staging,
        )

    def _scatter(self, tensor, scatter_list, src):
        self._check_peer(src, "scatter", "src")
        staging = _Staging(tensor)
        recv, back = staging.staged(tensor, False)
        is_root = self._rank == src
        if is_root:
            check_list_len("scatter", "scatter_list", scatter_list, self._size)
            check_same_shape("scatter", "scatter_list", tensor, scatter_list)
            dtype = torch.float32 if tensor.dtype == torch.bfloat16 else tensor.dtype
            flat = staging.host(torch.stack([t.detach().reshape(recv.shape) for t in scatter_list]), dtype)

        return self._run(
            "scatter",
            [tensor],
            lambda: _Posted(self.comm.Iscatter(flat.numpy() if is_root else None, recv, root=src), back),
            staging,
        )

    def _reduce_scatter(self, output, input_list, op=ReduceOp.SUM):
        check_list_len("reduce_scatter", "input_list", input_list, self._size)
        check_same_shape("reduce_scatter", "input_list", output, input_list)
        op = self._reduce_op(op, output, "reduce_scatter")
        staging = _Staging(output, *input_list)
        recv, back = staging.staged(output, True)
        send = staging.host(torch.stack([t.detach() for t in input_list]), torch.from_numpy(recv[:0]).dtype)
        done = self._after_reduce(op, recv, back)
        return self._run(
            "reduce_scatter",
            [output],
            lambda: _Posted(self.comm.Ireduce_scatter_block(send.numpy(), recv, op=_mpi_op(op)), done),
            staging,
        )

    def _all_to_all(self, output_list, input_list):
        check_list_len("all_to_all", "output_list", output_list, self._size)
        check_list_len("all_to_all", "input_list", input_list, self._size)
        staging = _Staging(*input_list, *output_list)
        send = staging.host(torch.cat([t.detach().reshape(-1) for t in input_list]))
        recv = staging.empty(sum(t.numel() for t in output_list), send.dtype)
        if send.dtype == torch.bfloat16:
            send, recv = send.view(torch.int16), recv.view(torch.int16)  # bytes move unchanged
        s_counts = [t.numel() for t in input_list]
        r_counts = [t.numel() for t in output_list]

        def unpack():
            for out, chunk in zip(output_list, torch.split(recv.view(output_list[0].dtype), r_counts)):
                out.copy_(chunk.view_as(out), non_blocking=out.is_cuda)

        return self._run(
            "all_to_all",
            output_list,
            lambda: _Posted(self.comm.Ialltoallv([send.numpy(), s_counts], [recv.numpy(), r_counts]), unpack),
            staging,
        )

    def _barrier(self):
        return self._run("barrier", [], lambda: _Posted(self.comm.Ibarrier(), None))

    def _new_subgroup(self, ranks, name, timeout):
        member = self._rank in ranks
        box = {}

        def run():
            box["comm"] = self.comm.Split(
                0 if member else MPI.UNDEFINED, key=list(ranks).index(self._rank) if member else 0
            )

        self._run("new_group", [], run).wait()
        if not member:
            return None
        return MPIProcessGroup(box["comm"], [self.global_ranks[r] for r in ranks], timeout, name)

    def destroy(self):
        if not self._destroyed:
            comm = self.comm

            def free():  # on the comm thread, after make_control (queued first) has run
                self._thread.unregister(self)
                if self._control is not None:
                    self._control.Free()
                if comm is not MPI.COMM_WORLD:
                    comm.Free()

            freed = threading.Event()
            self._thread.submit(free, []).add_done_callback(lambda _f: freed.set())
            freed.wait(5)  # best effort at teardown: a wedged thread must not hang the exit
        super().destroy()


def make_mpi_group(rank: int, size: int, timeout: timedelta) -> MPIProcessGroup:
    """The world group; ``rank``/``size`` of -1 mean "whatever mpirun says".

    Raises:
        ImportError: mpi4py cannot load an MPI library (``backends._mpi`` says how to install one).
    """
    _init_mpi()
    comm = MPI.COMM_WORLD
    mpi_rank, mpi_size = comm.Get_rank(), comm.Get_size()
    if size not in (-1, None) and size != mpi_size:
        raise RendezvousError(
            f"backend 'mpi': the job was configured for world_size={size} but mpirun started "
            f"{mpi_size} rank(s). Run `mpirun -n {size} ...`, or set the world size to {mpi_size}."
        )
    if rank not in (-1, None) and rank != mpi_rank:
        raise RendezvousError(
            f"backend 'mpi': rank={rank} was given but MPI says this process is "
            f"rank {mpi_rank}; let MPI assign ranks (pass rank=-1)."
        )
    if MPI.Query_thread() < MPI.THREAD_SERIALIZED:
        raise CommError(
            "backend 'mpi' needs an MPI library initialised with at least "
            "MPI_THREAD_SERIALIZED (ddptrain calls MPI from a communication thread)"
        )
    _abort_on_uncaught_exception()
    return MPIProcessGroup(comm, list(range(mpi_size)), timeout)


def _abort_on_uncaught_exception() -> None:
    """Make an uncaught exception end the whole MPI job, as ``python -m mpi4py`` does.

    Without it the failing rank blocks in MPI_Finalize at exit while its peers wait in a
    collective, and the job hangs until a timeout instead of ending at once.
    """
    previous = sys.excepthook
    if getattr(previous, "_ddptrain_mpi_abort", False):
        return

    def hook(exc_type, exc, tb):
        previous(exc_type, exc, tb)
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)

    hook._ddptrain_mpi_abort = True
    sys.excepthook = hook
