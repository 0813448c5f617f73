"""Callbacks: the interface, what they see of the trainer, and the built-ins."""

from __future__ import annotations

from ...config import TrainerConfig
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
    """The built-in callbacks ``config`` (``trainer.*``) asks for: progress, TensorBoard, (best)
    checkpoints, early stopping."""
    callbacks: list[Callback] = [ProgressCallback(bar={"true": True, "false": False}.get(config.progress))]
    if config.tensorboard:
        callbacks.append(TensorBoardCallback())
    if config.csv:
        callbacks.append(CSVLogger())
    if config.mlflow:
        callbacks.append(MLflowLogger())
    if config.wandb:
        callbacks.append(WandbLogger())
    if config.checkpoint_every_epochs or config.checkpoint_every_steps or config.checkpoint_at_end:
        callbacks.append(
            CheckpointCallback(
                every_epochs=config.checkpoint_every_epochs,
                every_steps=config.checkpoint_every_steps,
                at_end=config.checkpoint_at_end,
                keep_last=config.keep_last_checkpoints,
            )
        )
    if config.profile:
        callbacks.append(ProfilerCallback(config.profile_wait, config.profile_warmup, config.profile_active))
    if config.checkpoint_monitor:
        callbacks.append(
            BestCheckpoints(config.checkpoint_monitor, config.checkpoint_mode, config.checkpoint_save_top_k)
        )
    stop = config.early_stopping
    if stop.monitor:
        callbacks.append(EarlyStopping(stop.monitor, stop.mode, stop.patience, stop.min_delta))
    return callbacks
