"""Run a function on N local worker processes — ddptrain's local launcher.

The parent picks a free port on the loopback address, gives every worker its ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``, and watches them all. If one
worker fails (raises, is killed by a signal, exits non-zero) the others are stopped at once and
:class:`WorkerFailedError` names the rank and carries its traceback; a job that outlives
``timeout_s`` is killed with :class:`LaunchTimeoutError`. Nothing is left running either way.

Workers use the ``spawn`` start method, so ``fn`` and its arguments must be picklable (a module
level function, not a lambda).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import socket
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_any
from typing import Any, Callable, Optional, Sequence


class WorkerFailedError(RuntimeError):
    """A worker failed; ``rank``, ``exitcode`` and ``worker_traceback`` say how."""

    def __init__(self, rank: int, message: str, exitcode: Optional[int] = None,
                 worker_traceback: str = ""):
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode
        self.worker_traceback = worker_traceback


class LaunchTimeoutError(TimeoutError):
    """The job did not finish within the launcher's overall timeout."""


def find_free_port(host: str = "127.0.0.1") -> int:
    """Ask the OS for a port that is free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def describe_exitcode(code: Optional[int]) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


@dataclass
class _WorkerSpec:
    rank: int
    world_size: int
    env: dict
    backend: Optional[str]
    comm_timeout_s: Optional[float]
    threads: int


def _worker_main(spec: _WorkerSpec, fn: Callable, args: Sequence, kwargs: dict, conn) -> None:
    os.environ.update(spec.env)
    status: tuple
    try:
        import torch
        torch.set_num_threads(spec.threads)
        if spec.backend:
            from ..comm import destroy_process_group, init_process_group
            init_process_group(spec.backend, timeout=spec.comm_timeout_s)
        try:
            result = fn(spec.rank, spec.world_size, *args, **kwargs)
        finally:
            if spec.backend:
                destroy_process_group()
        status = ("ok", result)
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        status = ("error", f"{type(exc).__name__}: {exc}", traceback.format_exc())
    # Plain pickle, not the connection's ForkingPickler: that one passes tensors as shared-memory
    # handles, which vanish when this worker exits before the parent reads them.
    try:
        payload = pickle.dumps(status)
    except Exception as exc:  # an unpicklable result must not look like success
        status = ("error", f"the result of rank {spec.rank} could not be sent to the parent: {exc}", "")
        payload = pickle.dumps(status)
    conn.send_bytes(payload)
    conn.close()
    if status[0] == "error":
        os._exit(1)  # skip atexit handlers that could block on dead peers


# After the first failure, how long the other workers may still report theirs: a rank that
# raises usually breaks its peers' connections, and the launcher must blame the cause, not them.
_FAILURE_GRACE_S = 1.0
_SECONDARY = ("closed its connection", "connection closed", "connection reset", "broken pipe",
              "timed out", "CommTimeoutError", "peer")


def _read_report(reader) -> Optional[tuple]:
    """A worker's pickled report, or None if it died without one (EOF)."""
    try:
        return pickle.loads(reader.recv_bytes())
    except (EOFError, OSError):
        return None


def _record(rank: int, msg: Optional[tuple], proc, results: dict, failures: dict) -> None:
    """File a worker's outcome: its result, its reported error, or how it died."""
    if rank in results or rank in failures:
        return
    if msg is not None and msg[0] == "ok":
        results[rank] = msg[1]
    elif msg is not None:
        failures[rank] = WorkerFailedError(
            rank, f"rank {rank} failed: {msg[1]}\n--- traceback of rank {rank} ---\n{msg[2]}",
            worker_traceback=msg[2])
    else:
        proc.join(5)
        failures[rank] = WorkerFailedError(
            rank, f"rank {rank} (pid {proc.pid}) {describe_exitcode(proc.exitcode)} without reporting a "
                  "result; the other ranks were stopped.", proc.exitcode)


def _root_cause(failures: dict) -> "WorkerFailedError":
    """The failure that started it: one that is not a broken connection or a timeout, if any."""
    primary = [f for f in failures.values() if not any(k.lower() in str(f).lower() for k in _SECONDARY)]
    return (primary or list(failures.values()))[0]


def _stop(procs: Sequence[mp.Process], grace_s: float = 3.0) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)


def launch(fn: Callable, world_size: int, args: Sequence = (), kwargs: Optional[dict] = None, *,
           backend: Optional[str] = None, timeout_s: Optional[float] = None,
           comm_timeout_s: Optional[float] = None, master_addr: str = "127.0.0.1",
           master_port: Optional[int] = None, env: Optional[dict] = None,
           threads_per_worker: Optional[int] = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` local processes.

    Args:
        fn: a picklable function; its return value (picklable) is collected per rank.
        backend: if set (``"gloo"``...), each worker joins the default ddptrain process group
            before ``fn`` and leaves it after.
        timeout_s: overall limit for the job; ``None`` waits as long as workers make progress.
        comm_timeout_s: timeout of rendezvous and collectives inside workers (default: 30 min).
        master_port: default: a free port chosen here.
        env: extra environment variables for every worker.
        threads_per_worker: torch intra-op threads per worker (default: cores / world size).

    Returns:
        The list of ``fn``'s return values, indexed by rank.

    Raises:
        WorkerFailedError: the first worker that failed, with its traceback.
        LaunchTimeoutError: the job outlived ``timeout_s``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    port = master_port or find_free_port(master_addr)
    threads = threads_per_worker or max(1, (os.cpu_count() or 1) // world_size)
    ctx = mp.get_context("spawn")
    procs, readers = [], {}
    for rank in range(world_size):
        worker_env = {
            "MASTER_ADDR": master_addr, "MASTER_PORT": str(port), "RANK": str(rank),
            "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size), "GROUP_RANK": "0",
            "OMP_NUM_THREADS": str(threads), **(env or {}),
        }
        spec = _WorkerSpec(rank, world_size, worker_env, backend, comm_timeout_s, threads)
        reader, writer = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_worker_main, args=(spec, fn, tuple(args), dict(kwargs or {}), writer),
                        name=f"ddptrain-rank{rank}")
        p.start()
        writer.close()
        procs.append(p)
        readers[reader] = rank
    results: dict[int, Any] = {}
    failures: dict[int, WorkerFailedError] = {}
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    first_failure_at: Optional[float] = None
    try:
        pending = dict(readers)
        sentinels = {p.sentinel: r for r, p in enumerate(procs)}
        while len(results) + len(failures) < world_size:
            now = time.monotonic()
            if first_failure_at is not None and now - first_failure_at >= _FAILURE_GRACE_S:
                break  # the others had their moment to report; stop them now
            if deadline is not None and now >= deadline:
                running = [r for r in range(world_size) if r not in results and r not in failures]
                raise LaunchTimeoutError(
                    f"the job did not finish within {timeout_s:g} s; rank(s) {running} still running "
                    "were killed. A rank may be stuck in a collective its peers never call.")
            limits = [t for t in (None if deadline is None else deadline - now,
                                  None if first_failure_at is None else first_failure_at + _FAILURE_GRACE_S - now)
                      if t is not None]
            ready = wait_any(list(pending) + list(sentinels), timeout=min(limits) if limits else None)
            for obj in ready:
                if obj in pending:
                    rank = pending.pop(obj)
                    _record(rank, _read_report(obj), procs[rank], results, failures)
                elif obj in sentinels:
                    rank = sentinels.pop(obj)
                    procs[rank].join()
                    reader = next((rd for rd, r in pending.items() if r == rank), None)
                    msg = None
                    if reader is not None:
                        pending.pop(reader)
                        msg = _read_report(reader) if reader.poll(0.5) else None
                    _record(rank, msg, procs[rank], results, failures)
                if failures and first_failure_at is None:
                    first_failure_at = time.monotonic()
        if failures:
            raise _root_cause(failures)
        return [results[r] for r in range(world_size)]
    finally:
        _stop(procs)
        for reader in readers:
            reader.close()
