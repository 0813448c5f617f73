"""The configuration of a training run: nested dataclasses, one docstring per field.

The same tree comes from Hydra (``conf/``, through ``ddptrain.cli``) or from plain Python::

    config = Config.from_dict({"recipe": {"trainer_class": "ddptrain.recipes.mnist.MnistTrainer"},
                               "trainer": {"epochs": 1}})

:meth:`Config.from_dict` refuses unknown keys (suggesting the closest known one) and values of
the wrong type, naming the dotted key, so a typo never silently falls back to a default.
:func:`validate` checks what needs the world size (the global batch split) and the machine
(CUDA), with errors that name the knob to change. Nothing here imports Hydra.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ConfigError",
    "Config",
    "RecipeConfig",
    "DistConfig",
    "LauncherConfig",
    "DataConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "TrainerConfig",
    "DoctorConfig",
    "EarlyStoppingConfig",
    "validate",
    "check_precision",
    "PRECISIONS",
    "resolve_backend",
    "per_rank_batch_size",
    "check_device",
    "locate",
    "LAUNCHERS",
    "OPTIMIZERS",
    "SCHEDULERS",
]

LAUNCHERS = ("local", "torchrun", "mpirun")
PROGRESS_CHOICES = ("auto", "true", "false")
OPTIMIZERS = ("sgd", "adam", "adamw")
SCHEDULERS = ("none", "step", "cosine")
_BACKENDS = ("auto", "gloo", "nccl", "mpi")
MONITOR_MODES = ("min", "max")


# DDP's gradient bucket size when none is given (torch's too); dist.bucket_cap_mb=auto starts
# here and tunes from it. Owned here because the config must be read before torch is imported.
DEFAULT_BUCKET_CAP_MB = 25.0


class ConfigError(ValueError):
    """A configuration value is unknown, of the wrong type, or inconsistent with the job."""


@dataclass
class RecipeConfig:
    """Which Trainer runs the job."""

    name: str = "custom"
    """Recipe name, shown in logs (``recipe=mnist`` sets ``mnist``)."""
    trainer_class: str = "ddptrain.Trainer"
    """Dotted path of the ``ddptrain.Trainer`` subclass to run, e.g. ``ddptrain.recipes.mnist.MnistTrainer``."""


@dataclass
class DistConfig:
    """Processes and communication."""

    world_size: int = 2
    """Local worker processes started by ``launcher=local``. Ignored under torchrun, mpirun or
    srun: the external launcher's world size wins."""
    backend: str = "auto"
    """``gloo`` (CPU), ``nccl`` (CUDA), ``mpi``, or ``auto``: nccl when ``trainer.device`` is
    cuda, mpi under mpirun without ``MASTER_ADDR``, else gloo."""
    timeout_s: float = 300.0
    """Timeout of every training collective: a rank stuck longer fails the job (naming the
    operation and the ranks that never arrived) instead of hanging it."""
    init_timeout_s: float = 1800.0
    """Timeout of the rendezvous: how long ranks wait for each other at start (schedulers and
    cold nodes can be slow, so this is longer than ``timeout_s``)."""
    algorithm: str = "native"
    """How DDP all-reduces its buckets: ``native`` (the backend's own all-reduce) or ``ring``
    (ddptrain's ring over point-to-point messages, on any backend)."""
    job_timeout_s: float | None = None
    """Local launcher only: kill the whole job after this many seconds (``None``: no limit)."""
    threads_per_worker: int = 0
    """torch intra-op threads per rank; 0 means ``cores // ranks on this machine`` (at least 1)."""
    bucket_cap_mb: Any = DEFAULT_BUCKET_CAP_MB
    """DDP gradient bucket size in MiB, or ``auto``: time a few sizes during the first steps
    (every rank the same), keep the fastest and log the choice (``ddptrain.doctor.autotune``)."""
    find_unused_parameters: bool = False
    """Let DDP handle parameters that get no gradient in some iterations (slower)."""
    gradient_as_bucket_view: bool = False
    """Make gradients views into DDP's buckets (saves one copy and memory)."""
    broadcast_buffers: bool = True
    """Broadcast rank 0's buffers (e.g. BatchNorm statistics) before every forward."""

    def ddp_options(self) -> dict[str, Any]:
        """The keyword arguments of ``DistributedDataParallel`` that these settings choose."""
        return {
            "bucket_cap_mb": DEFAULT_BUCKET_CAP_MB if self.bucket_cap_mb == "auto" else float(self.bucket_cap_mb),
            "broadcast_buffers": self.broadcast_buffers,
            "find_unused_parameters": self.find_unused_parameters,
            "gradient_as_bucket_view": self.gradient_as_bucket_view,
        }


@dataclass
class LauncherConfig:
    """How the ranks start."""

    name: str = "local"
    """``local``: spawn ``dist.world_size`` workers here (through ``mpiexec`` when the backend is
    ``mpi``), unless an external launcher already started this process (then this process is one
    rank). ``torchrun`` / ``mpirun``: require that launcher's environment and fail with the
    command to use otherwise."""
    max_restarts: int = 0
    """Local launcher: when a worker dies, restart the whole job up to this many times, resuming
    from the last checkpoint (``trainer.resume=latest`` in the same output directory). Under
    torchrun use ``torchrun --max-restarts=N``: the job resumes the same way."""


@dataclass
class DataConfig:
    """Datasets and batches."""

    name: str = "mnist"
    """Dataset for the default ``Trainer.train_dataloader``: ``mnist``, ``fashion_mnist`` or ``synthetic``."""
    root: str | None = None
    """Data root (a writable cache); ``None`` means ``$DDPTRAIN_DATA``, else ``./data``."""
    download: bool = True
    """Download a dataset found nowhere locally (through torchvision), as the PyTorch tutorial
    does; ``false`` forbids it (offline machines, or to be sure which copy is used)."""
    global_batch_size: int = 128
    """Samples per optimizer step over all ranks; each rank takes
    ``global_batch_size / (world_size * trainer.grad_accum_steps)`` per micro-batch."""
    eval_batch_size: int = 1000
    """Evaluation batch size per rank."""
    num_workers: int = 0
    """DataLoader worker processes per rank (datasets held as tensors skip the DataLoader)."""
    preload: bool = True
    """Hold the datasets as tensors in memory and index them by batch (much faster than
    per-item transforms for MNIST-sized data)."""
    drop_last: bool = False
    """Cut the epoch's tail so ranks need no padding duplicates, instead of repeating samples."""
    num_train_samples: int = 10000
    """``synthetic`` only: training samples."""
    num_val_samples: int = 2000
    """``synthetic`` only: validation samples."""


@dataclass
class SchedulerConfig:
    """Learning-rate schedule, stepped once per optimizer step."""

    name: str = "none"
    """``none`` (constant), ``step`` (times ``gamma`` every ``step_size`` steps) or ``cosine``
    (down to ``min_lr_ratio * lr`` at the last step)."""
    warmup_steps: int = 0
    """Linear warm-up from ``lr / warmup_steps`` over this many steps (all schedules)."""
    step_size: int = 1000
    """``step`` only: optimizer steps between decays."""
    gamma: float = 0.1
    """``step`` only: decay factor."""
    min_lr_ratio: float = 0.0
    """``cosine`` only: final learning rate as a fraction of ``lr``."""


@dataclass
class OptimizerConfig:
    """Optimizer for the default ``Trainer.configure_optimizers``."""

    name: str = "sgd"
    """``sgd``, ``adam`` or ``adamw``."""
    lr: float = 0.01
    """Learning rate (the tutorial's 0.01)."""
    momentum: float = 0.5
    """``sgd`` only: momentum (the tutorial's 0.5)."""
    nesterov: bool = False
    """``sgd`` only: Nesterov momentum."""
    weight_decay: float = 0.0
    """Weight decay (L2 for sgd/adam, decoupled for adamw)."""
    betas: list = field(default_factory=lambda: [0.9, 0.999])
    """``adam``/``adamw`` only: coefficients of the running averages."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    """Learning-rate schedule."""


@dataclass
class EarlyStoppingConfig:
    """``trainer.early_stopping.*``: stop when a monitored metric stops improving (off by default)."""

    monitor: str | None = None
    """Metric to watch, e.g. ``eval/loss`` or a name given to ``self.log`` (``None``: no early stopping)."""
    mode: str = "min"
    """``min``: lower is better; ``max``: higher is better."""
    patience: int = 3
    """Checks without improvement before stopping (a check: each evaluation; each epoch end without one)."""
    min_delta: float = 0.0
    """An improvement must beat the best value by more than this."""


@dataclass
class TrainerConfig:
    """The training loop, evaluation, logging and checkpoints."""

    epochs: int = 10
    """Passes over the training set."""
    max_steps: int | None = None
    """Stop after this many optimizer steps in total (also the horizon of ``cosine``)."""
    stop_after_steps: int | None = None
    """Stop (and checkpoint) once this many optimizer steps are done, as if preempted; unlike
    ``max_steps`` it does not change the schedule, so a resumed run continues exactly."""
    grad_accum_steps: int = 1
    """Micro-batches per optimizer step; all but the last run under ``no_sync()``."""
    grad_clip_norm: float | None = None
    """Clip the global gradient norm to this value (``None``: no clipping)."""
    precision: str = "32"
    """``32``; ``bf16-mixed`` (bfloat16 autocast, CPU and CUDA); ``16-mixed`` (float16 autocast with a
    gradient scaler, CUDA only)."""
    seed: int = 1234
    """Base seed: rank ``r`` seeds with ``seed + r``; the sampler shuffles with ``seed + epoch``."""
    device: str = "cpu"
    """``cpu`` or ``cuda``: each rank then uses ``cuda:{local_rank}`` (and nccl)."""
    eval_every_epochs: int = 1
    """Evaluate every this many epochs (0: only at the end)."""
    eval_every_steps: int = 0
    """Also evaluate every this many optimizer steps (0: off); with ``eval_every_epochs`` both apply."""
    early_stopping: EarlyStoppingConfig = field(default_factory=EarlyStoppingConfig)
    """Stop when ``early_stopping.monitor`` stops improving; every rank stops at the same step."""
    log_every_steps: int = 10
    """Reduce and log training scalars (a step line on the console, every logger) every this many
    optimizer steps; ``0``: none during training, only the epoch lines and scalars (quiet CI logs,
    one collective fewer per window)."""
    checkpoint_every_epochs: int = 1
    """Write a checkpoint every this many epochs (0: never at epoch ends)."""
    checkpoint_every_steps: int = 0
    """Also write one every this many optimizer steps (0: never mid-epoch)."""
    checkpoint_at_end: bool = True
    """Write a checkpoint when training stops, if the last one is older."""
    keep_last_checkpoints: int = 3
    """Checkpoints kept on disk; older ones are deleted after a newer one is safely written."""
    profile: bool = False
    """Run torch.profiler over a few optimizer steps (``profile_wait``, ``profile_warmup``,
    ``profile_active``) and write one Chrome trace per rank to ``<output_dir>/profile/`` (for
    TensorBoard's profiler plugin and Perfetto)."""
    profile_wait: int = 1
    """``profile``: optimizer steps skipped before profiling (the first steps are not typical)."""
    profile_warmup: int = 1
    """``profile``: steps the profiler warms up on (recorded, then discarded)."""
    profile_active: int = 3
    """``profile``: steps recorded in the trace."""
    checkpoint_monitor: str | None = None
    """Also keep the best checkpoints by this metric (e.g. ``eval/accuracy``, ``eval/loss``,
    ``train/loss``) in ``<output_dir>/checkpoints/best``, each storing its value; ``trainer.resume=best``
    and ``ddptrain.load_model(run, which="best")`` take the best. ``None``: no best checkpoints."""
    checkpoint_mode: str = "min"
    """``min`` (lower is better, e.g. a loss) or ``max`` (e.g. an accuracy) for ``checkpoint_monitor``."""
    checkpoint_save_top_k: int = 1
    """How many best checkpoints ``checkpoint_monitor`` keeps (exactly these; ties keep the earlier step)."""
    resume: str | None = None
    """Resume from a checkpoint file, a directory (its newest valid checkpoint), ``latest`` (this
    run's newest checkpoint; when its directory has none and is one of ``outputs/<recipe>/``, the
    newest run of that recipe there; refused, rc 2, when there is none anywhere), ``auto`` (this
    run's newest checkpoint, else start from scratch: for requeued jobs) or ``best``."""
    init_from: str | None = None
    """Fine-tuning: start from the model weights only of a checkpoint file, a run directory (its
    newest checkpoint) or a run's ``checkpoints/best`` directory (its best); the optimizer, schedule
    and step start fresh. ``trainer.resume``, when it finds a checkpoint, wins (a restarted fine-tune continues)."""
    allow_world_size_change: bool = False
    """Accept a checkpoint written by another number of ranks (the epoch continues from the same
    global sample position)."""
    output_dir: str | None = None
    """Directory for checkpoints, TensorBoard logs and metrics; the CLI sets Hydra's run dir.
    ``None``: ``outputs/<recipe.name>/<YYYY-MM-DD_HH-MM-SS>`` under the working directory, the
    CLI's default too (:func:`default_output_dir`). Rank 0's value is used on every rank."""
    tensorboard: bool = True
    """Write TensorBoard event files under ``<output_dir>/tensorboard`` (rank 0)."""
    csv: bool = True
    """Write every reduced metric to ``<output_dir>/metrics.csv`` and the config to ``hparams.yaml`` (rank 0)."""
    mlflow: bool = False
    """Log metrics and the config to an MLflow run in ``<output_dir>/mlruns`` (needs ``ddptrain[loggers]``)."""
    wandb: bool = False
    """Log metrics and the config to an offline Weights & Biases run under ``<output_dir>/wandb``
    (needs ``ddptrain[loggers]``; ``wandb sync`` uploads it)."""
    progress: str = "auto"
    """tqdm progress bars on rank 0: ``true``, ``false``, or ``auto`` (on when stdout is a
    terminal). The step lines of the log go to the console only without a bar."""
    check_sync_every_n_steps: int = 0
    """Desynchronisation guard: every N optimizer steps, check (one checksum per rank, gathered)
    that parameters are identical on every rank; stop with the diverged ranks named. 0: off."""
    world_size_invariant: bool = False
    """Bitwise-identical training whatever the world size: each global batch is cut into
    ``virtual_ranks`` fixed shards by sample position, gradients are summed exactly (int64 fixed
    point), randomness is seeded per shard and threads are pinned (README: World-size-invariant training)."""
    virtual_ranks: int = 8
    """Shards per micro-batch in world-size-invariant mode; the world size must divide it."""
    smoke_check: bool = False
    """After training, fail unless the parameters are identical on every rank and the training
    loss fell by at least 1%, measured on the same samples (the training set's first
    ``data.global_batch_size``, model in eval mode) before and after training (for CI smoke runs)."""
    doctor: bool = False
    """Measure a window of steps (``doctor.*``) and write ``<output_dir>/doctor.json``: why the run
    is slow, what to change, how it scales (``python -m ddptrain.doctor`` does only that)."""


@dataclass
class DoctorConfig:
    """``ddptrain doctor``: the measured window and the what-if of the scaling prediction."""

    warmup_steps: int = 3
    """Optimizer steps left unmeasured first (bucket rebuild, allocator, caches)."""
    steps: int = 10
    """Optimizer steps measured, on every rank."""
    world_sizes: list = field(default_factory=lambda: [2, 4, 8, 64])
    """World sizes the scaling prediction is made for."""
    link_gbps: float | None = None
    """Link speed (Gbit/s) of the prediction; ``None``: the link measured in this run."""
    hosts: int = 0
    """Hosts of the predicted jobs: their ranks share those hosts' cores. 0: as many hosts as
    needed at this run's ranks per host."""


@dataclass
class Config:
    """A whole run: recipe, processes, data, model, optimizer and loop."""

    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    """Which Trainer subclass runs."""
    dist: DistConfig = field(default_factory=DistConfig)
    """Processes and communication."""
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    """How ranks start."""
    model: dict = field(default_factory=dict)
    """Free-form model settings; ``_target_`` (a dotted path) plus keyword arguments is what the
    default ``Trainer.configure_model`` builds."""
    data: DataConfig = field(default_factory=DataConfig)
    """Datasets and batch sizes."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer and schedule."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Loop, evaluation, logging, checkpoints."""
    doctor: DoctorConfig = field(default_factory=DoctorConfig)
    """``trainer.doctor`` / ``python -m ddptrain.doctor``: the measured window and the prediction."""

    @classmethod
    def from_dict(cls, data: dict | None = None) -> Config:
        """Build a Config from nested dictionaries, refusing unknown keys and wrong types.

        Raises:
            ConfigError: naming the dotted key, the value and what is accepted.
        """
        return _build(cls, data or {}, "")

    def to_dict(self) -> dict:
        """Plain nested dictionaries (safe to store in a checkpoint)."""
        return dataclasses.asdict(self)


# -- unknown keys: what to say instead ----------------------------------------------------------
LIGHTNING_KEYS = {
    "devices": "dist.world_size",
    "accumulate_grad_batches": "trainer.grad_accum_steps",
    "max_epochs": "trainer.epochs",
    "max_steps": "trainer.max_steps",
    "gradient_clip_val": "trainer.grad_clip_norm",
    "precision": "trainer.precision",
    "check_val_every_n_epoch": "trainer.eval_every_epochs",
    "val_check_interval": "trainer.eval_every_steps",
    "log_every_n_steps": "trainer.log_every_steps",
    "default_root_dir": "trainer.output_dir",
    "accelerator": "trainer.device",
}
"""Lightning ``Trainer`` flags (as ``trainer.<flag>`` or bare) and the ddptrain key that does their job."""
_NUM_NODES_ADVICE = (
    " ddptrain has no num_nodes: across machines, start the ranks with torchrun, mpirun or srun "
    "(one process per rank; the launcher's world size wins), see the README's launching section."
)
_MAX_KEYS_LISTED = 12


def default_output_dir(config: Config) -> str:
    """The run directory of a run that names none: ``outputs/<recipe.name>/<YYYY-MM-DD_HH-MM-SS>``
    (relative to the working directory; ``conf/config.yaml``'s ``hydra.run.dir`` is the same)."""
    import time

    return os.path.join("outputs", config.recipe.name, time.strftime("%Y-%m-%d_%H-%M-%S"))


def suggest_key(dotted: str, close: Sequence[str]) -> str:
    """The " Did you mean ...?" text for the unknown key ``dotted``: a Lightning flag's ddptrain key
    first (``trainer.devices`` -> ``dist.world_size``), else the closest of ``close``, else nothing."""
    flag = dotted.rsplit(".", 1)[-1]
    if dotted in (flag, f"trainer.{flag}"):
        if flag == "num_nodes":
            return _NUM_NODES_ADVICE
        if flag in LIGHTNING_KEYS:
            ours = LIGHTNING_KEYS[flag]
            return f" Did you mean {ours}? (Lightning's Trainer({flag}=...) is {ours} here.)"
    return f" Did you mean {close[0]}?" if close else ""


def leaf_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key of the dataclass schema ``cls`` (sections expanded), e.g. ``trainer.epochs``."""
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        name = prefix + f.name
        keys += leaf_keys(hints[f.name], name + ".") if dataclasses.is_dataclass(hints[f.name]) else [name]
    return keys


def unknown_key_message(key: str, section: str, names: Sequence[str]) -> str:
    """The error text for the dotted ``key`` that ``section`` (its keys: ``names``) does not have:
    the nearest key anywhere in the schema (one put in the wrong section too) or the Lightning
    flag's key, then where to read the section's keys. The CLI's overrides and ``from_dict`` say it."""
    close = difflib.get_close_matches(key, leaf_keys(Config), n=1, cutoff=0.6)
    return f"unknown config key {key}.{suggest_key(key, close)} {keys_hint(section, sorted(names))}"


def keys_hint(section: str, names: Sequence[str]) -> str:
    """Where to read the keys of ``section``: listed when there are few, else the command that prints them."""
    where = section or "the top level"
    if len(names) <= _MAX_KEYS_LISTED:
        return f"Keys under {where}: {', '.join(sorted(names))}."
    return f"{where} has {len(names)} keys: `python -m ddptrain recipe=<name> --cfg job` prints them with their values."


# -- building and type checks ------------------------------------------------------------------
def _build(cls, data: Any, prefix: str):
    if not isinstance(data, dict):
        raise ConfigError(
            f"{prefix.rstrip('.') or 'the config'} must be a mapping of keys to values, "
            f"got {type(data).__name__} {data!r}"
        )
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in data if k not in names]
    if unknown:
        raise ConfigError(unknown_key_message(f"{prefix}{unknown[0]}", prefix.rstrip("."), names))
    kwargs = {k: _coerce(hints[k], v, prefix + k) for k, v in data.items()}
    return cls(**kwargs)


def _coerce(hint, value, key: str):
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None
        return _coerce(args[0], value, key)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, key + ".")
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{key} must be an integer, got {value!r}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{key} must be a number, got {value!r}")
    if hint is str:
        if isinstance(value, str):
            return value
        if isinstance(value, bool):  # e.g. trainer.progress=false (a yes/no/auto choice)
            return "true" if value else "false"
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # e.g. trainer.resume=123 meant as a path
        raise ConfigError(f"{key} must be a string, got {value!r}")
    if hint is dict or origin is dict:
        if isinstance(value, dict):
            return dict(value)
        raise ConfigError(f"{key} must be a mapping, got {value!r}")
    if hint is list or origin is list:
        if isinstance(value, (list, tuple)):
            return list(value)
        raise ConfigError(f"{key} must be a list, got {value!r}")
    return value


# -- checks that need the job --------------------------------------------------------------------
def per_rank_batch_size(config: Config, world_size: int) -> int:
    """Samples per rank per micro-batch: the global batch split over ranks and accumulation steps.

    Raises:
        ConfigError: if the split is not exact, naming both numbers and the fix.
    """
    global_bs = config.data.global_batch_size
    accum = config.trainer.grad_accum_steps
    parts = world_size * accum
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


def _check_bucket_cap(dist: DistConfig) -> None:
    """``dist.bucket_cap_mb``: a number of MiB >= 0, or ``auto``."""
    cap = dist.bucket_cap_mb
    if cap == "auto":
        return
    try:
        ok = not isinstance(cap, bool) and float(cap) >= 0
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ConfigError(
            f"dist.bucket_cap_mb={cap!r} must be a number of MiB >= 0, or auto (tuned in the first steps)"
        )


def validate(config: Config, world_size: int) -> None:
    """Check the config against the job (world size, machine) before any process starts.

    Raises:
        ConfigError: the first problem found, naming the knob and the fix.
    """
    t, d, o = config.trainer, config.data, config.optimizer
    _positive("trainer.epochs", t.epochs)
    _positive("trainer.grad_accum_steps", t.grad_accum_steps)
    _positive("doctor.steps", config.doctor.steps)
    _positive("data.global_batch_size", d.global_batch_size)
    _positive("data.eval_batch_size", d.eval_batch_size)
    _positive("dist.world_size", world_size)
    _positive("dist.timeout_s", config.dist.timeout_s)
    _positive("dist.init_timeout_s", config.dist.init_timeout_s)
    _one_of("dist.algorithm", config.dist.algorithm, ("native", "ring"))
    _check_bucket_cap(config.dist)
    if config.launcher.max_restarts < 0:
        raise ConfigError(f"launcher.max_restarts={config.launcher.max_restarts} must be >= 0")
    for key, value in (("trainer.max_steps", t.max_steps), ("trainer.stop_after_steps", t.stop_after_steps)):
        if value is not None and value < 1:
            raise ConfigError(f"{key}={value} must be at least 1, or null for no limit")
    for key, value in (
        ("trainer.eval_every_epochs", t.eval_every_epochs),
        ("trainer.eval_every_steps", t.eval_every_steps),
        ("trainer.log_every_steps", t.log_every_steps),
        ("trainer.early_stopping.patience", t.early_stopping.patience),
        ("trainer.checkpoint_every_epochs", t.checkpoint_every_epochs),
        ("trainer.checkpoint_every_steps", t.checkpoint_every_steps),
        ("data.num_workers", d.num_workers),
        ("dist.threads_per_worker", config.dist.threads_per_worker),
        ("trainer.check_sync_every_n_steps", t.check_sync_every_n_steps),
        ("doctor.warmup_steps", config.doctor.warmup_steps),
        ("doctor.hosts", config.doctor.hosts),
    ):
        if value < 0:
            raise ConfigError(f"{key}={value} must be >= 0 (0 turns it off / picks the default)")
    if t.keep_last_checkpoints < 1:
        raise ConfigError(
            f"trainer.keep_last_checkpoints={t.keep_last_checkpoints} must be at least 1; "
            "to write no checkpoints set trainer.checkpoint_every_epochs=0 and "
            "trainer.checkpoint_at_end=false"
        )
    if t.early_stopping.min_delta < 0:
        raise ConfigError(f"trainer.early_stopping.min_delta={t.early_stopping.min_delta} must be >= 0")
    _one_of("trainer.checkpoint_mode", t.checkpoint_mode, ("min", "max"))
    _positive("trainer.profile_active", t.profile_active)
    for key, value in (("trainer.profile_wait", t.profile_wait), ("trainer.profile_warmup", t.profile_warmup)):
        if value < 0:
            raise ConfigError(f"{key}={value} must be >= 0")
    _positive("trainer.checkpoint_save_top_k", t.checkpoint_save_top_k)
    if t.grad_clip_norm is not None and t.grad_clip_norm <= 0:
        raise ConfigError(f"trainer.grad_clip_norm={t.grad_clip_norm} must be positive, or null for no clipping")
    _one_of("optimizer.name", o.name, OPTIMIZERS)
    _one_of("optimizer.scheduler.name", o.scheduler.name, SCHEDULERS)
    _one_of("launcher.name", config.launcher.name, LAUNCHERS)
    _one_of("dist.backend", config.dist.backend, _BACKENDS)
    _one_of("trainer.progress", t.progress.lower(), PROGRESS_CHOICES)
    _one_of("trainer.early_stopping.mode", t.early_stopping.mode, MONITOR_MODES)
    check_precision(t.precision, t.device)
    if o.lr <= 0:
        raise ConfigError(f"optimizer.lr={o.lr} must be positive")
    check_world_size_invariant(config, world_size)  # first: its error names the rule that mode adds
    per_rank_batch_size(config, world_size)
    check_device(config)


def check_world_size_invariant(config: Config, world_size: int) -> None:
    """World-size-invariant mode: the world size must divide ``trainer.virtual_ranks``; no ``drop_last``."""
    t = config.trainer
    if not t.world_size_invariant:
        return
    _positive("trainer.virtual_ranks", t.virtual_ranks)
    if t.virtual_ranks % world_size:
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
            "cuda:{local_rank}; pick GPUs with CUDA_VISIBLE_DEVICES)"
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
    if local_world_size > count:
        raise ConfigError(
            f"{local_world_size} ranks on this machine but only {count} CUDA device(s): each "
            f"rank needs its own GPU. Use dist.world_size<={count}."
        )


def _positive(key: str, value) -> None:
    if value is None or value < 1:
        raise ConfigError(f"{key}={value} must be at least 1")


def _one_of(key: str, value: str, allowed) -> None:
    if value not in allowed:
        close = difflib.get_close_matches(str(value), allowed, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(allowed)}{hint}")


def locate(path: str, key: str) -> Any:
    """Import ``package.module.Name`` (what a config's dotted path names).

    Raises:
        ConfigError: naming ``key``, the path and why it failed.
    """
    import importlib

    if not isinstance(path, str) or "." not in path:
        raise ConfigError(f"{key}={path!r} must be a dotted path like 'package.module.Name'")
    module_name, _, attr = path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"{key}={path}: cannot import module {module_name!r} ({exc}). The module must be "
            "importable from the working directory or the installed packages."
        ) from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"{key}={path}: module {module_name!r} has no attribute {attr!r}") from None


def instantiate(spec: dict, key: str, fix: str) -> Any:
    """Call what ``spec['_target_']`` names with the rest of ``spec`` (keys starting with ``_`` left out).

    Args:
        spec: e.g. ``config.model``: ``{"_target_": "pkg.module.Class", **keyword arguments}``.
        key: the config key of ``spec``, for messages (``model``).
        fix: what else the user may do when ``_target_`` is missing (e.g. override a hook).

    Raises:
        ConfigError: ``_target_`` missing or not importable.
    """
    spec = dict(spec)
    target = spec.pop("_target_", None)
    if not target:
        raise ConfigError(f"{key}._target_ is not set: choose a {key} (e.g. {key}=tutorial_net) or {fix}")
    kwargs = {k: v for k, v in spec.items() if not k.startswith("_")}
    return locate(target, f"{key}._target_")(**kwargs)


PRECISIONS = ("32", "bf16-mixed", "16-mixed")
_ALIASES = {"32-true": "32", "32.0": "32", "bf16": "bf16-mixed", "16": "16-mixed"}


def check_precision(precision: str, device_type: str) -> str:
    """The canonical name of ``precision``; a ConfigError for an unknown one or float16 on CPU."""
    name = _ALIASES.get(str(precision), str(precision))
    if name not in PRECISIONS:
        raise ConfigError(f"trainer.precision={precision!r} is not one of {', '.join(PRECISIONS)}")
    if name == "16-mixed" and device_type != "cuda":
        raise ConfigError(
            f"trainer.precision=16-mixed needs trainer.device=cuda (float16 autocast with a gradient "
            f"scaler is a GPU feature; this run is on {device_type}). On CPU use trainer.precision=bf16-mixed"
        )
    return name
