"""Joining the job's process group from inside a rank: the rendezvous its launcher calls for.

A process that trains is one rank of a job. :func:`join_process_group` finds out who started it
(:func:`ddptrain.launch.env.detect_environment`), picks this rank's device and torch thread
count, and joins the default process group the way that launcher expects:

* nothing detected (a plain ``python script.py``): a job of one, on a free local port, so the
  same code runs unchanged on a laptop;
* ``backend="mpi"``: MPI wires the ranks itself (no address needed);
* ``torchrun``: ``env://``, because torchrun's agent already serves the store on ``MASTER_PORT``;
* any other launcher (our local spawner's children, mpirun with ``gloo``, SLURM):
  ``tcp://MASTER_ADDR:MASTER_PORT``.

A group that already exists (``ddptrain.testing.run_distributed``, a user's own
``init_process_group``) is reused, and then left alone at the end: :meth:`Membership.leave`
destroys only a group this call created.

This module knows processes and process groups only: it never imports the trainer or Hydra.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import comm as dist
from ..comm.process_group import ProcessGroup
from .env import ClusterEnvironment, detect_environment, threads_per_rank

__all__ = ["Membership", "RendezvousError", "claim_device", "join_process_group", "rendezvous_for"]


class RendezvousError(ValueError):
    """The launcher started this rank without saying where the ranks meet."""


@dataclass(frozen=True)
class Membership:
    """This process's place in the job, as :func:`join_process_group` found or made it.

    Attributes:
        process_group: the default group (``ddptrain.comm.get_process_group()``).
        device: where this rank computes: the CPU, or ``cuda:{local_rank}``.
        environment: what the launcher said (ranks, rendezvous point).
        created: True if :func:`join_process_group` created the group (and :meth:`leave` ends it).
    """

    process_group: ProcessGroup
    device: torch.device
    environment: ClusterEnvironment
    created: bool

    @property
    def rank(self) -> int:
        return self.process_group.rank()

    @property
    def world_size(self) -> int:
        return self.process_group.size()

    @property
    def local_rank(self) -> int:
        return self.environment.local_rank

    def leave(self) -> None:
        """Destroy the default group if joining created it; a reused group is its owner's to end."""
        if self.created and dist.is_initialized():
            dist.destroy_process_group()


def rendezvous_for(environment: ClusterEnvironment, backend: str) -> tuple[str | None, int, int]:
    """How to meet the other ranks of ``environment``'s job: ``(init_method, world_size, rank)``.

    ``-1`` leaves the number to the init method or backend (``env://`` and MPI read their own);
    ``init_method`` is ``None`` for MPI, which needs none.

    Raises:
        RendezvousError: a launcher that gives ranks but no rendezvous address, naming the
            variables to set (or ``dist.backend=mpi``, which needs none).
    """
    if not environment.is_launched_externally():
        from . import find_free_port  # a job of one: any free port will do

        return f"tcp://127.0.0.1:{find_free_port()}", 1, 0
    if backend == "mpi":
        return None, -1, -1
    if environment.name == "torchrun":
        # env://, not tcp://: under torchrun the agent already serves the store on MASTER_PORT
        # and the comm layer joins it as a client (TORCHELASTIC_USE_AGENT_STORE).
        return "env://", -1, -1
    if environment.master_addr is None or environment.master_port is None:
        raise RendezvousError(
            f"the {environment.name} launcher gave no rendezvous address: set MASTER_ADDR and "
            "MASTER_PORT for every rank (mpirun -x MASTER_ADDR=<host of rank 0> -x "
            "MASTER_PORT=29500), or use dist.backend=mpi"
        )
    return f"tcp://{environment.master_addr}:{environment.master_port}", environment.world_size, environment.rank


def claim_device(env: ClusterEnvironment, device_type: str, threads_per_worker: int | None) -> torch.device:
    """This rank's device (the CPU, or ``cuda:{local_rank % device_count}``, made current before
    NCCL starts: one GPU per rank, unless there are more local ranks than GPUs, which gloo and mpi
    allow and preflight refuses for nccl) and its torch thread count (see :func:`join_process_group`)."""
    if device_type == "cuda":
        device = torch.device("cuda", env.local_rank % torch.cuda.device_count())
    else:
        device = torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(threads_per_rank(env.local_world_size, threads_per_worker))
    return device


def join_process_group(
    backend: str,
    *,
    device_type: str = "cpu",
    timeout_s: float,
    init_timeout_s: float | None = None,
    threads_per_worker: int | None = None,
    environment: ClusterEnvironment | None = None,
) -> Membership:
    """Join (or reuse) the job's default process group; set this rank's device and threads.

    Args:
        backend: ``gloo``, ``nccl`` or ``mpi`` (used only when a group has to be created).
        device_type: ``cpu``, or ``cuda`` for ``cuda:{local_rank}`` (made current before NCCL
            starts, so each rank talks from its own GPU).
        timeout_s: timeout of the group's operations.
        init_timeout_s: how long to wait for every rank at the rendezvous (default ``timeout_s``).
        threads_per_worker: torch intra-op threads; ``None``/0 shares this machine's usable
            cores among its ranks (:func:`ddptrain.launch.env.threads_per_rank`).
        environment: the launcher's environment (default: :func:`detect_environment`).

    Returns:
        A :class:`Membership`; call its ``leave()`` when done.

    Raises:
        RendezvousError: see :func:`rendezvous_for`.
        ValueError: an inconsistent launcher environment (from :func:`detect_environment`).
    """
    env = detect_environment() if environment is None else environment
    device = claim_device(env, device_type, threads_per_worker)
    created = not dist.is_initialized()
    if created:
        init_method, world_size, rank = rendezvous_for(env, backend)
        dist.init_process_group(backend, init_method, timeout_s, world_size, rank, init_timeout=init_timeout_s)
    return Membership(dist.get_process_group(), device, env, created)
