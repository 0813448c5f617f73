"""A config against the job that will run it, checked before any process starts.

:mod:`ddptrain.config` owns the schema and each field's own rule; this module owns what needs more
than one field and the job: how the global batch splits over the world size, the rules of every mode and
feature (each written by its owner: :mod:`ddptrain.modes`), which backend ``dist.backend=auto``
becomes, and whether this machine has the device asked for. Every refusal is a
:class:`~ddptrain.config.ConfigError` that names the knob and the fix. torch is imported only to
ask about CUDA.
"""

from __future__ import annotations

import os

from .config import Config, ConfigError, check_device_name, check_fields
from .modes import check_config, shares_unevenly

__all__ = [
    "validate",
    "per_rank_batch_size",
    "job_world_size",
    "resolve_backend",
    "check_device",
]


def validate(config: Config, world_size: int, local_world_size: int | None = 1) -> None:
    """Check the config against the job (``world_size`` ranks, ``local_world_size`` of them on
    this machine) before any process starts: every field's rule, every mode's and feature's
    rules, the batch split, the device. :func:`ddptrain.run` calls it once per job, in the
    process that starts the ranks (or in each rank, under an external launcher).
    ``local_world_size=None``: the device is checked elsewhere, where torch may be imported (the
    local launcher's checker process, or each rank as it joins).

    Raises:
        ConfigError: the first problem found, naming the knob and the fix.
    """
    check_fields(config)
    _positive("dist.world_size", world_size)  # the job's: an external launcher's wins over the key
    check_config(config, world_size)  # every mode's and feature's rules, each written by its owner
    per_rank_batch_size(config, world_size)
    if local_world_size is not None:
        check_device(config, local_world_size)


def job_world_size(config: Config, launcher_world_size: int | None) -> int:
    """The job's world size: the external launcher's (``launcher_world_size``; None: none), else
    ``dist.world_size``. An elastic job's is always ``dist.world_size``: there each host's
    launcher starts only its own workers, and the job's store joins them."""
    if launcher_world_size is None or config.trainer.elastic:
        return config.dist.world_size
    return launcher_world_size


def per_rank_batch_size(config: Config, world_size: int) -> int:
    """Samples per rank per micro-batch: the global batch split over ranks and accumulation steps.

    Raises:
        ConfigError: if the split is not exact, naming both numbers and the fix.
    """
    global_bs = config.data.global_batch_size
    accum = config.trainer.grad_accum_steps
    parts = world_size * accum
    if shares_unevenly(config):  # an elastic job's members, trainer.balance's weights: the largest even share
        return -(-global_bs // parts)
    if global_bs % parts:
        divisors = [d for d in range(1, min(global_bs, 64) + 1) if global_bs % (d * accum) == 0]
        what = (
            f"dist.world_size={world_size}"
            if accum == 1
            else f"dist.world_size={world_size} x trainer.grad_accum_steps={accum} = {parts}"
        )
        raise ConfigError(
            f"data.global_batch_size={global_bs} is not divisible by {what}: every rank must take the "
            f"same number of samples per step. Use a world size that divides it ({', '.join(map(str, divisors))}), "
            f"or set data.global_batch_size to a multiple of {parts} (e.g. {(global_bs // parts + 1) * parts})."
        )
    return global_bs // parts


def resolve_backend(config: Config, launcher_env: str = "local", master_addr: str | None = None) -> str:
    """The backend to use: ``dist.backend``, or for ``auto`` the one the device and launcher need."""
    backend = config.dist.backend
    if backend != "auto":
        return backend
    if config.trainer.device.startswith("cuda"):
        return "nccl"
    if launcher_env == "mpi" and not master_addr:
        return "mpi"  # mpirun gives ranks but no rendezvous address; MPI itself needs none
    return "gloo"


def check_device(config: Config, local_world_size: int = 1) -> None:
    """Refuse a device this machine does not have, saying what to use instead."""
    device = config.trainer.device
    if device == "cpu":
        if resolve_backend(config) == "nccl":
            raise ConfigError(
                "dist.backend=nccl needs trainer.device=cuda (NCCL moves CUDA tensors only); "
                "use dist.backend=gloo for CPU training"
            )
        return
    check_device_name(device)  # the field's rule: a script's fit() may not have run check_fields
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(
            "trainer.device=cuda but torch.cuda.is_available() is False on this machine "
            f"(torch {torch.__version__}, CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}). Train on CPU with "
            "trainer.device=cpu, or run on a machine with a GPU and a CUDA build of torch."
        )
    count = torch.cuda.device_count()
    if local_world_size > count and resolve_backend(config) == "nccl":
        raise ConfigError(
            f"{local_world_size} ranks on this machine but only {count} CUDA device(s), and NCCL refuses "
            f"two ranks on one GPU. Use dist.world_size<={count}, or dist.backend=gloo to let ranks "
            "share the GPUs (slower: gloo copies through host memory)."
        )


def _positive(key: str, value) -> None:
    if value is None or value < 1:
        raise ConfigError(f"{key}={value} must be at least 1")
