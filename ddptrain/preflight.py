"""A config against the job that will run it, checked before any process starts.

:mod:`ddptrain.config` owns the schema and each field's own rule; this module owns what needs more
than one field and the job: how the global batch splits over the world size, the rules
world-size-invariant mode adds, what ZeRO (``dist.zero_stage``), gradient compression and local
SGD / DiLoCo (``dist.sync``) cannot be combined with, which backend ``dist.backend=auto`` becomes,
and whether this machine has the device asked for. Every refusal is a
:class:`~ddptrain.config.ConfigError` that names the knob and the fix. torch is imported only to
ask about CUDA.
"""

from __future__ import annotations

import os

from .config import Config, ConfigError, check_fields, check_precision

__all__ = [
    "validate",
    "per_rank_batch_size",
    "job_world_size",
    "check_elastic",
    "resolve_backend",
    "check_device",
    "check_world_size_invariant",
    "check_zero_stage",
    "check_grad_compression",
    "check_sync",
]


def validate(config: Config, world_size: int) -> None:
    """Check the config against the job (world size, machine) before any process starts.

    Raises:
        ConfigError: the first problem found, naming the knob and the fix.
    """
    check_fields(config)
    _positive("dist.world_size", world_size)  # the job's: an external launcher's wins over the key
    check_precision(config.trainer.precision, config.trainer.device)
    check_world_size_invariant(config, world_size)  # first: its error names the rule that mode adds
    check_zero_stage(config)
    check_grad_compression(config)
    check_sync(config)
    check_elastic(config, world_size)
    per_rank_batch_size(config, world_size)
    check_device(config)


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
    if config.trainer.elastic:
        # Invariant mode cuts each global batch into shards by position, whoever computes them:
        # the members present share it unevenly; this is the largest share.
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


def check_world_size_invariant(config: Config, world_size: int) -> None:
    """World-size-invariant mode: the world size must divide ``trainer.virtual_ranks``; no
    ``drop_last``; nothing that measures DDP's buckets."""
    t = config.trainer
    if not t.world_size_invariant:
        return
    if t.virtual_ranks % world_size and not t.elastic:  # elastic: spread over whoever is present
        valid = [w for w in range(1, t.virtual_ranks + 1) if t.virtual_ranks % w == 0]
        raise ConfigError(
            f"trainer.world_size_invariant=true: the world size must divide trainer.virtual_ranks (W must "
            f"divide V), got dist.world_size={world_size} and trainer.virtual_ranks={t.virtual_ranks}. "
            f"Use dist.world_size in {valid}, or set trainer.virtual_ranks to a multiple of {world_size}"
        )
    if config.data.drop_last:
        raise ConfigError(
            "trainer.world_size_invariant=true takes every sample once (the last global batch may be "
            "short), so data.drop_last=true is refused: set data.drop_last=false"
        )
    conflicts = [
        (
            t.doctor,
            "trainer.doctor=true",
            "the doctor measures and predicts DDP's bucket all-reduces, and invariant mode sums the gradients "
            "exactly outside DDP's buckets (diagnose the same run without invariant mode)",
        ),
        (
            config.dist.bucket_cap_mb == "auto",
            "dist.bucket_cap_mb=auto",
            "the autotuner times DDP's buckets, and invariant mode sends none (one exact sum per step)",
        ),
    ]
    _refuse_conflicts("trainer.world_size_invariant=true", conflicts, "set trainer.world_size_invariant=false")


def check_zero_stage(config: Config) -> None:
    """Refuse what ZeRO (``dist.zero_stage=1|2``) cannot be combined with, saying why."""
    stage = config.dist.zero_stage
    if not stage:
        if config.trainer.checkpoint.sharded:
            raise ConfigError(
                "trainer.checkpoint.sharded=true writes each rank's shard of a ZeRO optimizer's state, and "
                "dist.zero_stage=0 has none (every rank holds the whole state): set dist.zero_stage=1 or 2, "
                "or drop trainer.checkpoint.sharded"
            )
        return
    t, d = config.trainer, config.dist
    conflicts = [
        (
            t.world_size_invariant,
            "trainer.world_size_invariant=true",
            "invariant mode sums exact integer gradients on the bare module, outside DDP's buckets, "
            "so there is no reduce-scatter to shard",
        ),
        (
            d.find_unused_parameters,
            "dist.find_unused_parameters=true",
            "a parameter without a gradient would still be stepped (with a zero gradient) in its shard, "
            "while plain DDP skips it",
        ),
        (
            d.gradient_as_bucket_view,
            "dist.gradient_as_bucket_view=true",
            "ZeRO keeps no full-size gradient for .grad to be a view of",
        ),
        (
            check_precision(t.precision, t.device) == "16-mixed",
            "trainer.precision=16-mixed",
            "its gradient scaler unscales and checks for inf in the optimizer's .grad, and under ZeRO "
            "each rank holds only its shard's gradients (use trainer.precision=bf16-mixed)",
        ),
        (
            d.bucket_cap_mb == "auto",
            "dist.bucket_cap_mb=auto",
            "the autotuner times all-reduces, and ZeRO reduce-scatters (give a size in MiB)",
        ),
    ]
    _refuse_conflicts(f"dist.zero_stage={stage}", conflicts, "train with dist.zero_stage=0")


def check_grad_compression(config: Config) -> None:
    """Refuse what ``dist.grad_compression=bf16|fp16`` cannot be combined with, saying why."""
    t, d = config.trainer, config.dist
    if d.grad_compression == "none":
        return
    conflicts = [
        (
            d.algorithm == "ring" and not d.zero_stage and d.sync == "every_step",
            "dist.algorithm=ring",
            "plain DDP sends its buckets either through the ring or through the compression hook, not "
            "both (under ZeRO, dist.zero_stage=1|2, the ring reduce-scatter does compress, and so does "
            "the outer step of dist.sync=local_sgd|diloco)",
        ),
        (
            t.world_size_invariant,
            "trainer.world_size_invariant=true",
            "invariant mode sums exact integer gradients, which half precision would round",
        ),
        (
            t.doctor,
            "trainer.doctor=true",
            "the doctor's model of a step predicts full-precision all-reduces",
        ),
    ]
    _refuse_conflicts(f"dist.grad_compression={d.grad_compression}", conflicts, "set dist.grad_compression=none")


def check_sync(config: Config) -> None:
    """Refuse what ``dist.sync=local_sgd|diloco`` cannot be combined with, saying why."""
    t, d = config.trainer, config.dist
    if d.sync == "every_step":
        return
    conflicts = [
        (
            t.world_size_invariant,
            "trainer.world_size_invariant=true",
            "invariant mode sums every step's gradients exactly over the ranks, and local steps sum none",
        ),
        (
            bool(d.zero_stage),
            f"dist.zero_stage={d.zero_stage}",
            "ZeRO shards the optimizer of one shared model, and local steps keep one model and optimizer per rank",
        ),
        (
            t.ema.decay is not None,
            "trainer.ema.decay",
            "the moving average would follow one rank's local copy, not the model the ranks agree on",
        ),
        (
            t.doctor,
            "trainer.doctor=true",
            "the doctor measures the gradient all-reduce of every step, and there is none "
            "(run it at dist.sync=every_step: it predicts the local options from there)",
        ),
        (
            d.bucket_cap_mb == "auto",
            "dist.bucket_cap_mb=auto",
            "the autotuner times the gradient all-reduces of the first steps, and there are none",
        ),
        (
            bool(t.check_sync_every_n_steps) and t.check_sync_every_n_steps % d.sync_every != 0,
            f"trainer.check_sync_every_n_steps={t.check_sync_every_n_steps}",
            f"the ranks' models agree only after an outer step (every dist.sync_every={d.sync_every} steps); "
            "use a multiple of it",
        ),
    ]
    _refuse_conflicts(f"dist.sync={d.sync}", conflicts, "set dist.sync=every_step")


def check_elastic(config: Config, world_size: int) -> None:
    """Refuse what ``trainer.elastic=true`` cannot be combined with, saying why. Which launcher
    may run it depends on what started the process: the runner checks that (``_check_elastic_launcher``)."""
    t, d = config.trainer, config.dist
    if not t.elastic:
        for key, value, unset in (
            ("dist.min_world_size", d.min_world_size, 1),
            ("launcher.spares", config.launcher.spares, 0),
            ("dist.elastic_store", d.elastic_store, None),
        ):
            if value != unset:
                raise ConfigError(
                    f"{key}={value} applies to elastic jobs only (a job that is not elastic stops at its first "
                    f"lost rank): set trainer.elastic=true, or drop {key}"
                )
        return
    conflicts = [
        (
            resolve_backend(config) == "mpi",
            "dist.backend=mpi",
            "an MPI job cannot lose a process: MPI ends the whole job when one rank dies",
        ),
        (
            t.lr_find or d.bucket_cap_mb == "auto",
            "trainer.lr_find / dist.bucket_cap_mb=auto",
            "their measurements span steps of one fixed group of ranks",
        ),
        (
            d.min_world_size > world_size,
            f"dist.min_world_size={d.min_world_size}",
            f"the job starts with {world_size} rank(s), fewer than that; use at most dist.min_world_size={world_size}",
        ),
        (
            t.smoke_check,
            "trainer.smoke_check=true",
            "its loss probe starts on the ranks present at the start, and a member that joins later has none",
        ),
        (
            bool(d.zero_stage),
            f"dist.zero_stage={d.zero_stage}",
            "each rank holds the only copy of its shard of the optimizer state, and a lost rank takes it along",
        ),
        (
            d.sync != "every_step",
            f"dist.sync={d.sync}",
            "the ranks' copies of the model differ between outer steps, and a lost rank takes its local "
            "steps along: the survivors hold no common state to redo them from",
        ),
        (
            config.data.drop_last,
            "data.drop_last=true",
            "the members present share each global batch by sample position and take every sample once "
            "(the epoch's last step may be short)",
        ),
    ]
    _refuse_conflicts("trainer.elastic=true", conflicts, "set trainer.elastic=false")


def _refuse_conflicts(setting: str, conflicts: list[tuple[bool, str, str]], way_back: str) -> None:
    """Raise for the first ``(on, what, why)`` of ``conflicts`` that is on: ``setting`` cannot be
    combined with ``what`` because ``why``; drop ``what``, or ``way_back``."""
    for on, what, why in conflicts:
        if on:
            raise ConfigError(
                f"{setting} cannot be combined with {what}: {why}. Drop {what.split('=')[0]}, or {way_back}."
            )


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
    if device != "cuda":
        raise ConfigError(
            f"trainer.device={device!r}: use 'cpu' or 'cuda' (each rank then takes "
            "cuda:{local_rank % device_count}; pick GPUs with CUDA_VISIBLE_DEVICES)"
        )
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
