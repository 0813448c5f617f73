"""The one place that decides how a job's ranks start on this machine: spawned, or by ``mpiexec``.

MPI ranks must be wired up by MPI's own launcher, so ``backend="mpi"`` goes through ``mpiexec``
(:mod:`ddptrain.launch.mpi_launch`); every other backend, and none, spawns local processes
(:mod:`ddptrain.launch.spawn`). ``run_distributed``, the trainer's runner and users all come here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .env import threads_per_rank
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
