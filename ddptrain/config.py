"""The configuration of a training run: nested dataclasses, one docstring per field.

The same tree comes from Hydra (``conf/``, through ``ddptrain.cli``) or from plain Python::

    config = Config.from_dict({"recipe": {"trainer_class": "ddptrain.recipes.mnist.MnistTrainer"},
                               "trainer": {"epochs": 1}})

:meth:`Config.from_dict` refuses unknown keys (suggesting the closest known one) and values of
the wrong type, naming the dotted key, so a typo never silently falls back to a default.

Each field's rule is part of the schema, written once next to its default as field metadata: its
choices (:func:`one_of`) or its bounds (:func:`bounded`). :func:`check_fields` enforces them;
``--help KEY`` and ``docs/configuration.md`` print them. What needs the job (the world size's
batch split, the machine's devices, the backend it resolves to) is :mod:`ddptrain.preflight`'s,
whose ``validate`` runs both before any process starts. Nothing here imports Hydra or torch.
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
    "EmaConfig",
    "CheckpointConfig",
    "ProfilerConfig",
    "LoggersConfig",
    "LrFindConfig",
    "check_fields",
    "max_time_seconds",
    "check_precision",
    "PRECISIONS",
    "locate",
    "LAUNCHERS",
    "OPTIMIZERS",
    "SCHEDULERS",
]


# DDP's gradient bucket size when none is given (torch's too); dist.bucket_cap_mb=auto starts
# here and tunes from it. Owned here because the config must be read before torch is imported.
DEFAULT_BUCKET_CAP_MB = 25.0


def one_of(default: Any, choices: tuple, fold_case: bool = False) -> Any:
    """A dataclass field that takes one of ``choices`` (strings, or numbers such as a stage).
    :func:`check_fields` enforces it, with a "did you mean"; ``--help KEY`` lists the choices.
    ``fold_case``: :meth:`Config.from_dict` lowers the value first (``trainer.progress=False``
    on a command line arrives as the string ``False``)."""
    assert default in choices, (default, choices)
    return field(default=default, metadata={"choices": choices, "fold_case": fold_case})


def bounded(default: Any, *, at_least: float | None = None, above: float | None = None, fix: str = "") -> Any:
    """A dataclass field whose value must be ``>= at_least`` (or ``> above``); ``None`` passes when
    the field is optional. ``fix`` ends the error text, separator included (``", or null for no
    limit"``). :func:`check_fields` enforces it; ``--help KEY`` shows it."""
    rule = {"at_least": at_least, "above": above, "fix": fix}
    return field(default=default, metadata={"bound": rule})


class ConfigError(ValueError):
    """A configuration value is unknown, of the wrong type, or inconsistent with the job."""


def _check_bucket_cap(key: str, cap: Any) -> None:
    """``dist.bucket_cap_mb``'s rule, which no bound states: a number of MiB >= 0, or ``auto``."""
    if cap == "auto":
        return
    try:
        ok = not isinstance(cap, bool) and float(cap) >= 0
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ConfigError(f"{key}={cap!r} must be a number of MiB >= 0, or auto (tuned in the first steps)")


def _check_batch_limit(key: str, limit: Any) -> None:
    """``trainer.limit_*_batches``' rule: ``None`` (all), a whole number of batches >= 1, or a
    fraction of the epoch in (0, 1]."""
    if limit is None or (isinstance(limit, int) and not isinstance(limit, bool) and limit >= 1):
        return
    if isinstance(limit, float) and 0 < limit <= 1:
        return
    raise ConfigError(
        f"{key}={limit!r} must be a number of batches (an integer >= 1), a fraction of the epoch "
        "in (0, 1] (e.g. 0.25), or null for all of it"
    )


def _check_fast_dev_run(key: str, value: Any) -> None:
    """``trainer.fast_dev_run``'s rule: true/false, or a number of batches >= 1."""
    if isinstance(value, bool) or (isinstance(value, int) and value >= 1):
        return
    raise ConfigError(f"{key}={value!r} must be true (1 batch), false, or a number of batches >= 1")


def max_time_seconds(value: str) -> float:
    """``trainer.max_time`` (``DD:HH:MM:SS``, Lightning's format) in seconds.

    Raises:
        ConfigError: not four ``:``-separated whole numbers, or hours/minutes/seconds out of range.
    """
    parts = str(value).split(":")
    try:
        days, hours, minutes, seconds = (int(part) for part in parts)
        ok = len(parts) == 4 and min(days, hours, minutes, seconds) >= 0 and hours < 24 and max(minutes, seconds) < 60
    except ValueError:
        ok = False
    if not ok:
        raise ConfigError(
            f"trainer.max_time={value!r} must be DD:HH:MM:SS, e.g. 00:12:00:00 for twelve hours "
            "(days, hours < 24, minutes < 60, seconds < 60), or null for no limit"
        )
    return float(((days * 24 + hours) * 60 + minutes) * 60 + seconds)


def _check_max_time(key: str, value: Any) -> None:
    if value is not None:
        max_time_seconds(value)


@dataclass
class RecipeConfig:
    """Which Trainer runs the job."""

    name: str = "custom"
    """Recipe name, shown in logs (``recipe=mnist`` sets ``mnist``)."""
    trainer_class: str = "ddptrain.Trainer"
    """Dotted path of the ``ddptrain.Trainer`` subclass to run, e.g. ``ddptrain.recipes.mnist.MnistTrainer``."""
    params: dict[str, Any] = field(default_factory=dict)
    """Your own hyperparameters, free-form: ``recipe.params.gamma=0.7`` on the command line (or a
    ``recipe: params:`` block in your recipe file), read in your Trainer as
    ``self.config.recipe.params["gamma"]``; saved with the run's config like every other key."""


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
    bucket_cap_mb: Any = field(default=DEFAULT_BUCKET_CAP_MB, metadata={"check": _check_bucket_cap})
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

    def ddp_options(self) -> dict[str, Any]:
        """The keyword arguments of ``DistributedDataParallel`` that these settings choose."""
        return {
            "bucket_cap_mb": DEFAULT_BUCKET_CAP_MB if self.bucket_cap_mb == "auto" else float(self.bucket_cap_mb),
            # local_sgd/diloco: no collective per forward; buffers are averaged at each outer step
            "broadcast_buffers": self.broadcast_buffers and self.sync == "every_step",
            "find_unused_parameters": self.find_unused_parameters,
            "gradient_as_bucket_view": self.gradient_as_bucket_view,
        }


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
    global_batch_size: int = bounded(128, at_least=1)
    """Samples per optimizer step over all ranks; each rank takes
    ``global_batch_size / (world_size * trainer.grad_accum_steps)`` per micro-batch."""
    eval_batch_size: int = bounded(1000, at_least=1)
    """Evaluation batch size per rank."""
    num_workers: int = bounded(0, at_least=0)
    """DataLoader worker processes per rank (datasets held as tensors skip the DataLoader)."""
    preload: bool = True
    """Hold the datasets as tensors in memory and index them by batch (much faster than
    per-item transforms for MNIST-sized data)."""
    drop_last: bool = False
    """Cut the epoch's tail so ranks need no padding duplicates, instead of repeating samples."""
    num_train_samples: int = bounded(10000, at_least=1)
    """``synthetic`` only: training samples."""
    num_val_samples: int = bounded(2000, at_least=1)
    """``synthetic`` only: validation samples."""


@dataclass
class SchedulerConfig:
    """Learning-rate schedule, stepped once per optimizer step."""

    name: str = one_of("none", ("none", "step", "cosine"))
    """``none`` (constant), ``step`` (times ``gamma`` every ``step_size`` steps) or ``cosine``
    (down to ``min_lr_ratio * lr`` at the last step)."""
    warmup_steps: int = bounded(0, at_least=0)
    """Linear warm-up from ``lr / warmup_steps`` over this many steps (all schedules)."""
    step_size: int = bounded(1000, at_least=1)
    """``step`` only: optimizer steps between decays."""
    gamma: float = 0.1
    """``step`` only: decay factor."""
    min_lr_ratio: float = 0.0
    """``cosine`` only: final learning rate as a fraction of ``lr``."""


@dataclass
class OptimizerConfig:
    """Optimizer for the default ``Trainer.configure_optimizers``."""

    name: str = one_of("sgd", ("sgd", "adam", "adamw"))
    """The torch optimizer the default ``configure_optimizers`` builds (``torch.optim.SGD``, ``Adam`` or ``AdamW``)."""
    lr: float = bounded(0.01, above=0)
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
    mode: str = one_of("min", ("min", "max"))
    """``min``: lower is better; ``max``: higher is better."""
    patience: int = bounded(3, at_least=0)
    """Checks without improvement before stopping (a check: each evaluation; each epoch end without one)."""
    min_delta: float = bounded(0.0, at_least=0)
    """An improvement must beat the best value by more than this."""


@dataclass
class EmaConfig:
    """``trainer.ema.*``: an exponential moving average of the weights (off by default)."""

    decay: float | None = None
    """Keep an average of the weights: after each optimizer step ``ema += (1 - decay) * (w - ema)``
    (``torch.optim.swa_utils.get_ema_multi_avg_fn``'s update), e.g. ``0.999``, for the parameters
    and the floating-point buffers (BatchNorm's statistics). The first update copies them.
    ``None``: no average."""
    warmup: bool = True
    """Ramp the decay up as timm and TensorFlow do: at the n-th update ``min(decay, (1 + n) / (10 + n))``,
    so a short run's first weights fade out of its average. ``false``: the constant decay (torch's
    ``AveragedModel`` rule)."""
    every_n_steps: int = bounded(1, at_least=1)
    """Update the average every this many optimizer steps."""
    start_step: int = bounded(0, at_least=0)
    """Optimizer steps before the first update (the average starts from the weights of this step)."""
    evaluate: bool = False
    """Validate, test and predict with the averaged weights (the training continues on the trained ones)."""


@dataclass
class CheckpointConfig:
    """``trainer.checkpoint.*``: when checkpoints are written, how many are kept, and the best ones
    (written by :class:`ddptrain.trainer.callbacks.checkpoint.CheckpointCallback` and
    :class:`ddptrain.trainer.callbacks.best.BestCheckpoints`; the layout is :class:`ddptrain.rundir.RunDir`'s)."""

    every_epochs: int = bounded(1, at_least=0)
    """Write a checkpoint every this many epochs (0: never at epoch ends)."""
    every_steps: int = bounded(0, at_least=0)
    """Also write one every this many optimizer steps (0: never mid-epoch)."""
    at_end: bool = True
    """Write a checkpoint when training stops, if the last one is older."""
    keep_last: int = bounded(
        3,
        at_least=1,
        fix="; to write no checkpoints set trainer.checkpoint.every_epochs=0 and trainer.checkpoint.at_end=false",
    )
    """Checkpoints kept on disk; older ones are deleted after a newer one is safely written."""
    monitor: str | None = None
    """Also keep the best checkpoints by this metric (e.g. ``eval/accuracy``, ``eval/loss``,
    ``train/loss``) in ``<output_dir>/checkpoints/best``, each storing its value; ``trainer.resume=best``
    and ``ddptrain.load_model(run, which="best")`` take the best. ``None``: no best checkpoints."""
    mode: str = one_of("min", ("min", "max"))
    """``min`` (lower is better, e.g. a loss) or ``max`` (e.g. an accuracy) for ``monitor``."""
    save_top_k: int = bounded(1, at_least=1)
    """How many best checkpoints ``monitor`` keeps (exactly these; ties keep the earlier step)."""
    sharded: bool = False
    """ZeRO only (``dist.zero_stage=1|2``): each rank writes its own shard of the optimizer state
    to a file beside the checkpoint (``step_<N>.pt.optim-<rank>-of-<W>``), with no gather of the
    full state and no rank holding more than its shard; the checkpoint file holds the rest. Reading
    it puts the shards together, so it still resumes at any world size, with ZeRO or in plain DDP,
    and ``ddptrain.load_model`` reads it. ``false``: one consolidated file (docs/zero.md)."""


@dataclass
class ProfilerConfig:
    """``trainer.profiler.*``: torch.profiler over a few optimizer steps
    (:class:`ddptrain.trainer.callbacks.profiler.ProfilerCallback`)."""

    enabled: bool = False
    """Profile ``active`` optimizer steps (after ``wait`` skipped and ``warmup`` discarded ones) and
    write one Chrome trace per rank to ``<output_dir>/profile/`` (for TensorBoard's profiler plugin
    and Perfetto)."""
    wait: int = bounded(1, at_least=0)
    """Optimizer steps skipped before profiling (the first steps are not typical)."""
    warmup: int = bounded(1, at_least=0)
    """Steps the profiler warms up on (recorded, then discarded)."""
    active: int = bounded(3, at_least=1)
    """Steps recorded in the trace."""


@dataclass
class LoggersConfig:
    """``trainer.loggers.*``: which loggers write the reduced metrics (rank 0, under ``<output_dir>``;
    :func:`ddptrain.trainer.callbacks.from_config` adds them)."""

    tensorboard: bool = True
    """Write TensorBoard event files under ``<output_dir>/tensorboard`` (rank 0)."""
    csv: bool = True
    """Write every reduced metric to ``<output_dir>/metrics.csv`` and the config to ``hparams.yaml`` (rank 0)."""
    mlflow: bool = False
    """Log metrics and the config to an MLflow run in ``<output_dir>/mlruns`` (needs ``ddptrain[loggers]``)."""
    wandb: bool = False
    """Log metrics and the config to an offline Weights & Biases run under ``<output_dir>/wandb``
    (needs ``ddptrain[loggers]``; ``wandb sync`` uploads it)."""


@dataclass
class TrainerConfig:
    """The training loop, evaluation, logging and checkpoints."""

    epochs: int = bounded(10, at_least=1)
    """Passes over the training set."""
    max_steps: int | None = bounded(None, at_least=1, fix=", or null for no limit")
    """Stop after this many optimizer steps in total (also the horizon of ``cosine``)."""
    stop_after_steps: int | None = bounded(None, at_least=1, fix=", or null for no limit")
    """Stop (and checkpoint) once this many optimizer steps are done, as if preempted; unlike
    ``max_steps`` it does not change the schedule, so a resumed run continues exactly."""
    grad_accum_steps: int = bounded(1, at_least=1)
    """Micro-batches per optimizer step; all but the last run under ``no_sync()``."""
    max_time: str | None = field(default=None, metadata={"check": _check_max_time})
    """Stop after this much wall time, ``DD:HH:MM:SS`` (e.g. ``00:11:50:00`` inside a 12-hour job
    slot): every rank stops at the same step with a checkpoint and the line to resume, as Ctrl-C
    does. The clock is this fit's own (a resumed run gets the whole time again). ``None``: no limit."""
    limit_train_batches: Any = field(default=None, metadata={"check": _check_batch_limit})
    """Train on only part of each epoch: an integer (batches per rank, rounded up to whole
    optimizer steps) or a fraction of the epoch's steps, e.g. ``0.1``. Each epoch takes the
    first batches of its own shuffled order. ``None``: all."""
    limit_val_batches: Any = field(default=None, metadata={"check": _check_batch_limit})
    """Evaluate on only the first batches of the validation set: an integer (batches per rank) or
    a fraction of its samples; the metrics stay exact over the samples seen. ``None``: all."""
    overfit_batches: int = bounded(0, at_least=0)
    """Train on the same first N global batches every epoch, unshuffled, and validate on N batches
    (unless ``limit_val_batches`` says otherwise): a model that cannot drive this loss toward 0
    has a bug. 0: off."""
    num_sanity_val_steps: int = bounded(2, at_least=0)
    """Run ``validation_step`` on this many batches per rank before the first training step, so a
    broken validation fails in seconds, not after an epoch. Nothing is logged; the training's bits
    do not change. 0: skip."""
    fast_dev_run: Any = field(default=False, metadata={"check": _check_fast_dev_run})
    """``true`` or N: run N (``true``: 1) batches of training, validation and test, write no
    checkpoint, log file or logger output, and print one line saying that it worked or what broke."""
    model_summary: bool = True
    """Log a table of the model at fit start (rank 0, console and ``train.log``): one row per
    top-level module with its parameters, trainable parameters and size, then the totals."""
    log_grad_norm: bool = False
    """Log ``train/grad_norm``: the global 2-norm of the gradients after the reduction over ranks
    (before clipping), the same on every rank; averaged over each logging window."""
    deterministic: bool = False
    """``torch.use_deterministic_algorithms(True)`` (and on CUDA cuDNN's deterministic mode and
    ``CUBLAS_WORKSPACE_CONFIG``): the same bits run after run at the same world size. An operation
    without a deterministic version then raises. For the same bits at any world size, see
    ``world_size_invariant``."""
    ema: EmaConfig = field(default_factory=EmaConfig)
    """An exponential moving average of the weights, checkpointed; ``ema.evaluate`` evaluates it."""
    grad_clip_norm: float | None = bounded(None, above=0, fix=", or null for no clipping")
    """Clip the global gradient norm to this value (``None``: no clipping)."""
    precision: str = "32"
    """``32``; ``bf16-mixed`` (bfloat16 autocast, CPU and CUDA); ``16-mixed`` (float16 autocast with a
    gradient scaler, CUDA only)."""
    seed: int = 1234
    """Base seed: rank ``r`` seeds with ``seed + r``; the sampler shuffles with ``seed + epoch``."""
    device: str = "cpu"
    """``cpu`` or ``cuda``: each rank then uses ``cuda:{local_rank % device_count}`` (and nccl,
    which needs a GPU per rank; with ``dist.backend=gloo`` ranks may share a GPU)."""
    eval_every_epochs: int = bounded(1, at_least=0)
    """Evaluate every this many epochs (0: only at the end)."""
    eval_every_steps: int = bounded(0, at_least=0)
    """Also evaluate every this many optimizer steps (0: off); with ``eval_every_epochs`` both apply."""
    early_stopping: EarlyStoppingConfig = field(default_factory=EarlyStoppingConfig)
    """Stop when ``early_stopping.monitor`` stops improving; every rank stops at the same step."""
    log_every_steps: int = bounded(10, at_least=0)
    """Reduce and log training scalars (a step line on the console, every logger) every this many
    optimizer steps; ``0``: none during training, only the epoch lines and scalars (quiet CI logs,
    one collective fewer per window)."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """When checkpoints are written and which are kept (the newest ones, and the best by a metric)."""
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    """torch.profiler over a few optimizer steps (off by default)."""
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
    loggers: LoggersConfig = field(default_factory=LoggersConfig)
    """Which loggers write the reduced metrics (rank 0, under ``<output_dir>``)."""
    callbacks: list[dict[str, Any]] = field(default_factory=list)
    """Your own callbacks (``ddptrain.Callback`` subclasses), each ``{_target_: pkg.module.Class,
    **its keyword arguments}``: on the command line ``'trainer.callbacks=[{_target_: mytask.PrintLR}]'``,
    in a recipe file a list under ``trainer: callbacks:``. Built on every rank, after the built-in
    callbacks and before those passed to ``Trainer(callbacks=...)``."""
    progress: str = one_of("auto", ("auto", "true", "false"), fold_case=True)
    """tqdm progress bars on rank 0: ``true``, ``false``, or ``auto`` (on when stdout is a
    terminal). The step lines of the log go to the console only without a bar."""
    check_sync_every_n_steps: int = bounded(0, at_least=0)
    """Desynchronisation guard: every N optimizer steps, check (one checksum per rank, gathered)
    that parameters are identical on every rank; stop with the diverged ranks named. 0: off."""
    world_size_invariant: bool = False
    """Bitwise-identical training whatever the world size: each global batch is cut into
    ``virtual_ranks`` fixed shards by sample position, gradients are summed exactly (int64 fixed
    point), randomness is seeded per shard and threads are pinned (README: World-size-invariant training)."""
    virtual_ranks: int = bounded(8, at_least=1)
    """Shards per micro-batch in world-size-invariant mode; the world size must divide it
    (except in elastic mode, which spreads them over whoever is present)."""
    elastic: bool = False
    """Keep training when a rank is lost: the survivors agree on a new membership, form a new
    process group, redo the step in flight and go on in the same processes; a worker the launcher
    restarts (``launcher.max_restarts``) rejoins at a step boundary and gets the state from a peer.
    Nothing is read from disk. Each step's global batch is shared by whoever is present: with
    ``trainer.world_size_invariant=true`` the bits equal an uninterrupted run's; without it, each
    rank's gradient is weighted by its share (the same samples per step, float sums in another
    order). Needs the local launcher or one torchrun per host with ``dist.elastic_store``, and
    gloo or nccl (docs/faults.md: Elastic training)."""
    smoke_check: bool = False
    """After training, fail unless the parameters are identical on every rank and the training
    loss fell by at least 1%, measured on the same samples (the training set's first
    ``data.global_batch_size``, model in eval mode) before and after training (for CI smoke runs)."""
    doctor: bool = False
    """Measure a window of steps (``doctor.*``) and write ``<output_dir>/doctor.json``: why the run
    is slow, what to change, how it scales (``python -m ddptrain.doctor`` does only that)."""
    lr_find: bool = False
    """Run the learning-rate range test (``lr_find.*``) instead of training at one rate: the rate
    climbs every step, the run stops when the loss diverges, and rank 0 prints the suggested
    ``optimizer.lr`` (``python -m ddptrain.tune lr`` sets it, with the other keys a test needs)."""
    compile: bool = False
    """``torch.compile`` the model (in place, ``nn.Module.compile``: its state dict keeps its keys)
    before our DDP wraps it. The gradient hooks still launch the buckets, but a compiled backward
    hands over its gradients together at its end, so the all-reduces no longer overlap it
    (``benchmarks/README.md`` measures what that costs and what compiling gains)."""


@dataclass
class DoctorConfig:
    """``ddptrain doctor``: the measured window and the what-if of the scaling prediction."""

    warmup_steps: int = bounded(3, at_least=0)
    """Optimizer steps left unmeasured first (bucket rebuild, allocator, caches)."""
    steps: int = bounded(10, at_least=1)
    """Optimizer steps measured, on every rank."""
    world_sizes: list = field(default_factory=lambda: [2, 4, 8, 64])
    """World sizes the scaling prediction is made for."""
    link_gbps: float | None = None
    """Link speed (Gbit/s) of the prediction; ``None``: the link measured in this run."""
    hosts: int = bounded(0, at_least=0)
    """Hosts of the predicted jobs: their ranks share those hosts' cores. 0: as many hosts as
    needed at this run's ranks per host."""


@dataclass
class LrFindConfig:
    """``trainer.lr_find`` / ``python -m ddptrain.tune lr``: the learning-rate range test."""

    min_lr: float = bounded(1e-8, above=0)
    """The rate of the first step."""
    max_lr: float = bounded(1.0, above=0)
    """The rate of the last step; the rates between are evenly spaced in log."""
    num_training: int = bounded(100, at_least=12)
    """Optimizer steps (rates) of the test; the suggestion leaves out the first 10 and the last."""
    early_stop_threshold: float | None = bounded(4.0, above=1, fix=", or null to run every step")
    """Stop once the smoothed loss exceeds this many times its best value."""
    suggestion: str = one_of("minimum", ("minimum", "steepest"))
    """How the rate is picked from the smoothed loss: ``minimum``, a tenth of the rate where it is
    lowest (fastai's rule); ``steepest``, where it falls fastest (Lightning's ``suggestion()``)."""


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
    lr_find: LrFindConfig = field(default_factory=LrFindConfig)
    """``trainer.lr_find`` / ``python -m ddptrain.tune lr``: the rates of the range test."""

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


def choices(cls: type, name: str) -> tuple:
    """The values the :func:`one_of` field ``name`` of the dataclass ``cls`` accepts (the schema's own list)."""
    return next(f for f in dataclasses.fields(cls) if f.name == name).metadata["choices"]


LAUNCHERS = choices(LauncherConfig, "name")
OPTIMIZERS = choices(OptimizerConfig, "name")
SCHEDULERS = choices(SchedulerConfig, "name")
MONITOR_MODES = choices(EarlyStoppingConfig, "mode")


def field_type_text(f: dataclasses.Field) -> str:
    """A schema field's type with its rule, as ``--help`` shows it: ``one of: sgd, adam, adamw``,
    ``int, >= 1``, ``float | None, > 0`` or just ``bool``."""
    if "choices" in f.metadata:
        return "one of: " + ", ".join(map(str, f.metadata["choices"]))
    bound = f.metadata.get("bound")
    if bound is None:
        return str(f.type)
    rule = f">= {bound['at_least']:g}" if bound["at_least"] is not None else f"> {bound['above']:g}"
    return f"{f.type}, {rule}"


def check_fields(obj: Any, prefix: str = "") -> None:
    """Enforce every field's own rule (its :func:`one_of` choices, its :func:`bounded` limits, or a
    ``check`` function in its metadata) on the dataclass tree ``obj``, depth first.

    Raises:
        ConfigError: the first field that breaks its rule, naming key, value and what is accepted.
    """
    for f in dataclasses.fields(obj):
        key, value = prefix + f.name, getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            check_fields(value, key + ".")
        elif "choices" in f.metadata:
            allowed = f.metadata["choices"]
            if value not in allowed:
                close = difflib.get_close_matches(str(value), list(map(str, allowed)), n=1)
                hint_text = f" (did you mean {close[0]}?)" if close else ""
                raise ConfigError(f"{key}={value!r} is not one of {', '.join(map(str, allowed))}{hint_text}")
        elif "check" in f.metadata:  # a rule of its own, written as a function next to the field
            f.metadata["check"](key, value)
        elif "bound" in f.metadata and value is not None:
            bound = f.metadata["bound"]
            low, above, fix = bound["at_least"], bound["above"], bound["fix"]
            if low is not None and value < low:
                raise ConfigError(f"{key}={value} must be {'at least 1' if low == 1 else f'>= {low:g}'}{fix}")
            if above is not None and value <= above:
                raise ConfigError(f"{key}={value} must be {'positive' if above == 0 else f'> {above:g}'}{fix}")


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
    "enable_model_summary": "trainer.model_summary",
    "track_grad_norm": "trainer.log_grad_norm",
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
    own = ""
    if section in ("", "recipe"):  # where one's own hyperparameter is tried first
        own = f" Your own hyperparameters go under recipe.params: recipe.params.{key.rsplit('.', 1)[-1]}=<value>."
    return f"unknown config key {key}.{suggest_key(key, close)} {keys_hint(section, sorted(names))}{own}"


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
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in data if k not in fields]
    if unknown:
        raise ConfigError(unknown_key_message(f"{prefix}{unknown[0]}", prefix.rstrip("."), list(fields)))
    kwargs = {k: _coerce(hints[k], v, prefix + k) for k, v in data.items()}
    for k in kwargs:
        if fields[k].metadata.get("fold_case") and isinstance(kwargs[k], str):
            kwargs[k] = kwargs[k].lower()
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
