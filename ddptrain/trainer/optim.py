"""Optimizers and learning-rate schedules built from :class:`OptimizerConfig`."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from ..config import ConfigError, OptimizerConfig

__all__ = ["build_optimizer", "build_scheduler"]


def build_optimizer(config: OptimizerConfig, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """SGD, Adam or AdamW with the config's hyper-parameters."""
    params = [p for p in params if p.requires_grad]
    if config.name == "sgd":
        return torch.optim.SGD(
            params, lr=config.lr, momentum=config.momentum, nesterov=config.nesterov, weight_decay=config.weight_decay
        )
    betas = tuple(float(b) for b in config.betas)
    if len(betas) != 2:
        raise ConfigError(f"optimizer.betas={list(config.betas)} must hold two numbers")
    if config.name == "adam":
        return torch.optim.Adam(params, lr=config.lr, betas=betas, weight_decay=config.weight_decay)
    if config.name == "adamw":
        return torch.optim.AdamW(params, lr=config.lr, betas=betas, weight_decay=config.weight_decay)
    raise ConfigError(f"optimizer.name={config.name!r} is not one of sgd, adam, adamw")


def build_scheduler(
    config: OptimizerConfig, optimizer: torch.optim.Optimizer, total_steps: int
) -> torch.optim.lr_scheduler.LRScheduler | None:
    """A ``LambdaLR`` stepped once per optimizer step, or ``None`` for a constant rate.

    Its state (the step count) round-trips through checkpoints; the schedule itself is rebuilt
    from the config.
    """
    s = config.scheduler
    if s.name == "none" and s.warmup_steps == 0:
        return None
    warmup = max(0, s.warmup_steps)
    total = max(1, total_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if s.name == "step":
            return s.gamma ** ((step - warmup) // max(1, s.step_size))
        if s.name == "cosine":
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
