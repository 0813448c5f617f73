"""The Trainer, its configuration, callbacks and checkpoint files."""

from .callbacks import Callback, CheckpointCallback, ProgressCallback, TensorBoardCallback
from .checkpoint_io import CheckpointError, CheckpointWarning, latest_valid_checkpoint, load_checkpoint
from .config import (
    Config,
    ConfigError,
    DataConfig,
    DistConfig,
    LauncherConfig,
    OptimizerConfig,
    RecipeConfig,
    SchedulerConfig,
    TrainerConfig,
)
from .runner import run
from .trainer import SmokeCheckError, Trainer, TrainState

__all__ = [
    "Trainer",
    "TrainState",
    "SmokeCheckError",
    "Callback",
    "CheckpointCallback",
    "ProgressCallback",
    "TensorBoardCallback",
    "CheckpointError",
    "CheckpointWarning",
    "load_checkpoint",
    "latest_valid_checkpoint",
    "Config",
    "ConfigError",
    "RecipeConfig",
    "DistConfig",
    "LauncherConfig",
    "DataConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "TrainerConfig",
    "run",
]
