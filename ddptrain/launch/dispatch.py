"""The one place that decides how a job's ranks start on this machine: spawned, or by ``mpiexec``.

MPI ranks must be wired up by MPI's own launcher, so ``backend="mpi"`` goes through ``mpiexec``
(:mod:`ddptrain.launch.mpi_launch`); every other backend, and none, spawns local processes
(:mod:`ddptrain.launch.spawn`). ``run_distributed``, the trainer's runner and users all come here.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from typing import Any

from .. import envvars
from .env import threads_per_rank
from .failures import WorkerFailedError
from .mpi_launch import launch_under_mpiexec
from .spawn import spawn_workers


def launch(
    fn: Callable,
    world_size: int,
    args: Sequence = (),
    kwargs: dict | None = None,
    *,
    backend: str | None = None,
    join_group: bool = True,
    timeout_s: float | None = None,
    comm_timeout_s: float | None = None,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    env: dict | None = None,
    threads_per_worker: int | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` processes of this machine.

    Args:
        fn: a picklable function (module level, not a lambda); its return value (picklable) is
            collected per rank.
        backend: the backend the ranks will talk over (``"gloo"``, ``"nccl"``, ``"mpi"``).
            ``"mpi"`` starts the ranks through ``mpiexec``; anything else spawns them.
        join_group: with a ``backend``, each rank joins the default ddptrain process group on it
            before ``fn`` and leaves it after. False: ``fn`` joins by itself (the trainer does).
        timeout_s: overall limit for the job; ``None`` waits as long as workers make progress.
        comm_timeout_s: timeout of rendezvous and collectives inside workers (default: 30 min).
        master_addr, master_port: the rendezvous point of spawned ranks (default port: a free
            one chosen here); ``mpiexec``'s ranks need none.
        env: extra environment variables for every rank.
        threads_per_worker: torch intra-op threads per rank (default: the usable cores shared
            by the ranks, :func:`ddptrain.launch.env.threads_per_rank`).

    Returns:
        The list of ``fn``'s return values, indexed by rank.

    Raises:
        WorkerFailedError: the rank whose failure started it, with its traceback (or its signal).
        LaunchTimeoutError: the job outlived ``timeout_s``; every rank was killed.
        MpiexecNotFoundError: ``backend="mpi"`` without an ``mpiexec`` (the message says how to get one).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    threads = threads_per_rank(world_size, threads_per_worker)
    with ledger_directory(env) as (env, directory):
        try:
            return _start(
                fn,
                world_size,
                args,
                kwargs,
                backend,
                join_group,
                timeout_s,
                comm_timeout_s,
                master_addr,
                master_port,
                env,
                threads,
            )
        except WorkerFailedError as exc:
            raise with_forensics(exc, directory) from exc.__cause__


@contextlib.contextmanager
def ledger_directory(env: dict | None):
    """(env, directory): the job's collective-ledger directory (:mod:`ddptrain.comm.ledger`), the
    caller's or ``DDPTRAIN_LEDGER_DIR``, else a temporary one removed after the job; meanwhile
    ``SIGUSR1`` to this launcher prints every rank's stack and ledger tail (the job goes on)."""
    env = dict(env or {})
    directory = env.get("DDPTRAIN_LEDGER_DIR") or envvars.get_str("DDPTRAIN_LEDGER_DIR")
    made = None
    if not directory:
        directory = made = tempfile.mkdtemp(prefix="ddptrain-ledger-")
        env["DDPTRAIN_LEDGER_DIR"] = directory
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGUSR1, lambda *_: print(_dump(directory), file=sys.stderr))
    try:
        yield env, directory
    finally:
        if previous is not None:
            signal.signal(signal.SIGUSR1, previous)
        if made:
            shutil.rmtree(made, ignore_errors=True)


def _dump(directory: str) -> str:
    # Imported when asked for: the ledger's reader needs torch, which the launcher otherwise never imports.
    from ..comm import forensics

    return forensics.dump(directory)


def with_forensics(exc: WorkerFailedError, directory: str) -> WorkerFailedError:
    """A rank that died of a signal (a backend's abort, the OOM killer, kill -9) reports nothing:
    add what the ledgers tell (the collective the ranks disagreed on, who was behind)."""
    if exc.worker_traceback or "Collective ledger:" in str(exc) or directory.lower() == "off":
        return exc
    from ..comm import forensics

    extra = forensics.explain_job(directory, stacks=False)
    if not extra:
        return exc
    return WorkerFailedError(exc.rank, f"{exc}{extra}", exc.exitcode, exc.worker_traceback)


def _start(
    fn, world_size, args, kwargs, backend, join_group, timeout_s, comm_timeout_s, master_addr, master_port, env, threads
) -> list[Any]:
    group_backend = backend if join_group else None
    if backend == "mpi":
        return launch_under_mpiexec(
            fn,
            world_size,
            args,
            kwargs,
            threads=threads,
            join_group=join_group,
            timeout_s=timeout_s,
            comm_timeout_s=comm_timeout_s,
            env=env,
        )
    return spawn_workers(
        fn,
        world_size,
        args,
        kwargs,
        threads=threads,
        group_backend=group_backend,
        timeout_s=timeout_s,
        comm_timeout_s=comm_timeout_s,
        master_addr=master_addr,
        master_port=master_port,
        env=env,
    )
