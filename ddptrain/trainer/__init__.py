"""The Trainer, its configuration, callbacks and checkpoint files."""

from ..config import (
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
from .callbacks import (
    BestCheckpoints,
    Callback,
    CheckpointCallback,
    CSVLogger,
    EarlyStopping,
    MetricsLogger,
    MLflowLogger,
    ProgressCallback,
    TensorBoardCallback,
    TrainerView,
    WandbLogger,
)
from .checkpoint import CheckpointError, CheckpointWarning, TrainState, latest_valid_checkpoint, load_checkpoint
from .metrics import SmokeCheckError
from .trainer import Trainer

__all__ = [
    "Trainer",
    "TrainState",
    "SmokeCheckError",
    "Callback",
    "TrainerView",
    "CheckpointCallback",
    "BestCheckpoints",
    "ProgressCallback",
    "TensorBoardCallback",
    "EarlyStopping",
    "MetricsLogger",
    "CSVLogger",
    "MLflowLogger",
    "WandbLogger",
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
]
