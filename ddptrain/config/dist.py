"""``dist.*`` and ``launcher.*``: processes, communication and how the ranks start (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .schema import ConfigError, bounded, checked, one_of

__all__ = ["DistConfig", "LauncherConfig", "DEFAULT_BUCKET_CAP_MB"]

# DDP's gradient bucket size when none is given (torch's too); dist.bucket_cap_mb=auto starts
# here and tunes from it. Owned here because the config must be read before torch is imported.
DEFAULT_BUCKET_CAP_MB = 25.0


def _check_bucket_cap(key: str, cap: Any, _dist: Any = None) -> None:
    """``dist.bucket_cap_mb``'s rule, which no bound states: a number of MiB >= 0, or ``auto``."""
    if cap == "auto":
        return
    try:
        ok = not isinstance(cap, bool) and float(cap) >= 0
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ConfigError(f"{key}={cap!r} must be a number of MiB >= 0, or auto (tuned in the first steps)")


@dataclass
class DistConfig:
    """Processes and communication."""

    world_size: int = bounded(2, at_least=1)
    """Local worker processes started by ``launcher=local``. Ignored under torchrun, mpirun or
    srun: the external launcher's world size wins."""
    backend: str = one_of("auto", ("auto", "gloo", "nccl", "mpi"))
    """``gloo`` (CPU), ``nccl`` (CUDA), ``mpi``, or ``auto``: nccl when ``trainer.device`` is
    cuda, mpi under mpirun without ``MASTER_ADDR``, else gloo."""
    timeout_s: float = bounded(300.0, above=0)
    """Timeout of every training collective: a rank stuck longer fails the job (naming the
    operation and the ranks that never arrived) instead of hanging it."""
    init_timeout_s: float = bounded(1800.0, above=0)
    """Timeout of the rendezvous: how long ranks wait for each other at start (schedulers and
    cold nodes can be slow, so this is longer than ``timeout_s``)."""
    algorithm: str = one_of("native", ("native", "ring"))
    """How DDP all-reduces its buckets: ``native`` (the backend's own all-reduce) or ``ring``
    (ddptrain's ring over point-to-point messages, on any backend)."""
    job_timeout_s: float | None = None
    """Local launcher only: kill the whole job after this many seconds (``None``: no limit)."""
    min_world_size: int = bounded(1, at_least=1)
    """Elastic jobs (``trainer.elastic``): the fewest ranks training goes on with. Below it the
    members left write a checkpoint and stop (exit status 1), printing the command that resumes."""
    elastic_store: str | None = None
    """Elastic jobs started by another launcher (torchrun or srun on each host): the job's store as
    ``HOST:PORT``, served by ``python -m ddptrain.store`` on one host; it outlives every rank.
    ``None``: the local launcher serves it (one host)."""
    threads_per_worker: int = bounded(0, at_least=0)
    """torch intra-op threads per rank; 0 means ``cores // ranks on this machine`` (at least 1)."""
    bucket_cap_mb: Any = checked(_check_bucket_cap, "MiB >= 0 or auto", default=DEFAULT_BUCKET_CAP_MB)
    """DDP gradient bucket size in MiB, or ``auto``: time a few sizes during the first steps
    (every rank the same), keep the fastest and log the choice (``ddptrain.doctor.autotune``)."""
    find_unused_parameters: bool = False
    """Let DDP handle parameters that get no gradient in some iterations (slower)."""
    gradient_as_bucket_view: bool = False
    """Make gradients views into DDP's buckets (saves one copy and memory)."""
    broadcast_buffers: bool = True
    """Broadcast rank 0's buffers (e.g. BatchNorm statistics) before every forward."""
    grad_compression: str = one_of("none", ("none", "bf16", "fp16"))
    """Send the gradients across ranks in half precision (half the bytes): ``bf16`` or ``fp16``,
    as torch DDP's ``bf16_compress_hook``/``fp16_compress_hook`` (and Lightning's or Accelerate's
    comm-hook option) do: each bucket is divided by the world size, cast, summed and cast back.
    Under ZeRO the reduce-scatter travels in that dtype; the parameters never do. ``none``: the
    gradients' own dtype. The sum loses precision (bf16 keeps 8 bits of mantissa): compare the
    loss curve with ``none`` before relying on it."""
    zero_stage: int = one_of(0, (0, 1, 2))
    """Shard the optimizer over the ranks (ZeRO, ``docs/zero.md``): ``0`` plain DDP; ``1`` each
    rank keeps the optimizer state of one ``1/world_size`` shard of every gradient bucket (buckets
    are reduce-scattered, the shard stepped, the parameters all-gathered); ``2`` also keeps only
    that shard's gradients after backward (and two bucket-sized buffers it reuses). With
    ``dist.algorithm=ring`` the parameters equal plain
    ring DDP's bit for bit. Needs an element-wise optimizer (SGD, Adam, AdamW, ...); checkpoints
    stay in the plain format, loadable at any world size."""
    sync: str = one_of("every_step", ("every_step", "local_sgd", "diloco"))
    """How often the ranks' models meet (``docs/slow-links.md``). ``every_step``: DDP, the
    gradients all-reduced in every backward. ``local_sgd``: each rank steps its own copy of the
    model with the configured optimizer on its own samples, and every ``dist.sync_every`` steps
    the copies are averaged. ``diloco`` (Douillard et al., 2023): the same local steps, then an
    outer Nesterov SGD step (``dist.outer_lr``, ``dist.outer_momentum``) on the averaged
    pseudo-gradient ``theta_outer - mean(theta_local)``. Both send one model-sized all-reduce per
    ``sync_every`` steps instead of one per step; a stop (signal, ``should_stop``, ``max_time``)
    waits for the next outer step. ``dist.grad_compression`` casts what travels (the
    pseudo-gradients) to half precision."""
    sync_every: int = bounded(16, at_least=1)
    """``local_sgd`` / ``diloco``: optimizer steps between two outer steps (H); an outer step
    comes after every step whose number is a multiple of H, and after the last step of the fit."""
    outer_lr: float = bounded(0.7, above=0)
    """``diloco``: the outer Nesterov SGD's learning rate (the DiLoCo paper's 0.7)."""
    outer_momentum: float = bounded(0.9, at_least=0)
    """``diloco``: the outer Nesterov SGD's momentum (the DiLoCo paper's 0.9)."""


@dataclass
class LauncherConfig:
    """How the ranks start."""

    name: str = one_of("local", ("local", "torchrun", "mpirun"))
    """``local``: spawn ``dist.world_size`` workers here (through ``mpiexec`` when the backend is
    ``mpi``), unless an external launcher already started this process (then this process is one
    rank). ``torchrun`` / ``mpirun``: require that launcher's environment and fail with the
    command to use otherwise."""
    max_restarts: int = bounded(0, at_least=0)
    """Local launcher: when a worker dies, restart the whole job up to this many times, resuming
    from the last checkpoint (``trainer.resume=latest`` in the same output directory). Under
    torchrun use ``torchrun --max-restarts=N``: the job resumes the same way. With
    ``trainer.elastic=true`` only the dead worker is restarted (up to N times in the whole job),
    and it rejoins the others; nothing is read from disk."""
    spares: int = bounded(0, at_least=0)
    """Elastic jobs (``trainer.elastic``), local launcher: start this many workers more than
    ``dist.world_size``. They load their data and wait; when a member is lost, one takes its place
    at once (no process start), and a restarted worker becomes the next spare."""
