"""Shared vocabulary of the communication layer: reduce ops, work handles, errors.

Every backend returns a :class:`Work` from every operation, so that callers (the DDP
reducer, the functional API, the ring all-reduce) never care whether the bytes move on a
torch/gloo thread, on NCCL streams or on an MPI communication thread.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch


class ReduceOp(enum.Enum):
    """Reduction applied by ``reduce``, ``all_reduce`` and ``reduce_scatter``."""

    SUM = "sum"
    PRODUCT = "product"
    MAX = "max"
    MIN = "min"
    AVG = "avg"

    def __repr__(self) -> str:  # reads as the user wrote it: ReduceOp.SUM
        return f"ReduceOp.{self.name}"


def to_reduce_op(op) -> ReduceOp:
    """Accept our ReduceOp, ``torch.distributed.ReduceOp``, or a name such as ``"sum"``."""
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str):
        if op.upper() in ReduceOp.__members__:
            return ReduceOp[op.upper()]
    else:
        import torch.distributed as tdist

        for ours in ReduceOp:
            if op == getattr(tdist.ReduceOp, ours.name):
                return ours
    raise ValueError(f"unknown reduce op {op!r}; use ReduceOp.SUM, PRODUCT, MAX, MIN or AVG")


_FOLD = {
    ReduceOp.SUM: torch.Tensor.add_,
    ReduceOp.AVG: torch.Tensor.add_,  # the division by the group size comes after the sum
    ReduceOp.PRODUCT: torch.Tensor.mul_,
    ReduceOp.MAX: lambda acc, x: torch.maximum(acc, x, out=acc),
    ReduceOp.MIN: lambda acc, x: torch.minimum(acc, x, out=acc),
}


def fold_into(op: ReduceOp, acc: torch.Tensor, incoming: torch.Tensor) -> None:
    """``acc = op(acc, incoming)`` in place: one step of a reduction done by ddptrain itself (the
    ring all-reduce, the threaded test group). Booleans: SUM/MAX are "or", PRODUCT/MIN "and"."""
    if acc.dtype == torch.bool:
        if op in (ReduceOp.SUM, ReduceOp.MAX):
            acc.logical_or_(incoming)
        else:
            acc.logical_and_(incoming)
        return
    _FOLD[op](acc, incoming)


def check_avg_dtype(op: ReduceOp, tensor: torch.Tensor, op_name: str) -> None:
    """Refuse AVG on integer tensors on every backend alike (it would silently truncate)."""
    if op is ReduceOp.AVG and not (tensor.is_floating_point() or tensor.is_complex()):
        raise TypeError(
            f"{op_name} with ReduceOp.AVG needs a floating-point tensor, got {tensor.dtype}: an "
            "integer average would be silently truncated. Reduce with SUM and divide, or convert "
            "the tensor to a float dtype first."
        )


class CommError(RuntimeError):
    """Base class of every error the communication layer raises on purpose."""


class CommTimeoutError(CommError, TimeoutError):
    """A rendezvous or a collective did not complete within its timeout."""


class RendezvousError(CommError):
    """The processes could not meet: bad init method, port in use, missing variables."""


class GroupError(CommError, ValueError):
    """A group was used wrongly: destroyed, not initialised, or by a rank outside it."""


def as_timedelta(timeout: Any, default: timedelta | None = None) -> timedelta | None:
    """Accept seconds (int/float) or a timedelta; ``None`` gives ``default``."""
    if timeout is None:
        return default
    if isinstance(timeout, timedelta):
        return timeout
    if isinstance(timeout, (int, float)):
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout!r} seconds")
        return timedelta(seconds=float(timeout))
    raise TypeError(f"timeout must be seconds or a datetime.timedelta, got {type(timeout).__name__}")


class Work:
    """Handle of an asynchronous operation, as returned by ``async_op=True`` calls.

    ``wait()`` blocks until the operation finished (re-raising its error), ``is_completed()``
    polls, and ``get_future()`` gives a ``torch.futures.Future`` whose value is the output
    tensor list, for chaining (the DDP communication hooks build on it).

    Subclasses provide ``_wait``; ``result_hook`` runs once after completion (e.g. the
    division that turns a SUM into an AVG on backends without a native AVG).
    """

    def __init__(self, op_name: str, outputs: list[torch.Tensor]):
        self.op_name = op_name
        self.outputs = outputs
        self._finalized = False
        self._lock = threading.Lock()
        self._post: list[Callable[[], None]] = []

    def add_post_processing(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once, in the waiting thread, right after the operation completes."""
        self._post.append(fn)

    def _finalize(self) -> None:
        with self._lock:
            if self._finalized:
                return
            self._finalized = True
            for fn in self._post:
                fn()

    def wait(self, timeout: Any = None) -> bool:
        """Block until done; raise :class:`CommTimeoutError` after ``timeout`` (seconds or timedelta)."""
        self._wait(as_timedelta(timeout))
        self._finalize()
        return True

    def _wait(self, timeout: timedelta | None) -> None:
        raise NotImplementedError

    def is_completed(self) -> bool:
        raise NotImplementedError

    def get_future(self) -> torch.futures.Future:
        """A future completed with ``self.outputs`` once the operation (and its post-processing) is done."""
        raise NotImplementedError

    def exception(self) -> BaseException | None:
        return None


class CompletedWork(Work):
    """A work that finished synchronously (world size 1, empty ops, local fallbacks)."""

    def __init__(self, op_name: str, outputs: list[torch.Tensor]):
        super().__init__(op_name, outputs)

    def _wait(self, timeout):
        pass

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        self._finalize()
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(self.outputs)
        return fut


class FutureWork(Work):
    """A work backed by a ``torch.futures.Future`` that another thread completes.

    Used by backends that run operations on their own communication thread (the MPI
    backend) and by composite operations such as the ring all-reduce.
    """

    def __init__(
        self,
        op_name: str,
        outputs: list[torch.Tensor],
        future: torch.futures.Future,
        default_timeout: timedelta | None = None,
        describe: str = "",
        explain_timeout: Callable[[], str] | None = None,
        explain_failure: Callable[[], str] | None = None,
    ):
        """``explain_timeout`` (optional) is asked, when the group's timeout expires, for a sentence
        on who is missing (the MPI backend asks its peers which collective they reached);
        ``explain_failure``, when the operation fails, for what the ranks' ledgers say."""
        super().__init__(op_name, outputs)
        self._future = future
        self._default_timeout = default_timeout
        self._describe = describe
        self._explain_timeout = explain_timeout
        self._explain_failure = explain_failure
        self._done = threading.Event()
        future.add_done_callback(lambda _f: self._done.set())

    def _wait(self, timeout):
        own = timeout or self._default_timeout
        if not self._done.wait(None if own is None else own.total_seconds()):
            seconds = f"{own.total_seconds():g} s"
            if timeout is not None:  # the caller's own wait: peers may just be slower
                raise CommTimeoutError(
                    f"{self.op_name} {self._describe}did not complete within the {seconds} "
                    "given to wait(); the operation may still finish."
                )
            why = self._explain_timeout() if self._explain_timeout else ""
            why, _, ledger = why.partition("\nCollective ledger:")
            raise CommTimeoutError(
                f"{self.op_name} {self._describe}timed out after {seconds}: a peer rank may have died, be stuck, "
                f"or never have called the same operation.{why} Raise the timeout "
                "(init_process_group(timeout=...)) if the step is just slow."
                + (f"\nCollective ledger:{ledger}" if ledger else "")
            )
        try:
            self._future.wait()  # re-raises the operation's error
        except CommError:
            raise
        except Exception as exc:
            if self._explain_failure is None:
                raise
            raise CommError(f"{self.op_name} {self._describe}failed: {exc}{self._explain_failure()}") from exc

    def is_completed(self) -> bool:
        return self._future.done()

    def exception(self):
        if not self._future.done():
            return None
        try:
            self._future.wait()
        except BaseException as exc:  # noqa: BLE001 - report whatever the backend raised
            return exc
        return None

    def get_future(self) -> torch.futures.Future:
        def finish(fut):
            fut.wait()
            self._finalize()
            return self.outputs

        return self._future.then(finish)
