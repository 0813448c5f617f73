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
import re
import signal
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_any
from typing import Any


class WorkerFailedError(RuntimeError):
    """A worker failed; ``rank``, ``exitcode`` and ``worker_traceback`` say how."""

    def __init__(self, rank: int, message: str, exitcode: int | None = None, worker_traceback: str = ""):
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
    oom = _kernel_oom_kill(pid) if pid else None
    if oom is not None:
        return f"killed by signal SIGKILL from the kernel's out-of-memory killer ({oom})"
    hint = "SIGKILL is also what the kernel's out-of-memory killer sends: check `dmesg`"
    if pid:
        hint += f" for 'Killed process {pid}'"
    counted = _memory_cgroup_oom_kills()
    if counted is not None and counted[1] > 0:
        hint += f" (memory cgroup {counted[0]} has counted {counted[1]} OOM kill(s))"
    return f"killed by signal SIGKILL ({hint} and the memory limit)"


# The kernel's OOM-kill records (mm/oom_kill.c): the first is logged before the SIGKILL is sent,
# the second right after it.
_OOM_SUMMARY = re.compile(r"oom-kill:.*?task_memcg=([^,]*),task=.*,pid=(\d+),uid=\d+")
_OOM_KILLED = re.compile(
    r"((?:Memory cgroup out of memory|Out of memory[^:]*): Killed process (\d+) \(.*?\)"
    r"(?: total-vm:\d+kB, anon-rss:\d+kB)?)"
)

_INITIAL_PID_NAMESPACE = 0xEFFFFFFC  # the inode of the host's PID namespace (PROC_PID_INIT_INO)


def _kernel_oom_kill(pid: int, max_age_s: float = 600.0) -> str | None:
    """What the kernel log says about its OOM killer ending ``pid`` recently, or None.

    None also when the log cannot be read (no ``/dev/kmsg`` in the container, no permission), and
    in a PID namespace other than the host's: the log's pids are the host's, so ``pid`` could
    name some other process there.
    """
    try:
        if os.stat("/proc/self/ns/pid").st_ino != _INITIAL_PID_NAMESPACE:
            return None
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    now_us = time.clock_gettime(time.CLOCK_MONOTONIC) * 1e6  # the clock of the log's timestamps
    found: tuple | None = None  # (memory cgroup, "Killed process ..." text): the latest for pid
    try:
        for _ in range(1_000_000):  # a bound, not a limit: the log holds far fewer records
            try:
                record = os.read(fd, 8192).decode("utf-8", "replace")
            except BrokenPipeError:  # the oldest records were overwritten while we read: go on
                continue
            except OSError:  # EAGAIN: the end of the log
                break
            header, _, text = record.partition(";")
            text = text.split("\n", 1)[0]
            fields = header.split(",")
            if len(fields) < 3 or not fields[2].isdigit() or now_us - int(fields[2]) > max_age_s * 1e6:
                continue
            summary = _OOM_SUMMARY.search(text)
            if summary and int(summary.group(2)) == pid:
                found = (summary.group(1), None)
            killed = _OOM_KILLED.search(text)
            if killed and int(killed.group(2)) == pid:
                found = (found[0] if found else None, killed.group(1))
    finally:
        os.close(fd)
    if found is None:
        return None
    memcg, text = found
    parts = [f"kernel log: {text}" if text else f"kernel log: oom-kill of pid {pid}"]
    if memcg:
        limit = _memory_cgroup_limit(memcg)
        parts.append(f"memory cgroup {memcg}" + (f", limit {limit / 2**20:.0f} MiB" if limit else ""))
    return "; ".join(parts)


def _memory_cgroup_file(path: str, v1_name: str, v2_name: str) -> str | None:
    """The text of a memory cgroup's file (cgroup v1 or v2 name), or None if it cannot be read."""
    for root, name in (
        ("/sys/fs/cgroup/memory", v1_name),
        ("/sys/fs/cgroup", v2_name),
        ("/sys/fs/cgroup/unified", v2_name),
    ):
        try:
            with open(f"{root}{path.rstrip('/')}/{name}") as f:
                return f.read()
        except OSError:
            continue
    return None


def _memory_cgroup_limit(path: str) -> int | None:
    """A memory cgroup's limit in bytes; None if it has none or it cannot be read."""
    text = _memory_cgroup_file(path, "memory.limit_in_bytes", "memory.max")
    if text is None or not text.strip().isdigit() or int(text) >= 2**62:  # "max" or v1's "unlimited"
        return None
    return int(text)


def _memory_cgroup_oom_kills(pid: str = "self") -> tuple[str, int] | None:
    """``pid``'s memory cgroup and the OOM kills it has counted (v1 ``memory.oom_control``, v2
    ``memory.events``); None if that cannot be read."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    v1 = [ln.split(":", 2)[2] for ln in lines if "memory" in ln.split(":", 2)[1].split(",")]
    v2 = [ln.split(":", 2)[2] for ln in lines if ln.startswith("0::")]
    for path, names in [(p, ("memory.oom_control", "-")) for p in v1] + [(p, ("-", "memory.events")) for p in v2]:
        text = _memory_cgroup_file(path, *names)
        for line in (text or "").splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return path, int(value)
    return None


def describe_exception(exc: BaseException) -> str:
    """``Type: message`` of a worker's failure; a bare MemoryError says what it means."""
    text = type(exc).__name__ + (f": {exc}" if str(exc) else "")
    if isinstance(exc, MemoryError):
        text += " (the worker ran out of memory)"
    return text


@dataclass
class _WorkerSpec:
    rank: int
    world_size: int
    env: dict
    backend: str | None
    comm_timeout_s: float | None
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
        status = ("error", describe_exception(exc), traceback.format_exc())
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
_SECONDARY = (
    "closed its connection",
    "connection closed",
    "connection reset",
    "broken pipe",
    "timed out",
    "CommTimeoutError",
    "peer",
)


def _read_report(reader) -> tuple | None:
    """A worker's pickled report, or None if it died without one (EOF)."""
    try:
        return pickle.loads(reader.recv_bytes())
    except (EOFError, OSError):
        return None


def _record(rank: int, msg: tuple | None, proc, results: dict, failures: dict) -> None:
    """File a worker's outcome: its result, its reported error, or how it died."""
    if rank in results or rank in failures:
        return
    if msg is not None and msg[0] == "ok":
        results[rank] = msg[1]
    elif msg is not None:
        failures[rank] = WorkerFailedError(
            rank, f"rank {rank} failed: {msg[1]}\n--- traceback of rank {rank} ---\n{msg[2]}", worker_traceback=msg[2]
        )
    else:
        proc.join(5)
        failures[rank] = WorkerFailedError(
            rank,
            f"rank {rank} (pid {proc.pid}) {describe_exitcode(proc.exitcode, proc.pid)} without reporting a "
            "result; the other ranks were stopped.",
            proc.exitcode,
        )


def is_secondary(failure: Exception) -> bool:
    """Whether a rank's failure looks like the consequence of another's (a broken connection,
    a timeout) rather than a cause."""
    return any(k.lower() in str(failure).lower() for k in _SECONDARY)


def root_cause(failures: dict) -> WorkerFailedError:
    """The failure that started it: one that is not a broken connection or a timeout, if any."""
    primary = [f for f in failures.values() if not is_secondary(f)]
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


def launch(
    fn: Callable,
    world_size: int,
    args: Sequence = (),
    kwargs: dict | None = None,
    *,
    backend: str | None = None,
    timeout_s: float | None = None,
    comm_timeout_s: float | None = None,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    env: dict | None = None,
    threads_per_worker: int | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` local processes.

    Args:
        fn: a picklable function; its return value (picklable) is collected per rank.
        backend: if set (``"gloo"``...), each worker joins the default ddptrain process group
            before ``fn`` and leaves it after. ``"mpi"`` starts the ranks through ``mpiexec``
            instead of spawning them (see :mod:`ddptrain.launch.mpi_launch`).
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
    if backend == "mpi":  # MPI ranks must be started by MPI's own launcher
        from .mpi_launch import launch_under_mpiexec

        return launch_under_mpiexec(
            fn,
            world_size,
            args,
            kwargs,
            timeout_s=timeout_s,
            comm_timeout_s=comm_timeout_s,
            env=env,
            threads_per_worker=threads_per_worker,
        )
    port = master_port or find_free_port(master_addr)
    threads = threads_per_worker or max(1, (os.cpu_count() or 1) // world_size)
    ctx = mp.get_context("spawn")
    procs, readers = [], {}
    for rank in range(world_size):
        worker_env = {
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "GROUP_RANK": "0",
            "OMP_NUM_THREADS": str(threads),
            **(env or {}),
        }
        spec = _WorkerSpec(rank, world_size, worker_env, backend, comm_timeout_s, threads)
        reader, writer = ctx.Pipe(duplex=False)
        p = ctx.Process(
            target=_worker_main, args=(spec, fn, tuple(args), dict(kwargs or {}), writer), name=f"ddptrain-rank{rank}"
        )
        p.start()
        writer.close()
        procs.append(p)
        readers[reader] = rank
    results: dict[int, Any] = {}
    failures: dict[int, WorkerFailedError] = {}
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    first_failure_at: float | None = None
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
                    "were killed. A rank may be stuck in a collective its peers never call."
                )
            limits = [
                t
                for t in (
                    None if deadline is None else deadline - now,
                    None if first_failure_at is None else first_failure_at + _FAILURE_GRACE_S - now,
                )
                if t is not None
            ]
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
            raise root_cause(failures)
        return [results[r] for r in range(world_size)]
    finally:
        _stop(procs)
        for reader in readers:
            reader.close()
