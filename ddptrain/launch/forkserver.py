"""A preloaded fork server: local workers start from a process that has imported torch already.

``import torch`` takes seconds; with the ``spawn`` start method every worker pays it again, after
the launcher paid it too. Instead the command line calls :func:`start` early (while Hydra checks
and composes the config), which spawns one server process; it imports torch and ddptrain's
trainer modules (:data:`PRELOAD`) and waits. When a job starts, :func:`fork_workers` hands it the
job: the server forks a short-lived *job leader*, which forks one worker per rank and exits.
Workers are then children of the launcher itself: the launcher is a Linux *child subreaper*
(``PR_SET_CHILD_SUBREAPER``) from the moment it hands a job over until that job's leader has
exited, so the leader's orphans are re-parented to it. Only then: a process that stayed a
subreaper would adopt (and, never waiting for them, keep as zombies) the orphans of every other
child it ever starts, such as a killed ``mpiexec``'s ranks. The launcher waits for the workers,
reads their exit status and kills them exactly as it does spawned workers
(``launcher -> server, rank 0, rank 1``; the server idles).

What a worker gets from the launcher at fork time, not from the server's start: the launcher's
whole ``os.environ`` (then its per-rank variables), ``sys.path``, ``sys.argv`` and working
directory. The server ignores Ctrl-C (SIGINT) and sits in a process group of its own, so a
terminal's Ctrl-C reaches the launcher only; it dies with the launcher (``PR_SET_PDEATHSIG``).

A job may say which modules it needs (``needs``): a server still preloading forks it as soon as
it has those. The launcher's checks before a job (:data:`CHECKS`) so run while the server imports
``torch._dynamo``, which only the workers need.

The server then waits for the launcher's next job: a restart after a failed rank
(``launcher.max_restarts``), the next point of a sweep, the next ``run_distributed`` of a test
suite. Each of those forks in a fraction of a second instead of importing torch again. The
server never runs a job's code, so every job forks from the same freshly preloaded state. It
ends when the launcher exits (or dies), or at :func:`discard`. Where it cannot work (not Linux,
no ``pidfd_open``) :func:`available` is False and the local launcher uses ``spawn``.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import importlib
import multiprocessing as mp
import os
import pickle
import signal
import sys
import time
from collections.abc import Sequence
from multiprocessing import reduction, resource_tracker
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_any
from typing import Any

__all__ = ["PRELOAD", "SERVER_NAME", "available", "start", "take", "discard", "fork_workers", "ForkedWorker"]

CHECKS = ("torch", "ddptrain.trainer.trainer", "ddptrain.runner", "ddptrain.recipes", "yaml", "logging.handlers")
"""What the launcher's checks before a job (:func:`ddptrain.runner.prepare_job`) import: they fork
as soon as the server has these, and run while it imports the rest of :data:`PRELOAD`."""
PRELOAD = (
    *CHECKS,
    "torch._dynamo",  # imported by the first optimizer step: 1.5 s of its own
    "torch.utils.tensorboard",
    "ddptrain.doctor",
)
"""Modules the server imports before it forks: what a local worker imports on its way to the first step."""
SERVER_NAME = "ddptrain-fsrv"
"""The idle server's process name (``ps -o comm``, ``/proc/PID/comm``), so tools can tell it from the
workers it forks; the workers keep the interpreter's own name."""
_PR_SET_PDEATHSIG, _PR_SET_NAME, _PR_SET_CHILD_SUBREAPER = 1, 15, 36
_REPARENT_WAIT_S = 30.0  # how long a new worker waits for the exiting job leader to hand it over

_server: _Server | None = None  # the idle server: started ahead of the next job, or kept from the last


def _prctl(option: int, value: int | bytes) -> bool:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, value) == 0
    except (OSError, AttributeError):
        return False


def _process_name() -> bytes:
    try:
        with open("/proc/self/comm", "rb") as comm:
            return comm.read().strip()
    except OSError:
        return b"python"


def available() -> bool:
    """Whether workers can be forked from a server here (Linux with ``pidfd_open``)."""
    return sys.platform.startswith("linux") and hasattr(os, "pidfd_open")


class _Server:
    """The server process and the launcher's end of its connection."""

    def __init__(self, preload: Sequence[str]):
        ctx = mp.get_context("spawn")
        self.conn, child_conn = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=_serve, args=(child_conn, tuple(preload)), name="ddptrain-forkserver")
        # Blocked across fork and exec, SIGINT cannot interrupt the server before it ignores it. The
        # resource tracker first: starting it unblocks SIGINT again, whatever the caller's mask was.
        resource_tracker.ensure_running()
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            self.process.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
        child_conn.close()
        # Before multiprocessing's own exit handler (atexit runs the later one first), which would
        # otherwise join the idle server forever.
        atexit.register(self.stop)

    def stop(self) -> None:
        """End the server now (it holds nothing worth a graceful exit)."""
        self.conn.close()
        if self.process.is_alive():  # reaps it if it has exited
            self.process.kill()
            self.process.join(5)


def start(preload: Sequence[str] = PRELOAD) -> None:
    """Start the server for the next local job, if none is idle and forking can work here."""
    global _server
    if _server is None and available():
        try:
            _server = _Server(preload)
        except OSError:
            _server = None


def take(preload: Sequence[str] = PRELOAD) -> _Server | None:
    """The idle server, else one started now preloading ``preload``; None where only ``spawn`` works.

    A job's workers then import what the idle server lacks of ``preload`` themselves."""
    global _server
    if _server is not None and not _server.process.is_alive():  # killed while idle
        _server.stop()
        _server = None
    start(preload)
    server, _server = _server, None
    if server is not None and not server.process.is_alive():
        server.stop()
        return None
    return server


def discard() -> None:
    """Stop the idle server (one a refused config or an ``mpiexec`` job never used, or the last
    job's); the next local job starts another."""
    global _server
    if _server is not None:
        _server.stop()
        _server = None


def fork_workers(
    server: _Server, jobs: Sequence[tuple[bytes, int]], needs: Sequence[str] | None = None
) -> list[ForkedWorker]:
    """Fork one worker per ``(payload, report_fd)`` from the server, which then idles as the
    server of the next job. ``payload`` is ``pickle.dumps((target, args))``: the worker calls
    ``target(*args, report_connection)``, the write end of its report pipe ``report_fd`` as a
    ``multiprocessing`` connection. ``needs``: the modules the workers need preloaded; a server
    still preloading forks them as soon as it has these (None: once it has its whole preload).

    Raises:
        OSError: the server died or refused (the caller stops it and falls back to ``spawn``).
    """
    context = {"environ": dict(os.environ), "path": list(sys.path), "argv": list(sys.argv), "cwd": os.getcwd()}
    if not _prctl(_PR_SET_CHILD_SUBREAPER, 1):
        raise OSError("prctl(PR_SET_CHILD_SUBREAPER) failed: forked workers could not be waited for")
    try:
        server.conn.send((context, os.getpid(), [payload for payload, _ in jobs], needs))
        for _, fd in jobs:
            reduction.send_handle(server.conn, fd, server.process.pid)
        if not server.conn.poll(60):
            raise OSError("the fork server did not answer within 60 s")
        answer = server.conn.recv()
    except (EOFError, BrokenPipeError, ConnectionError) as exc:
        _prctl(_PR_SET_CHILD_SUBREAPER, 0)
        server.stop()
        raise OSError(f"the fork server is gone: {exc}") from exc
    if isinstance(answer, BaseException):
        _prctl(_PR_SET_CHILD_SUBREAPER, 0)
        raise OSError(f"the fork server could not fork the workers: {answer}")
    leader, pids = answer
    # Once the leader has exited, its workers are this process's children: only then can they be
    # waited for, and only then may this process stop adopting orphans. (The server may have
    # reaped the leader already: then it has exited too.)
    handed_over = True
    with contextlib.suppress(ProcessLookupError):
        exited = os.pidfd_open(leader)
        try:
            handed_over = bool(wait_any([exited], 10))
        finally:
            os.close(exited)
    if handed_over:
        _prctl(_PR_SET_CHILD_SUBREAPER, 0)
    _keep(server)
    return [ForkedWorker(pid) for pid in pids]


def _keep(server: _Server) -> None:
    """Make ``server`` the idle one for the next job (stop it if another is idle already)."""
    global _server
    if _server is None and server.process.is_alive():
        _server = server
    else:
        server.stop()


class ForkedWorker:
    """A worker forked by the server, re-parented to this process: the parts of
    ``multiprocessing.Process`` the local launcher uses."""

    def __init__(self, pid: int):
        self.pid = pid
        self.sentinel = os.pidfd_open(pid)  # readable once the process has ended
        self.exitcode: int | None = None

    def _reap(self, block: bool) -> None:
        if self.exitcode is not None:
            return
        try:
            pid, status = os.waitpid(self.pid, 0 if block else os.WNOHANG)
        except ChildProcessError:  # reaped elsewhere: it has ended, how is unknown
            self.exitcode = 255
            return
        if pid:
            self.exitcode = os.waitstatus_to_exitcode(status)

    def is_alive(self) -> bool:
        self._reap(block=False)
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        if self.exitcode is None and wait_any([self.sentinel], timeout):
            self._reap(block=True)

    def close(self) -> None:
        """Release the pidfd (after the worker has ended and the watcher is done with it)."""
        with contextlib.suppress(OSError):
            os.close(self.sentinel)

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def _signal(self, signum: int) -> None:
        if self.exitcode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)


# -- inside the server -------------------------------------------------------------------------
def _serve(conn, preload: Sequence[str]) -> None:
    """The server's life: ignore Ctrl-C, preload, then fork a leader for each job it is given
    until the launcher closes the connection."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # also discards a Ctrl-C that arrived while blocked
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    os.setpgid(0, 0)
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:
        os._exit(0)  # the launcher died already
    worker_name = _process_name()
    _prctl(_PR_SET_NAME, SERVER_NAME.encode())
    early = None  # a job received while preloading, whose needs are not all imported yet
    for name in preload:
        with contextlib.suppress(Exception):  # a worker importing it for real reports the error
            importlib.import_module(name)
        if early is None and conn.poll():
            early = _receive(conn)
        if early is not None and early[3] is not None and all(m in sys.modules for m in early[3]):
            _fork_leader(conn, early, worker_name)
            early = None
    # The preloaded objects out of the collector's reach: a worker's first collection would
    # otherwise touch (and so copy) every page the fork shares with the server.
    gc.freeze()
    while True:
        job, early = early or _receive(conn), None
        _fork_leader(conn, job, worker_name)


def _receive(conn) -> tuple:
    """The launcher's next job: (context, launcher pid, payloads, needs, report fds)."""
    try:
        context, launcher_pid, payloads, needs = conn.recv()
        return context, launcher_pid, payloads, needs, [reduction.recv_handle(conn) for _ in payloads]
    except (EOFError, OSError):
        os._exit(0)  # no more jobs: the launcher stopped us, exited or died


def _fork_leader(conn, job: tuple, worker_name: bytes) -> None:
    """Fork the job's leader, which forks its workers; return once it has exited."""
    context, launcher_pid, payloads, _, fds = job
    try:
        leader = os.fork()
    except OSError as exc:
        conn.send(OSError(f"fork failed: {exc}"))
        leader = None
    if leader == 0:
        _prctl(_PR_SET_NAME, worker_name)
        _lead(conn, context, launcher_pid, payloads, fds)
    # The workers hold their report pipes' write ends; a copy left here would hide their death.
    for fd in fds:
        os.close(fd)
    if leader is not None:
        os.waitpid(leader, 0)  # it exits as soon as the workers are forked


def _lead(conn, context: dict, launcher_pid: int, payloads: list, fds: list[int]) -> None:
    """In the job leader (a fork of the server): fork the workers, send their pids, exit."""
    pids = []
    # A worker must not inherit the server's SIG_IGN for Ctrl-C: an ignored signal is discarded, so
    # one the launcher passes on before the worker installs its handler would be lost (the job would
    # run on). Blocked instead, it waits until the worker's handler is in place (spawn._worker_main).
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        for rank, payload in enumerate(payloads):
            pid = os.fork()
            if pid == 0:
                signal.signal(signal.SIGINT, signal.SIG_DFL)  # still blocked: pending, not acted on
                _become_worker(conn, context, launcher_pid, payload, fds, rank)
            pids.append(pid)
        conn.send((os.getpid(), pids))
    except BaseException as exc:  # noqa: BLE001 - the launcher must hear why, then kills what started
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)  # reaped here: an orphan zombie would go to the launcher, who never waits for it
        with contextlib.suppress(OSError):  # a broken pipe: the launcher is gone (a Ctrl-C), nobody to tell
            conn.send(OSError(f"{type(exc).__name__}: {exc}"))
    os._exit(0)


def _become_worker(conn, context: dict, launcher_pid: int, payload: Any, fds: list[int], rank: int) -> None:
    """In the forked worker: drop the server's state, wait to be the launcher's child, run, exit."""
    code = 1
    try:
        conn.close()
        for i, fd in enumerate(fds):
            if i != rank:
                os.close(fd)
        deadline = time.monotonic() + _REPARENT_WAIT_S
        while os.getppid() != launcher_pid:  # the leader is still exiting
            if time.monotonic() > deadline:
                os._exit(1)
            time.sleep(0.001)
        os.environ.clear()
        os.environ.update(context["environ"])
        sys.path[:] = context["path"]
        sys.argv[:] = context["argv"]
        os.chdir(context["cwd"])
        target, args = pickle.loads(payload)  # here: the user's modules import from the job's sys.path
        target(*args, Connection(fds[rank], readable=False))
        code = 0
    finally:
        os._exit(code)
