"""Run a function on N local ranks started by ``mpiexec`` — the local launcher for ``backend="mpi"``.

MPI ranks must be wired up by MPI's own launcher, so :func:`ddptrain.launch.launch` (and
``run_distributed``) with ``backend="mpi"`` come here instead of spawning: the function and its
arguments are pickled to a job file, ``mpiexec -n N --oversubscribe python -m
ddptrain.launch.mpi_entry`` starts the ranks, and each rank writes its outcome (result, or error
with traceback; :class:`~ddptrain.launch.failures.WorkerOutcome`) to its own report file.

Failures behave as with the spawning launcher: a rank that raises ends the job (it exits
non-zero and mpiexec stops the others) and :class:`WorkerFailedError` names it with its traceback;
a rank killed by a signal is named from mpiexec's own report; a job past ``timeout_s`` is killed
with everything it started. As root, Open MPI's two ``OMPI_ALLOW_RUN_AS_ROOT*`` variables are set.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .failures import (
    LaunchTimeoutError,
    MpiexecNotFoundError,
    WorkerFailedError,
    WorkerOutcome,
    decode_outcome,
    failure_from_report,
    failure_without_report,
    root_cause,
)
from .signals import SignalForwarder, die_with_parent

_log = logging.getLogger("ddptrain.launch")

# Variables of other launchers: a rank must detect MPI, not a stale torchrun-like environment.
_FOREIGN_LAUNCH_VARS = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "TORCHELASTIC_RUN_ID",
)
# Open MPI's report of a rank that died by a signal, e.g. "prterun noticed that process rank 1
# with PID 123 on node n exited on signal 9 (Killed)."
_SIGNAL_REPORT = re.compile(r"process rank (\d+) with PID (\d+) .*?exited on\s+signal (\d+)", re.S)


def find_mpiexec() -> str:
    """The ``mpiexec`` next to this Python (the ``mpi`` extra's Open MPI), else on ``PATH``."""
    found = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")
    if found is None:
        raise MpiexecNotFoundError(
            "backend 'mpi' needs mpiexec: `pip install 'ddptrain[mpi]'` installs mpi4py and "
            "Open MPI (or install your cluster's MPI), or use backend 'gloo'"
        )
    return found


def mpiexec_environment(extra: dict | None = None) -> dict:
    """This process's environment, cleaned of other launchers' variables, ready for ``mpiexec``."""
    env = {k: v for k, v in os.environ.items() if k not in _FOREIGN_LAUNCH_VARS}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    # The ranks unpickle the function by reference: they need this process's import path.
    prefixes = tuple({sys.prefix, sys.base_prefix})
    paths = [os.getcwd()] + [p for p in sys.path if p and os.path.isdir(p) and not p.startswith(prefixes)]
    paths += [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env.update(extra or {})
    return env


def report_path(report_dir: str | Path, rank: int) -> Path:
    """Where rank ``rank`` of a job writes its encoded outcome."""
    return Path(report_dir) / f"rank{rank}.pkl"


def launch_under_mpiexec(
    fn: Callable,
    world_size: int,
    args: Sequence = (),
    kwargs: dict | None = None,
    *,
    threads: int,
    join_group: bool = True,
    timeout_s: float | None = None,
    comm_timeout_s: float | None = None,
    env: dict | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks started by ``mpiexec``.

    Args:
        threads: torch intra-op threads (and ``OMP_NUM_THREADS``) of each rank.
        join_group: join the default ddptrain group on backend ``"mpi"`` before ``fn`` (the
            trainer passes False: it joins by itself).
        timeout_s: overall limit for the job; ``None`` waits for mpiexec to end.
        comm_timeout_s: timeout of the ranks' collectives (default: 30 min).
        env: extra environment variables for every rank.

    Returns:
        ``fn``'s return values, indexed by rank.

    Raises:
        MpiexecNotFoundError: no mpiexec (the message gives the install command).
        WorkerFailedError: the rank whose failure started it, with its traceback or its signal.
        LaunchTimeoutError: the job outlived ``timeout_s``; every rank was killed.
    """
    mpiexec = find_mpiexec()
    with tempfile.TemporaryDirectory(prefix="ddptrain-mpi-") as tmp:
        job = Path(tmp) / "job.pkl"
        call = pickle.dumps(
            {
                "fn": fn,
                "args": tuple(args),
                "kwargs": dict(kwargs or {}),
                "group_backend": "mpi" if join_group else None,
                "comm_timeout_s": comm_timeout_s,
                "threads": threads,
            }
        )
        job.write_bytes(pickle.dumps({"main": _main_reference(call), "call": call}))
        entry = [sys.executable, "-m", "ddptrain.launch.mpi_entry", str(job), tmp]
        code, tail = _run_mpiexec(
            [mpiexec, "-n", str(world_size), "--oversubscribe", *entry],
            mpiexec_environment({"OMP_NUM_THREADS": str(threads), **(env or {})}),
            timeout_s,
            tmp,
            world_size,
        )
        reports = {
            r: decode_outcome(report_path(tmp, r).read_bytes())
            for r in range(world_size)
            if report_path(tmp, r).exists()
        }
    return _results_or_root_cause(reports, code, tail, world_size)


def _run_mpiexec(
    cmd: list[str], env: dict, timeout_s: float | None, report_dir: str, world_size: int
) -> tuple[int, str]:
    """Run ``cmd`` (mpiexec) to its end or ``timeout_s``, stopping everything it started either way;
    its exit code and the end of its stderr (which is also copied to ours)."""
    _log.info("starting %d rank(s): %s", world_size, " ".join(cmd))
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=_terminate_with_parent,
    )
    stderr_tail = _tee(proc.stderr)
    try:
        with SignalForwarder(lambda: _rank_pids(proc.pid)):  # mpiexec would kill the ranks: pass it to them
            code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        running = [r for r in range(world_size) if not report_path(report_dir, r).exists()]
        raise LaunchTimeoutError(
            f"the mpiexec job did not finish within {timeout_s:g} s; rank(s) {running} still running were "
            "killed. A rank may be stuck in a collective its peers never call."
        ) from None
    finally:
        _kill_tree(proc)
        stderr_tail.join(5)
    return code, stderr_tail.text()


def _results_or_root_cause(reports: dict[int, WorkerOutcome], code: int, tail: str, world_size: int) -> list[Any]:
    """Every rank's result if all succeeded; else raise the failure that started it: a reported
    error that is a cause, else a rank mpiexec saw die by a signal (its peers' timeouts, if any, are
    the consequence), else mpiexec's own failure."""
    failures = [failure_from_report(r, outcome) for r, outcome in sorted(reports.items()) if outcome.failed]
    if not failures and code == 0 and len(reports) == world_size:
        return [reports[r].result for r in range(world_size)]
    killed = _SIGNAL_REPORT.search(tail)
    if killed:
        rank, pid, signum = (int(g) for g in killed.groups())
        failures.append(failure_without_report(rank, pid, -signum, "mpiexec stopped the other ranks."))
    if failures:
        raise root_cause(failures)
    silent = [r for r in range(world_size) if r not in reports]
    raise WorkerFailedError(
        silent[0] if silent else -1,
        f"mpiexec exited with code {code} and rank(s) {silent} reported no result. "
        f"The end of mpiexec's output:\n{tail[-3000:]}",
        code,
    )


class _Tee(threading.Thread):
    """Copies mpiexec's stderr to ours line by line, keeping the last lines to explain a failure."""

    def __init__(self, stream):
        super().__init__(daemon=True, name="ddptrain-mpiexec-stderr")
        self.stream, self.lines, self.lock = stream, deque(maxlen=200), threading.Lock()

    def run(self):
        for raw in iter(self.stream.readline, b""):
            line = raw.decode(errors="replace")
            with self.lock:
                self.lines.append(line)
            sys.stderr.write(line)
        sys.stderr.flush()

    def text(self) -> str:
        with self.lock:
            return "".join(self.lines)


def _main_reference(call: bytes) -> tuple[str, str] | None:
    """How the ranks can import this program's ``__main__`` when the pickled call refers to it
    (a function, class or partial defined in the launching script), as multiprocessing's spawn
    does: ("module", name) for ``python -m pkg.mod``, ("file", path) for ``python script.py``."""
    if b"__main__" not in call:
        return None
    main = sys.modules["__main__"]
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name and spec.name != "__main__":
        return ("module", spec.name)
    path = getattr(main, "__file__", None)
    return ("file", os.path.abspath(path)) if path else None


def _terminate_with_parent() -> None:
    """In mpiexec's child process before exec: get SIGTERM (which mpiexec forwards to the ranks)
    if the launching process dies without cleaning up, e.g. killed by a scheduler."""
    die_with_parent(signal.SIGTERM)


def _tee(stream) -> _Tee:
    tee = _Tee(stream)
    tee.start()
    return tee


def _rank_pids(mpiexec_pid: int) -> list[int]:
    """The rank processes below mpiexec (not its daemons)."""
    ranks = []
    for pid in _descendants(mpiexec_pid):
        try:
            if b"ddptrain.launch.mpi_entry" in Path(f"/proc/{pid}/cmdline").read_bytes():
                ranks.append(pid)
        except OSError:
            continue
    return ranks


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (mpiexec's daemons and ranks), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill_tree(proc: subprocess.Popen, grace_s: float = 3.0) -> None:
    """Stop mpiexec and everything it started: SIGTERM (mpiexec forwards it), then SIGKILL."""
    if proc.poll() is None:
        victims = _descendants(proc.pid)
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
        for pid in [proc.pid, *victims]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(5)
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # stragglers left in mpiexec's session
    except (ProcessLookupError, PermissionError):
        pass
