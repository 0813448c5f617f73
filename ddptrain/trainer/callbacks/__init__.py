"""Callbacks: the interface, what they see of the trainer, and the built-ins."""

from __future__ import annotations

from ...config import ConfigError, TrainerConfig
from ...objects import instantiate
from .base import Callback, TrainerView
from .best import BestCheckpoints
from .checkpoint import CheckpointCallback
from .early_stopping import EarlyStopping
from .loggers import CSVLogger, MetricsLogger, MLflowLogger, WandbLogger
from .profiler import ProfilerCallback
from .progress import ProgressCallback
from .tensorboard import TensorBoardCallback

__all__ = [
    "Callback",
    "TrainerView",
    "BestCheckpoints",
    "CheckpointCallback",
    "EarlyStopping",
    "MetricsLogger",
    "CSVLogger",
    "MLflowLogger",
    "WandbLogger",
    "ProfilerCallback",
    "ProgressCallback",
    "TensorBoardCallback",
    "from_config",
]


def from_config(config: TrainerConfig) -> list[Callback]:
    """The callbacks ``config`` (``trainer.*``) asks for: the built-ins (progress, TensorBoard, (best)
    checkpoints, early stopping), then the user's own ``trainer.callbacks``."""
    callbacks: list[Callback] = [ProgressCallback(bar={"true": True, "false": False}.get(config.progress))]
    loggers = config.loggers
    if loggers.tensorboard:
        callbacks.append(TensorBoardCallback())
    if loggers.csv:
        callbacks.append(CSVLogger())
    if loggers.mlflow:
        callbacks.append(MLflowLogger())
    if loggers.wandb:
        callbacks.append(WandbLogger())
    saving = config.checkpoint
    if saving.every_epochs or saving.every_steps or saving.at_end:
        callbacks.append(
            CheckpointCallback(
                every_epochs=saving.every_epochs,
                every_steps=saving.every_steps,
                at_end=saving.at_end,
                keep_last=saving.keep_last,
            )
        )
    if config.profiler.enabled:
        callbacks.append(ProfilerCallback(config.profiler.wait, config.profiler.warmup, config.profiler.active))
    if saving.monitor:
        callbacks.append(BestCheckpoints(saving.monitor, saving.mode, saving.save_top_k))
    stop = config.early_stopping
    if stop.monitor:
        callbacks.append(EarlyStopping(stop.monitor, stop.mode, stop.patience, stop.min_delta))
    for i, spec in enumerate(config.callbacks):  # the user's own (trainer.callbacks)
        key = f"trainer.callbacks[{i}]"
        callback = instantiate(spec, key, "remove the entry")
        if not isinstance(callback, Callback):
            raise ConfigError(
                f"{key}: {spec.get('_target_')} made a {type(callback).__name__}, not a ddptrain.Callback: "
                "subclass ddptrain.Callback and override the hooks you need (on_log, on_epoch_end, ...)"
            )
        callbacks.append(callback)
    return callbacks
