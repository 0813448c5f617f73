"""ddptrain: distributed data-parallel training with its own DDP, process groups and trainer."""

__version__ = "0.1.0"

from ddptrain._exports import lazy_exports

# Public names, imported on first use: `python -m ddptrain --help` and config errors then answer
# without paying for `import torch` (seconds on a busy machine).
_EXPORTS = {
    "DistributedDataParallel": "ddptrain.ddp",
    "Trainer": "ddptrain.trainer",
    "TrainState": "ddptrain.trainer",
    "Callback": "ddptrain.trainer",
    "EarlyStopping": "ddptrain.trainer",
    "CSVLogger": "ddptrain.trainer",
    "MLflowLogger": "ddptrain.trainer",
    "WandbLogger": "ddptrain.trainer",
    "Config": "ddptrain.trainer",
    "TrainerConfig": "ddptrain.trainer",
    "DataConfig": "ddptrain.trainer",
    "DistConfig": "ddptrain.trainer",
    "OptimizerConfig": "ddptrain.trainer",
    "SchedulerConfig": "ddptrain.trainer",
    "RecipeConfig": "ddptrain.trainer",
    "LauncherConfig": "ddptrain.trainer",
    "ConfigError": "ddptrain.config",
    "CheckpointError": "ddptrain.errors",
    "SmokeCheckError": "ddptrain.errors",
    "DatasetNotFoundError": "ddptrain.errors",
    "run": "ddptrain.runner",
    "plugin_callbacks": "ddptrain.runner",
    "load_model": "ddptrain.loading",
    "BestCheckpoints": "ddptrain.trainer",
}
__all__ = ["__version__", *_EXPORTS]

__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
del lazy_exports
