"""``optimizer.*``: the default optimizer and its learning-rate schedule (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .schema import ConfigError, bounded, checked, choices, one_of

__all__ = ["OptimizerConfig", "SchedulerConfig", "OPTIMIZERS", "check_betas"]


def check_betas(key: str, betas: Any, _optimizer: Any = None) -> tuple[float, float]:
    """``optimizer.betas``' rule: two numbers, each in [0, 1). Returns them as a tuple."""
    try:
        pair = tuple(float(b) for b in betas)
    except (TypeError, ValueError):
        pair = ()
    if len(pair) != 2 or not all(0 <= b < 1 for b in pair):
        raise ConfigError(f"{key}={betas!r} must hold two numbers in [0, 1), e.g. [0.9, 0.999]")
    return pair


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
    betas: list = checked(check_betas, "two numbers in [0, 1)", default_factory=lambda: [0.9, 0.999])
    """``adam``/``adamw`` only: coefficients of the running averages."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    """Learning-rate schedule."""


OPTIMIZERS = choices(OptimizerConfig, "name")
