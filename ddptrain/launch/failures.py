"""How a launched job fails, and how the launcher says so — the one place for every launcher.

- The errors a launch raises: :class:`WorkerFailedError`, :class:`LaunchTimeoutError`,
  :class:`MpiexecNotFoundError`.
- How a process ended, as a phrase (:func:`describe_exitcode`; a SIGKILL is checked against the
  kernel's OOM-kill records, see :mod:`ddptrain.launch.oom`).
- What a worker reports to its launcher (:class:`WorkerOutcome`: its result, or its error and
  traceback) and how that travels: plain pickle bytes (:func:`encode_outcome`,
  :func:`decode_outcome`); a result that cannot be pickled is reported as an error.
- The message of a failed rank, with its report (:func:`failure_from_report`) or without one
  (:func:`failure_without_report`), and which rank's failure started it (:func:`root_cause`).
"""

from __future__ import annotations

import pickle
import signal
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from .oom import kernel_oom_kill, memory_cgroup_oom_kills


class WorkerFailedError(RuntimeError):
    """A worker failed; ``rank``, ``exitcode`` and ``worker_traceback`` say how."""

    def __init__(self, rank: int, message: str, exitcode: int | None = None, worker_traceback: str = ""):
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode
        self.worker_traceback = worker_traceback


class LaunchTimeoutError(TimeoutError):
    """The job did not finish within the launcher's overall timeout."""


class MpiexecNotFoundError(FileNotFoundError):
    """Backend ``mpi`` needs ``mpiexec`` to start its ranks, and there is none."""


def describe_exitcode(code: int | None, pid: int | None = None) -> str:
    """How a process ended, as a phrase: ``exited with code 1``, ``killed by signal SIGTERM``...

    SIGKILL is also how the kernel's out-of-memory killer ends a process. Given the dead
    process's ``pid``, the kernel log (``/dev/kmsg``: root, or ``kernel.dmesg_restrict=0``) is
    searched for its OOM kill; if found, the phrase says so and quotes the kernel's numbers and
    the memory cgroup's limit. Otherwise it adds a hint to check ``dmesg`` and the memory limit,
    with the OOM kills counted by this process's memory cgroup (which workers inherit), if any.
    """
    if code is None:
        return "still running"
    if code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        return f"killed by signal {-code}"
    if -code != signal.SIGKILL:
        return f"killed by signal {name}"
    oom = kernel_oom_kill(pid) if pid else None
    if oom is not None:
        return f"killed by signal SIGKILL from the kernel's out-of-memory killer ({oom})"
    hint = "SIGKILL is also what the kernel's out-of-memory killer sends: check `dmesg`"
    if pid:
        hint += f" for 'Killed process {pid}'"
    counted = memory_cgroup_oom_kills()
    if counted is not None and counted[1] > 0:
        hint += f" (memory cgroup {counted[0]} has counted {counted[1]} OOM kill(s))"
    return f"killed by signal SIGKILL ({hint} and the memory limit)"


def describe_exception(exc: BaseException) -> str:
    """``Type: message`` of a worker's failure; a bare MemoryError says what it means."""
    text = type(exc).__name__ + (f": {exc}" if str(exc) else "")
    if isinstance(exc, MemoryError):
        text += " (the worker ran out of memory)"
    return text


@dataclass(frozen=True)
class WorkerOutcome:
    """What one worker reports to its launcher: the value ``fn`` returned, or how it failed.

    Attributes:
        result: ``fn``'s return value (None when it failed).
        error: ``Type: message`` of the failure (:func:`describe_exception`); None on success.
        traceback: The worker's formatted traceback of that failure ("" when there is none).
    """

    result: Any = None
    error: str | None = None
    traceback: str = ""

    @property
    def failed(self) -> bool:
        return self.error is not None


def capture(body: Callable[[], Any]) -> WorkerOutcome:
    """Run ``body()`` and return its outcome; every exception (even ``SystemExit``) is caught,
    because every failure must reach the launcher."""
    try:
        return WorkerOutcome(result=body())
    except BaseException as exc:  # noqa: BLE001
        return WorkerOutcome(error=describe_exception(exc), traceback=traceback.format_exc())


def encode_outcome(outcome: WorkerOutcome, rank: int) -> tuple[bytes, bool]:
    """``outcome`` as bytes for the launcher, and whether those bytes report a failure.

    Plain pickle, not multiprocessing's ForkingPickler: that one passes tensors as shared-memory
    handles, which vanish when the worker exits before the launcher reads them. A result that
    cannot be pickled becomes a failure of ``rank``: it must not look like success.
    """
    try:
        return pickle.dumps(outcome), outcome.failed
    except Exception as exc:  # noqa: BLE001 - whatever pickle raises, the launcher must hear of it
        unsent = WorkerOutcome(error=f"the result of rank {rank} could not be sent to the launcher: {exc}")
        return pickle.dumps(unsent), True


def decode_outcome(payload: bytes) -> WorkerOutcome:
    """The outcome a worker sent (:func:`encode_outcome`)."""
    return pickle.loads(payload)


def failure_from_report(rank: int, outcome: WorkerOutcome) -> WorkerFailedError:
    """The error for a rank that reported its failure: its ``Type: message`` and traceback."""
    return WorkerFailedError(
        rank,
        f"rank {rank} failed: {outcome.error}\n--- traceback of rank {rank} ---\n{outcome.traceback}",
        worker_traceback=outcome.traceback,
    )


def failure_without_report(rank: int, pid: int | None, exitcode: int | None, aftermath: str) -> WorkerFailedError:
    """The error for a rank that ended without reporting: how it ended (:func:`describe_exitcode`),
    then ``aftermath``, what became of the other ranks."""
    return WorkerFailedError(
        rank,
        f"rank {rank} (pid {pid}) {describe_exitcode(exitcode, pid)} without reporting a result; {aftermath}",
        exitcode,
    )


# Words of failures that follow from another rank's: a rank that raises usually breaks its
# peers' connections or leaves them waiting, and the launcher must blame the cause, not them.
_SECONDARY = (
    "closed its connection",
    "connection closed",
    "connection reset",
    "broken pipe",
    "timed out",
    "CommTimeoutError",
    "peer",
)


def is_secondary(failure: WorkerFailedError) -> bool:
    """Whether a rank's failure looks like the consequence of another's (a broken connection,
    a timeout) rather than a cause. A rank that died without a report is always a cause."""
    if failure.exitcode is not None:
        return False
    return any(k.lower() in str(failure).lower() for k in _SECONDARY)


def root_cause(failures: Iterable[WorkerFailedError]) -> WorkerFailedError:
    """The failure that started it: the first that is not a broken connection or a timeout, if
    any, else the first. ``failures`` come in the order the launcher learnt of them."""
    failures = list(failures)
    if not failures:
        raise ValueError("root_cause needs at least one failure")
    return next((f for f in failures if not is_secondary(f)), failures[0])
