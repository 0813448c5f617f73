"""Run a function on N local worker processes — ddptrain's local launcher.

The parent picks a free port on the loopback address, gives every worker its ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``, and watches them all. If one
worker fails (raises, is killed by a signal, exits non-zero) the others are stopped at once and
:class:`WorkerFailedError` names the rank and carries its traceback; a job that outlives
``timeout_s`` is killed with :class:`LaunchTimeoutError`. Nothing is left running either way.

Workers are forked from a preloaded server (:mod:`ddptrain.launch.forkserver`: torch is imported
once, before the job, not once per worker), or use the ``spawn`` start method where that cannot
work (``start_method="spawn"``, or not Linux). Either way ``fn`` and its arguments must be
picklable (a module level function, not a lambda), and each worker sees this process's
``os.environ``, ``sys.path`` and working directory as they are when the job starts. A stop
signal that reaches a worker before its trainer handles signals ends it quietly, and the job
raises :class:`ddptrain.launch.signals.StoppedBySignal`. Most callers want
:func:`ddptrain.launch.launch`, which also starts ``backend="mpi"`` ranks through ``mpiexec``.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import pickle
import signal
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from multiprocessing import resource_tracker
from multiprocessing.connection import wait as wait_any
from typing import Any

from . import forkserver
from .failures import (
    LaunchTimeoutError,
    WorkerFailedError,
    capture,
    decode_outcome,
    describe_exitcode,
    failure_from_report,
    failure_without_report,
    root_cause,
)
from .signals import SignalForwarder, StoppedBySignal, die_with_parent, exit_on_stop_signals
from .worker import report, run_rank

# The errors and describe_exitcode live in .failures; they stay importable from here too (cli.py,
# tests/e2e/test_faults_oom.py import them from this module).
__all__ = [
    "spawn_workers",
    "spawn_elastic",
    "find_free_port",
    "WorkerFailedError",
    "LaunchTimeoutError",
    "describe_exitcode",
]

_log = logging.getLogger("ddptrain.launch")

# After the first failure, how long the other workers may still report theirs: a rank that
# raises usually breaks its peers' connections, and the launcher must blame the cause, not them.
_FAILURE_GRACE_S = 1.0


def find_free_port(host: str = "127.0.0.1") -> int:
    """Ask the OS for a port that is free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def spawn_workers(
    fn: Callable,
    world_size: int,
    args: Sequence = (),
    kwargs: dict | None = None,
    *,
    threads: int,
    group_backend: str | None = None,
    timeout_s: float | None = None,
    comm_timeout_s: float | None = None,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    env: dict | None = None,
    start_method: str = "forkserver",
    needs: Sequence[str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` local worker processes.

    Args:
        fn: a picklable function; its return value (picklable) is collected per rank.
        threads: torch intra-op threads (and ``OMP_NUM_THREADS``) of each worker.
        group_backend: if set (``"gloo"``...), each worker joins the default ddptrain process
            group before ``fn`` and leaves it after.
        timeout_s: overall limit for the job; ``None`` waits as long as workers make progress.
        comm_timeout_s: timeout of rendezvous and collectives inside workers (default: 30 min).
        master_port: default: a free port chosen here.
        env: extra environment variables for every worker.
        start_method: ``"forkserver"`` (fork from the preloaded server, the default; ``spawn``
            where it cannot work) or ``"spawn"``.
        needs: the modules the workers need the fork server to have imported. A server still
            preloading forks them as soon as it has these, while it imports the rest; ``None``
            waits for its whole preload.

    Returns:
        The list of ``fn``'s return values, indexed by rank.

    Raises:
        WorkerFailedError: the worker whose failure started it, with its traceback.
        LaunchTimeoutError: the job outlived ``timeout_s``.
        StoppedBySignal: SIGINT or SIGTERM reached the workers before they could stop cleanly.
    """
    if start_method not in ("forkserver", "spawn"):
        raise ValueError(f"start_method={start_method!r}: use 'forkserver' or 'spawn'")
    port = master_port or find_free_port(master_addr)
    specs = [
        _WorkerSpec(
            r,
            world_size,
            _worker_env(r, world_size, master_addr, port, threads, env),
            group_backend,
            comm_timeout_s,
            threads,
        )
        for r in range(world_size)
    ]
    jobs = [(spec, fn, tuple(args), dict(kwargs or {})) for spec in specs]
    procs: list = []
    readers: dict = {}  # the read end of each worker's report pipe -> its rank
    try:
        # Where no server is idle (none started ahead, none kept from an earlier job), one starts now,
        # preloading torch and fn's module, which every worker imports first anyway, and
        # torch._dynamo, which building any torch optimizer imports (over a second of CPU per
        # worker otherwise; the server is kept for the next job: sweeps, restarts, test suites).
        # The rest of the command line's full preload would delay the job more than it saves.
        server = forkserver.take(_light_preload(fn)) if start_method == "forkserver" else None
        procs, readers = _fork(server, jobs, needs) if server is not None else ([], {})
        if not procs:
            procs, readers = _spawn(jobs)
        with SignalForwarder(lambda: [p.pid for p in procs if p.is_alive()]) as forwarder:
            try:
                return _Watcher(procs, readers, timeout_s).collect()
            except WorkerFailedError as exc:
                if forwarder.received and exc.exitcode in (128 + signal.SIGINT, 128 + signal.SIGTERM):
                    raise StoppedBySignal(forwarder.received) from None  # they were still starting
                raise
    finally:
        _stop(procs)
        for reader in readers:
            reader.close()
        for proc in procs:
            if isinstance(proc, forkserver.ForkedWorker):
                proc.close()


def _light_preload(fn: Callable) -> tuple[str, ...]:
    """What a server started for ``fn``'s job preloads: torch, ``torch._dynamo`` (which building
    any torch optimizer imports) and ``fn``'s module (unless it is the main script)."""
    return ("torch", "torch._dynamo", *([fn.__module__] if fn.__module__ not in ("__main__", "__mp_main__") else []))


def _fork(server, jobs: Sequence[tuple], needs: Sequence[str] | None) -> tuple[list, dict]:
    """Fork the workers from the preloaded ``server``; nothing (then spawn them) if it failed."""
    try:
        payloads = [pickle.dumps((_worker_main, job)) for job in jobs]  # a lambda fails here, as with spawn
    except BaseException:
        server.stop()
        raise
    pipes = [os.pipe() for _ in jobs]
    try:
        procs = forkserver.fork_workers(server, [(p, w) for p, (_, w) in zip(payloads, pipes)], needs)
    except BaseException as exc:
        server.stop()
        for r, w in pipes:
            os.close(r)
            os.close(w)
        if isinstance(exc, OSError):
            _log.warning("%s; starting the workers with spawn instead (slower: each imports torch)", exc)
            return [], {}
        raise
    for _, w in pipes:
        os.close(w)  # the worker holds the only write end: its death reads as EOF
    return procs, {mp.connection.Connection(r, writable=False): rank for rank, (r, _) in enumerate(pipes)}


def _spawn(jobs: Sequence[tuple]) -> tuple[list, dict]:
    """Start the workers with the ``spawn`` start method."""
    ctx = mp.get_context("spawn")
    procs, readers = [], {}
    for spec, fn, args, kwargs in jobs:
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_worker_main, args=(spec, fn, args, kwargs, writer), name=f"ddptrain-rank{spec.rank}")
        # Blocked across fork and exec: a Ctrl-C cannot interrupt the worker before its handler is in.
        # (The resource tracker first: starting it unblocks SIGINT again.)
        resource_tracker.ensure_running()
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            proc.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
        writer.close()
        procs.append(proc)
        readers[reader] = spec.rank
    return procs, readers


def _worker_env(rank: int, world_size: int, master_addr: str, port: int, threads: int, extra: dict | None) -> dict:
    """The ``env://`` variables of one worker (all on this machine), then the caller's ``extra``."""
    return {
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_RANK": "0",
        "OMP_NUM_THREADS": str(threads),
        **(extra or {}),
    }


@dataclass
class _WorkerSpec:
    rank: int
    world_size: int
    env: dict
    group_backend: str | None
    comm_timeout_s: float | None
    threads: int


def _worker_main(spec: _WorkerSpec, fn: Callable, args: Sequence, kwargs: dict, conn) -> None:
    # A group of its own: a terminal's Ctrl-C reaches the launcher only, which passes it on once.
    os.setpgid(0, 0)
    exit_on_stop_signals()  # until the trainer takes SIGINT/SIGTERM over
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    parent = os.getppid()
    die_with_parent()  # a launcher killed outright leaves no worker behind
    if os.getppid() != parent:
        os._exit(1)  # it died before the line above took effect
    os.environ.update(spec.env)
    body = partial(
        run_rank,
        fn,
        spec.rank,
        spec.world_size,
        args,
        kwargs,
        threads=spec.threads,
        group_backend=spec.group_backend,
        comm_timeout_s=spec.comm_timeout_s,
    )
    report(capture(body), spec.rank, conn.send_bytes)
    conn.close()


class _Watcher:
    """Collects every worker's report or death, until all are in, the first failure's grace
    period is over, or the job's deadline passes."""

    def __init__(self, procs: Sequence[mp.Process], readers: dict, timeout_s: float | None):
        self.procs = procs
        self.timeout_s = timeout_s
        self.pending = dict(readers)  # report pipes not read yet -> rank
        self.sentinels = {p.sentinel: r for r, p in enumerate(procs)}  # processes not seen ending
        self.results: dict[int, Any] = {}
        self.failures: dict[int, WorkerFailedError] = {}  # in the order they were learnt
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.first_failure_at: float | None = None

    def collect(self) -> list[Any]:
        """``fn``'s results by rank; raises the root cause of any failure, or the timeout."""
        while len(self.results) + len(self.failures) < len(self.procs):
            now = time.monotonic()
            if self.first_failure_at is not None and now - self.first_failure_at >= _FAILURE_GRACE_S:
                break  # the others had their moment to report; stop them now
            if self.deadline is not None and now >= self.deadline:
                running = [r for r in range(len(self.procs)) if r not in self.results and r not in self.failures]
                raise LaunchTimeoutError(
                    f"the job did not finish within {self.timeout_s:g} s; rank(s) {running} still running "
                    "were killed. A rank may be stuck in a collective its peers never call."
                )
            for ready in wait_any(list(self.pending) + list(self.sentinels), timeout=self._wait_s(now)):
                self._on_ready(ready)
                if self.failures and self.first_failure_at is None:
                    self.first_failure_at = time.monotonic()
        if self.failures:
            raise root_cause(self.failures.values())
        return [self.results[r] for r in range(len(self.procs))]

    def _wait_s(self, now: float) -> float | None:
        """How long to wait for the next event: until the deadline or the end of the grace period."""
        limits = [
            t
            for t in (
                None if self.deadline is None else self.deadline - now,
                None if self.first_failure_at is None else self.first_failure_at + _FAILURE_GRACE_S - now,
            )
            if t is not None
        ]
        return min(limits) if limits else None

    def _on_ready(self, ready) -> None:
        """A report arrived, or a worker ended (then read the report it may have left)."""
        self._record(*_ended_worker(ready, self.pending, self.sentinels, self.procs))

    def _record(self, rank: int, payload: bytes | None) -> None:
        """File a worker's outcome: its result, its reported error, or how it died."""
        if rank in self.results or rank in self.failures:
            return
        if payload is None:
            proc = self.procs[rank]
            proc.join(5)
            self.failures[rank] = failure_without_report(rank, proc.pid, proc.exitcode, "the other ranks were stopped.")
            return
        outcome = decode_outcome(payload)
        if outcome.failed:
            self.failures[rank] = failure_from_report(rank, outcome)
        else:
            self.results[rank] = outcome.result


def _ended_worker(ready, readers: dict, sentinels: dict, procs) -> tuple[Any, bytes | None]:
    """``(worker, its report or None)`` for a ``ready`` report pipe, or for a ready process
    sentinel (the worker ended: read the report it may have left). ``readers`` and ``sentinels``
    map to workers, who are keys of ``procs``; the ready entry is removed."""
    if ready in readers:
        worker = readers.pop(ready)
        return worker, _read_report(ready)
    worker = sentinels.pop(ready)
    procs[worker].join()
    return worker, _leftover_report(readers, worker)


def _leftover_report(readers: dict, worker) -> bytes | None:
    """The report an ended ``worker`` may have left in its pipe, if its reader (removed from
    ``readers``, which maps readers to workers) was not read yet."""
    reader = next((rd for rd, w in readers.items() if w == worker), None)
    if reader is None:
        return None
    readers.pop(reader)
    return _read_report(reader) if reader.poll(0.5) else None


def _read_report(reader) -> bytes | None:
    """A worker's encoded outcome, or None if it died without one (EOF)."""
    try:
        return reader.recv_bytes()
    except (EOFError, OSError):
        return None


def _stop(procs: Sequence[mp.Process], grace_s: float = 3.0) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
            with contextlib.suppress(OSError):
                os.kill(p.pid, signal.SIGCONT)  # a stopped (SIGSTOP) worker acts on SIGTERM only once continued
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)


# -- elastic jobs ---------------------------------------------------------------------------------
def spawn_elastic(
    fn: Callable,
    world_size: int,
    args: Sequence = (),
    *,
    threads: int,
    max_restarts: int = 0,
    timeout_s: float | None = None,
    env: dict | None = None,
) -> list[Any]:
    """Run ``fn(slot, world_size, *args)`` on ``world_size`` local workers that form an elastic job
    (:mod:`ddptrain.comm.elastic`): a worker that dies does not stop the others.

    The job's store is a process of its own (``python -m ddptrain.store`` on a free loopback port),
    so it outlives every worker. Each worker finds it in ``DDPTRAIN_ELASTIC_STORE`` and its member
    id in ``DDPTRAIN_ELASTIC_ID`` (``<slot>.<attempt>``): ``ElasticMembership.from_environment()``.
    A worker that fails (raises, is killed, exits non-zero) is started again in its slot, as a
    newcomer with the next attempt's id, while restarts are left (``max_restarts`` for the whole
    job); then its slot stays empty and the others go on. Every worker ends when the launcher does.

    Returns:
        The results of the workers that finished, in slot order (a slot's last attempt).

    Raises:
        WorkerFailedError: no worker finished (the failure that started it).
        LaunchTimeoutError: the job outlived ``timeout_s``; every worker was killed.
    """
    import subprocess
    import sys

    # A session of its own: a terminal's Ctrl-C (to the foreground process group) must not stop the
    # store while the ranks still need it to stop cleanly; it ends with this launcher instead.
    store = subprocess.Popen(
        [sys.executable, "-m", "ddptrain.store", "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: die_with_parent(signal.SIGTERM),
    )
    watch = _ElasticWatch(fn, world_size, tuple(args), threads, max_restarts, timeout_s, dict(env or {}))
    try:
        line = store.stdout.readline()  # "ddptrain store: serving on 127.0.0.1:PORT"
        if not line.startswith("ddptrain store: serving on "):
            raise OSError(f"the elastic job's store did not start: {line!r} (exit {store.poll()})")
        watch.env["DDPTRAIN_ELASTIC_STORE"] = line.split()[-1]
        _log.info("elastic job: its store serves on %s (pid %d)", line.split()[-1], store.pid)
        for slot in range(world_size):
            watch.start(slot)
        with SignalForwarder(lambda: [p.pid for p in watch.procs.values() if p.is_alive()]) as forwarder:
            watch.forwarder = forwarder
            return watch.collect()
    finally:
        _stop(list(watch.procs.values()))
        for reader in watch.readers:
            reader.close()
        for proc in watch.procs.values():
            if isinstance(proc, forkserver.ForkedWorker):
                proc.close()
        store.terminate()
        store.wait(10)


_STRAGGLER_GRACE_S = 30.0
"""After the first worker of an elastic job finished, how long the others have to finish too. The
members of the last generation end within moments of each other, and a worker still waiting to be
admitted leaves once the job says it finished (``ElasticMembership.finish``); this is for one that
cannot hear it."""


class _ElasticWatch:
    """The workers of :func:`spawn_elastic`, each known by ``(slot, attempt)``."""

    def __init__(self, fn, world_size, args, threads, max_restarts, timeout_s, env):
        self.fn, self.world_size, self.args, self.threads = fn, world_size, args, threads
        self.restarts_left, self.timeout_s, self.env = max_restarts, timeout_s, env
        self.attempts = [0] * world_size
        self.procs: dict[tuple[int, int], Any] = {}
        self.readers: dict[Any, tuple[int, int]] = {}
        self.sentinels: dict[Any, tuple[int, int]] = {}
        self.results: dict[int, Any] = {}
        self.failures: list[WorkerFailedError] = []
        self.done: set[tuple[int, int]] = set()
        self.forwarder: SignalForwarder | None = None  # set while collecting: a stop signal ends restarts

    def start(self, slot: int) -> None:
        key = (slot, self.attempts[slot])
        extra = {**self.env, "DDPTRAIN_ELASTIC_ID": f"{slot}.{key[1]}"}
        host, port = self.env["DDPTRAIN_ELASTIC_STORE"].rsplit(":", 1)  # the rendezvous point is the store
        spec = _WorkerSpec(
            slot,
            self.world_size,
            _worker_env(slot, self.world_size, host, int(port), self.threads, extra),
            None,
            None,
            self.threads,
        )
        jobs = [(spec, self.fn, self.args, {})]
        server = forkserver.take(_light_preload(self.fn))  # the idle server, kept from the last start
        procs, readers = _fork(server, jobs, None) if server is not None else ([], {})
        if not procs:
            procs, readers = _spawn(jobs)
        self.procs[key] = procs[0]
        self.sentinels[procs[0].sentinel] = key
        _log.info("member %d.%d started (slot %d, pid %d)", slot, key[1], slot, procs[0].pid)
        for reader in readers:
            self.readers[reader] = key

    def collect(self) -> list[Any]:
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        ended_at = None  # when the first worker finished: the job is over
        while len(self.done) < len(self.procs):
            if self.results and ended_at is None:
                ended_at, self.restarts_left = time.monotonic(), 0
            if ended_at is not None and time.monotonic() - ended_at > _STRAGGLER_GRACE_S:
                self._end_stragglers()
                break
            if deadline is not None and deadline <= time.monotonic():
                raise LaunchTimeoutError(
                    f"the elastic job did not finish within {self.timeout_s:g} s; every worker was killed"
                )
            limits = [
                d for d in (deadline, None if ended_at is None else ended_at + _STRAGGLER_GRACE_S) if d is not None
            ]
            left = max(0.0, min(limits) - time.monotonic()) if limits else None
            for ready in wait_any(list(self.readers) + list(self.sentinels), timeout=left):
                self._ended(*_ended_worker(ready, self.readers, self.sentinels, self.procs))
        if not self.results:
            raise root_cause(self.failures)
        return [self.results[slot] for slot in sorted(self.results)]

    def _end_stragglers(self) -> None:
        """The job ended while these workers were not in it (a restarted worker waiting to be
        admitted): stop them, instead of leaving them to wait for a generation that never comes."""
        stragglers = [key for key in self.procs if key not in self.done]
        for slot, attempt in stragglers:
            _log.info("member %d.%d was not admitted before the job ended: stopped", slot, attempt)
        _stop([self.procs[key] for key in stragglers])
        self.done.update(stragglers)

    def _ended(self, key: tuple[int, int], payload: bytes | None) -> None:
        """A worker reported or died: file its result, or restart its slot (or leave it empty)."""
        if key in self.done:
            return
        self.done.add(key)
        slot, proc = key[0], self.procs[key]
        outcome = None if payload is None else decode_outcome(payload)
        if outcome is not None and not outcome.failed:
            self.results[slot] = outcome.result
            return
        member = f"member {slot}.{key[1]} (slot {slot}, pid {proc.pid})"
        if outcome is None:
            proc.join(5)
            failure = failure_without_report(slot, proc.pid, proc.exitcode, "the others go on.")
            why = f"{member} {describe_exitcode(proc.exitcode, proc.pid)}"
        else:
            failure = failure_from_report(slot, outcome)
            why = f"{member} failed: {outcome.error}"
        self.failures.append(failure)
        if self.forwarder is not None and self.forwarder.received:  # the job is stopping: nothing to rejoin
            _log.info("%s; the job is stopping (%s): not restarted", why, self.forwarder.received)
        elif self.restarts_left > 0:
            self.restarts_left -= 1
            self.attempts[slot] += 1
            _log.warning("%s; the others go on, and slot %d starts again as member %d.%d", why, slot, slot, key[1] + 1)
            self.start(slot)
        else:
            _log.warning("%s; the others go on without it (no restart left)", why)
