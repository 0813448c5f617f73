"""``trainer.*`` (and the ``doctor.*`` / ``lr_find.*`` sections its tools read): the loop,
evaluation, logging and checkpoints (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .schema import ConfigError, bounded, checked, choices, one_of

__all__ = [
    "TrainerConfig",
    "EarlyStoppingConfig",
    "EmaConfig",
    "CheckpointConfig",
    "ProfilerConfig",
    "LoggersConfig",
    "DoctorConfig",
    "LrFindConfig",
    "PRECISIONS",
    "MONITOR_MODES",
    "check_precision",
    "check_device_name",
    "max_time_seconds",
]


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


def check_device_name(device: str) -> None:
    """``trainer.device``'s rule: ``cpu`` or ``cuda`` (whether this machine has a GPU is
    :func:`ddptrain.preflight.check_device`'s question)."""
    if device not in ("cpu", "cuda"):
        raise ConfigError(
            f"trainer.device={device!r}: use 'cpu' or 'cuda' (each rank then takes "
            "cuda:{local_rank % device_count}; pick GPUs with CUDA_VISIBLE_DEVICES)"
        )


def _check_batch_limit(key: str, limit: Any, _trainer: Any = None) -> None:
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


def _check_fast_dev_run(key: str, value: Any, _trainer: Any = None) -> None:
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


def _check_max_time(key: str, value: Any, _trainer: Any = None) -> None:
    if value is not None:
        max_time_seconds(value)


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


def _check_balance_shares(key: str, shares: Any, _section: Any = None) -> None:
    """``trainer.balance.shares``: ``off``, ``auto``, or one positive weight per rank (the count is
    checked against the world size with the job's other rules)."""
    if shares in ("off", "auto"):
        return
    weights = list(shares) if isinstance(shares, (list, tuple)) else None
    try:
        ok = bool(weights) and all(not isinstance(w, bool) and float(w) > 0 for w in weights)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ConfigError(
            f"{key}={shares!r} must be off, auto, or a list of positive weights, one per rank "
            "(e.g. [2,1]: rank 0 takes two thirds of each global batch)"
        )


@dataclass
class BalanceConfig:
    """``trainer.balance.*``: each rank's share of every global batch, by its speed
    (:mod:`ddptrain.trainer.balance`; docs/balance.md)."""

    shares: Any = checked(_check_balance_shares, "off, auto, or one positive weight per rank", default="off")
    """``off``: every rank an equal share (plain DDP). ``auto``: each rank's share in proportion to
    its measured compute speed, re-decided every ``window`` steps. A list of weights (``[2,1]``):
    fixed shares. Normal mode cuts each micro-batch by share and weights each rank's loss so the
    gradient is still the per-sample mean; invariant mode deals its fixed shards by share, so the
    bits do not change."""
    window: int = bounded(20, at_least=2)
    """Steps over which ``auto`` measures each rank's compute time per sample before it decides."""
    min_gain: float = bounded(0.1, at_least=0)
    """``auto`` changes the shares only when the predicted step time falls by more than this
    fraction (hysteresis: noise does not make the shares flap)."""
    max_share: float | None = bounded(None, above=0, fix=", or null for no cap")
    """The largest fraction of each global batch one rank may take (caps a fast rank's activation
    memory); at least ``1 / world size``. ``None``: no cap."""


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
    format: str = one_of("torch", ("torch", "dcp"))
    """``torch``: each checkpoint is one file, ``step_<N>.pt`` (``torch.save``), written by rank 0.
    ``dcp``: a directory, ``step_<N>.dcp/``, in torch's distributed checkpoint format: every rank
    writes its part (the replicated weights once, spread over the ranks; under ZeRO each rank its
    own optimizer shard, never gathered), and ``torch.distributed.checkpoint.load`` reads the model
    from it without ddptrain (docs/outputs-and-checkpoints.md). Resuming, ``ddptrain.load_model`` and
    ``ddptrain.export`` read both formats, whichever this run writes."""
    sharded: bool = False
    """ZeRO only (``dist.zero_stage=1|2``): each rank writes its own shard of the optimizer state
    to a file beside the checkpoint (``step_<N>.pt.optim-<rank>-of-<W>``), with no gather of the
    full state and no rank holding more than its shard; the checkpoint file holds the rest. Reading
    it puts the shards together, so it still resumes at any world size, with ZeRO or in plain DDP,
    and ``ddptrain.load_model`` reads it. ``false``: one consolidated file (docs/zero.md). With
    ``format=dcp`` the shards are always each rank's own, inside the checkpoint directory."""
    async_save: bool = False
    """Write the step checkpoints in the background: the step copies the state to host memory
    (pinned on CUDA) and training goes on while a thread of rank 0 writes it. At most one save is
    in flight (the next waits, and the log says so); a file appears only when whole, so a kill
    mid-write leaves the previous checkpoint as the latest. The end of training, a signal and
    ``trainer.max_time`` wait for the save in flight. Costs one copy of the checkpoint in host
    memory while it is written. Best checkpoints (``monitor``) are written in the foreground."""

    @property
    def shards_optimizer_state(self) -> bool:
        """Whether a ZeRO run's checkpoint keeps each rank's optimizer shard apart (``sharded``, or
        ``format=dcp``) instead of gathering the whole state."""
        return self.sharded or self.format == "dcp"


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
    max_time: str | None = checked(_check_max_time, "DD:HH:MM:SS", default=None)
    """Stop after this much wall time, ``DD:HH:MM:SS`` (e.g. ``00:11:50:00`` inside a 12-hour job
    slot): every rank stops at the same step with a checkpoint and the line to resume, as Ctrl-C
    does. The clock is this fit's own (a resumed run gets the whole time again). ``None``: no limit."""
    limit_train_batches: Any = checked(_check_batch_limit, "batches >= 1 or a fraction in (0, 1]", default=None)
    """Train on only part of each epoch: an integer (batches per rank, rounded up to whole
    optimizer steps) or a fraction of the epoch's steps, e.g. ``0.1``. Each epoch takes the
    first batches of its own shuffled order. ``None``: all."""
    limit_val_batches: Any = checked(_check_batch_limit, "batches >= 1 or a fraction in (0, 1]", default=None)
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
    fast_dev_run: Any = checked(_check_fast_dev_run, "true, false or batches >= 1", default=False)
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
    balance: BalanceConfig = field(default_factory=BalanceConfig)
    """Each rank's share of the global batch: equal, fixed weights, or by measured speed (``auto``)."""
    ema: EmaConfig = field(default_factory=EmaConfig)
    """An exponential moving average of the weights, checkpointed; ``ema.evaluate`` evaluates it."""
    grad_clip_norm: float | None = bounded(None, above=0, fix=", or null for no clipping")
    """Clip the global gradient norm to this value (``None``: no clipping)."""
    precision: str = checked(
        lambda key, value, t: check_precision(value, t.device), "32, bf16-mixed or 16-mixed (CUDA)", default="32"
    )
    """``32``; ``bf16-mixed`` (bfloat16 autocast, CPU and CUDA); ``16-mixed`` (float16 autocast with a
    gradient scaler, CUDA only)."""
    seed: int = 1234
    """Base seed: rank ``r`` seeds with ``seed + r``; the sampler shuffles with ``seed + epoch``."""
    device: str = checked(lambda key, value, t: check_device_name(value), "cpu or cuda", default="cpu")
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
    global sample position; the bits then differ from an uninterrupted run's). World-size-invariant
    runs (``world_size_invariant``) resume exactly at any world size without it."""
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


MONITOR_MODES = choices(EarlyStoppingConfig, "mode")
