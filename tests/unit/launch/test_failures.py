"""Unit tests for ddptrain.launch.failures: how a worker's outcome travels, how failures read,
which one is blamed, and how a process's end is described (without an OOM record: the kernel's
OOM kill is tested for real in tests/e2e/test_faults_oom.py)."""

from __future__ import annotations

import signal
import threading

import pytest
import torch

from ddptrain.launch.failures import (
    WorkerFailedError,
    WorkerOutcome,
    capture,
    decode_outcome,
    describe_exitcode,
    encode_outcome,
    failure_from_report,
    failure_without_report,
    is_secondary,
    root_cause,
)

# Above the largest pid Linux can hand out (pid_max <= 2**22): no process ever had it.
NEVER_A_PID = 4194999


# --- how a process ended ------------------------------------------------------------------


@pytest.mark.parametrize(
    "code, pid, phrase",
    [
        (None, None, "still running"),
        (0, None, "exited with code 0"),
        (3, 123, "exited with code 3"),
        (-signal.SIGTERM, 123, "killed by signal SIGTERM"),
        (-signal.SIGSEGV, None, "killed by signal SIGSEGV"),
        (-200, None, "killed by signal 200"),  # no such signal: its number
    ],
)
def test_describe_exitcode(code, pid, phrase):
    assert describe_exitcode(code, pid) == phrase


def test_sigkill_without_an_oom_record_hints_at_the_oom_killer_and_dmesg():
    described = describe_exitcode(-signal.SIGKILL, NEVER_A_PID)
    assert described.startswith(
        "killed by signal SIGKILL (SIGKILL is also what the kernel's out-of-memory killer sends: check "
        f"`dmesg` for 'Killed process {NEVER_A_PID}'"
    ), described
    assert described.endswith(" and the memory limit)"), described
    without_pid = describe_exitcode(-signal.SIGKILL)
    assert "check `dmesg` " in without_pid and "Killed process" not in without_pid, without_pid


# --- a worker's outcome, on the worker's side and on the wire ------------------------------


def _raises_key_error():
    raise KeyError("the-missing-key")


def test_capture_keeps_the_result():
    outcome = capture(lambda: {"loss": 0.5})
    assert outcome == WorkerOutcome(result={"loss": 0.5}) and not outcome.failed


def test_capture_names_the_exception_and_keeps_its_traceback():
    outcome = capture(_raises_key_error)
    assert outcome.failed and outcome.result is None
    assert outcome.error == "KeyError: 'the-missing-key'"
    assert outcome.traceback.startswith("Traceback (most recent call last):"), outcome.traceback
    assert "in _raises_key_error" in outcome.traceback and 'raise KeyError("the-missing-key")' in outcome.traceback


@pytest.mark.parametrize(
    "exc, error",
    [
        (MemoryError(), "MemoryError (the worker ran out of memory)"),
        (MemoryError("torch said no"), "MemoryError: torch said no (the worker ran out of memory)"),
        (RuntimeError(), "RuntimeError"),
        (SystemExit(3), "SystemExit: 3"),  # even what ends the interpreter reaches the launcher
        (KeyboardInterrupt(), "KeyboardInterrupt"),
    ],
)
def test_capture_describes_every_exception(exc, error):
    def body():
        raise exc

    assert capture(body).error == error


def test_outcomes_round_trip_as_plain_pickle():
    result = {"weights": torch.arange(4.0), "rank": 1}
    payload, failed = encode_outcome(WorkerOutcome(result=result), rank=1)
    assert not failed and isinstance(payload, bytes)
    # Plain pickle: the tensor's bytes travel, not a shared-memory handle that dies with the worker.
    assert b"rebuild_storage_fd" not in payload and b"rebuild_storage_filename" not in payload
    back = decode_outcome(payload)
    assert not back.failed and back.result["rank"] == 1 and torch.equal(back.result["weights"], torch.arange(4.0))
    error = WorkerOutcome(error="KeyError: 'k'", traceback="Traceback ...")
    payload, failed = encode_outcome(error, rank=0)
    assert failed and decode_outcome(payload) == error


def test_a_result_that_cannot_be_pickled_is_reported_as_the_ranks_failure():
    payload, failed = encode_outcome(WorkerOutcome(result=threading.Lock()), rank=2)
    assert failed
    back = decode_outcome(payload)
    assert back.failed and back.result is None and back.traceback == ""
    assert back.error.startswith("the result of rank 2 could not be sent to the launcher: "), back.error
    assert "lock" in back.error, back.error  # pickle's own reason follows


# --- how a failure reads ------------------------------------------------------------------


def test_a_reported_failure_names_the_rank_its_error_and_its_traceback():
    outcome = capture(_raises_key_error)
    err = failure_from_report(1, outcome)
    assert isinstance(err, WorkerFailedError) and isinstance(err, RuntimeError)
    assert (err.rank, err.exitcode, err.worker_traceback) == (1, None, outcome.traceback)
    assert str(err) == f"rank 1 failed: KeyError: 'the-missing-key'\n--- traceback of rank 1 ---\n{outcome.traceback}"


def test_a_failure_without_report_says_how_the_rank_ended_and_what_became_of_the_others():
    err = failure_without_report(2, 4242, 3, "the other ranks were stopped.")
    assert (err.rank, err.exitcode, err.worker_traceback) == (2, 3, "")
    assert str(err) == "rank 2 (pid 4242) exited with code 3 without reporting a result; the other ranks were stopped."
    err = failure_without_report(0, 77, -signal.SIGTERM, "mpiexec stopped the other ranks.")
    assert (
        str(err)
        == "rank 0 (pid 77) killed by signal SIGTERM without reporting a result; mpiexec stopped the other ranks."
    )


# --- which failure is blamed --------------------------------------------------------------

# Messages of ranks that failed because another one did (texts of ddptrain.comm's errors).
BROKEN_BY_A_PEER = [
    "CommError: all_reduce on group 'world' failed: a peer closed its connection — a rank of [0, 1] probably exited",
    "CommTimeoutError: barrier on group 'world' timed out after 3 s: some rank of [0, 1, 2] did not join",
    "ConnectionResetError: [Errno 104] Connection reset by peer",
    "BrokenPipeError: [Errno 32] Broken pipe",
]


def _reported(rank: int, error: str) -> WorkerFailedError:
    return failure_from_report(rank, WorkerOutcome(error=error, traceback="Traceback ..."))


@pytest.mark.parametrize("error", BROKEN_BY_A_PEER)
def test_a_broken_connection_or_a_timeout_is_secondary(error):
    assert is_secondary(_reported(0, error))


def test_the_first_cause_is_blamed_not_the_peers_it_broke():
    victim, cause, later = _reported(0, BROKEN_BY_A_PEER[0]), _reported(1, "KeyError: 'k'"), _reported(2, "ValueError")
    assert not is_secondary(cause)
    assert root_cause([victim, cause, later]) is cause
    assert root_cause([later, victim, cause]) is later  # in the order the launcher learnt of them


def test_only_consequences_blame_the_first_of_them():
    first, second = _reported(1, BROKEN_BY_A_PEER[1]), _reported(0, BROKEN_BY_A_PEER[0])
    assert root_cause([first, second]) is first


def test_a_rank_that_died_without_a_report_is_a_cause_whatever_its_text():
    # The text of a death quotes the kernel log and cgroup paths, which may hold any word.
    died = WorkerFailedError(1, "rank 1 (pid 5) killed by signal SIGKILL (... cgroup /peer-timed out ...)", -9)
    assert not is_secondary(died)
    assert root_cause([_reported(0, BROKEN_BY_A_PEER[1]), died]) is died


def test_root_cause_of_nothing_is_an_error():
    with pytest.raises(ValueError, match="at least one failure"):
        root_cause([])
