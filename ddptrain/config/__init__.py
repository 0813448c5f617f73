"""The configuration of a training run: nested dataclasses, one docstring per field.

The same tree comes from Hydra (``conf/``, through ``ddptrain.cli``) or from plain Python::

    config = Config.from_dict({"recipe": {"trainer_class": "ddptrain.recipes.mnist.MnistTrainer"},
                               "trainer": {"epochs": 1}})

:meth:`Config.from_dict` refuses unknown keys (suggesting the closest known one) and values of
the wrong type, naming the dotted key, so a typo never silently falls back to a default.

One module per section, next to what reads it: :mod:`.dist` (``dist.*``, ``launcher.*``),
:mod:`.data`, :mod:`.optimizer`, :mod:`.trainer` (``trainer.*``, ``doctor.*``, ``lr_find.*``);
this package's ``__init__`` holds the root :class:`Config` and how it is built from
dictionaries. Each field's rule is written once, next to its default (:mod:`.schema`:
:func:`~.schema.one_of`, :func:`~.schema.bounded`, :func:`~.schema.checked`), and
:func:`check_fields` enforces them all. What needs more than one section or the job (the world
size's batch split, the modes' rules, the machine's devices) is :mod:`ddptrain.preflight`'s and
:mod:`ddptrain.modes`'; importing a dotted path named in a config is :mod:`ddptrain.objects`'.
Nothing here imports Hydra or torch.
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

from .data import DataConfig
from .dist import DEFAULT_BUCKET_CAP_MB, DistConfig, LauncherConfig
from .optimizer import OPTIMIZERS, OptimizerConfig, SchedulerConfig, check_betas
from .schema import ConfigError, check_fields, field_type_text
from .trainer import (
    MONITOR_MODES,
    PRECISIONS,
    BalanceConfig,
    CheckpointConfig,
    DoctorConfig,
    EarlyStoppingConfig,
    EmaConfig,
    LoggersConfig,
    LrFindConfig,
    ProfilerConfig,
    TrainerConfig,
    check_device_name,
    check_precision,
    max_time_seconds,
)

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
    "BalanceConfig",
    "CheckpointConfig",
    "ProfilerConfig",
    "LoggersConfig",
    "LrFindConfig",
    "check_fields",
    "check_betas",
    "check_device_name",
    "check_precision",
    "field_type_text",
    "max_time_seconds",
    "default_output_dir",
    "DEFAULT_BUCKET_CAP_MB",
    "PRECISIONS",
    "OPTIMIZERS",
    "MONITOR_MODES",
]


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


def default_output_dir(config: Config) -> str:
    """The run directory of a run that names none: ``outputs/<recipe.name>/<YYYY-MM-DD_HH-MM-SS>``
    (relative to the working directory; ``conf/config.yaml``'s ``hydra.run.dir`` is the same)."""
    import time

    return os.path.join("outputs", config.recipe.name, time.strftime("%Y-%m-%d_%H-%M-%S"))


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
