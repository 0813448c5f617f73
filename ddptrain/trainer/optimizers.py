"""The optimizers of a fit: the default ones built from :class:`~ddptrain.config.OptimizerConfig`
(:func:`build_optimizer`, :func:`build_scheduler`, what ``configure_optimizers`` returns unless a
subclass overrides it), and what ``configure_optimizers`` may return, made into one object that
steps, zeroes, schedules and checkpoints every optimizer and learning-rate scheduler of a fit.

Accepted returns (Lightning's forms, with one ddptrain rule for bare schedulers):

- an optimizer;
- ``(optimizer, scheduler)``: the scheduler is stepped after every optimizer step (``None``: no scheduler);
- a list (or tuple) of optimizers: all are stepped and zeroed at every optimizer step (one
  backward computes every gradient; each optimizer updates its own parameters);
- ``([optimizers], [schedulers])``: both lists, bare schedulers stepped after every optimizer step;
- ``{"optimizer": opt, "lr_scheduler": sched_or_dict}``, or a list of such dicts, where the
  scheduler dict is ``{"scheduler": s, "interval": "epoch" | "step", "frequency": 1, "monitor": name}``
  (``interval`` defaults to ``"epoch"`` as in Lightning). ``ReduceLROnPlateau`` needs ``monitor``:
  it is stepped with that metric's latest value from ``trainer.callback_metrics`` (the same on
  every rank, so every rank's learning rate stays the same).

Anything else is refused with an error naming ``configure_optimizers`` and what it returned.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import ReduceLROnPlateau

from ..config import OPTIMIZERS, ConfigError, OptimizerConfig, check_betas
from .monitoring import missing_metric_error

__all__ = ["OptimizerSet", "Schedule", "INTERVALS", "build_optimizer", "build_scheduler"]

INTERVALS = ("step", "epoch")
_FORMS = (
    "an optimizer, (optimizer, scheduler), a list of optimizers, ([optimizers], [schedulers]), "
    '{"optimizer": ..., "lr_scheduler": scheduler or {"scheduler": ..., "interval": "step"|"epoch", '
    '"monitor": ...}}, or a list of such dicts'
)


def _describe(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        inner = ", ".join(type(v).__name__ for v in value)
        return f"a {type(value).__name__} of ({inner})"
    if isinstance(value, dict):
        return f"a dict with keys {sorted(map(str, value))}"
    return f"{type(value).__name__} {value!r}"[:200]


def _refuse(returned: Any, why: str = "") -> ConfigError:
    why = f" ({why})" if why else ""
    return ConfigError(f"configure_optimizers returned {_describe(returned)}{why}; return {_FORMS}")


def _is_scheduler(value: Any) -> bool:
    return not isinstance(value, Optimizer) and callable(getattr(value, "step", None)) and hasattr(value, "state_dict")


@dataclass
class Schedule:
    """One learning-rate scheduler and when it is stepped."""

    scheduler: Any
    interval: str = "step"
    """``"step"``: after every optimizer step; ``"epoch"``: at every epoch end (after its evaluation)."""
    frequency: int = 1
    """Step it every this many intervals."""
    monitor: str | None = None
    """For ``ReduceLROnPlateau``: the metric it is stepped with."""

    @property
    def on_plateau(self) -> bool:
        return isinstance(self.scheduler, ReduceLROnPlateau)


class OptimizerSet:
    """Every optimizer and scheduler of a fit: step, zero, schedule, checkpoint.

    Args:
        optimizers: at least one; no parameter may belong to two of them.
        schedules: each attached to one of ``optimizers``.
    """

    def __init__(self, optimizers: Sequence[Optimizer], schedules: Sequence[Schedule] = ()):
        self.optimizers = list(optimizers)
        self.schedules = list(schedules)

    @property
    def optimizer(self) -> Optimizer:
        """The first optimizer (the one whose learning rate ``train/lr`` reports)."""
        return self.optimizers[0]

    @property
    def scheduler(self) -> Any:
        """The first scheduler, or None."""
        return self.schedules[0].scheduler if self.schedules else None

    @classmethod
    def from_hook(cls, returned: Any) -> OptimizerSet:
        """Normalise what ``configure_optimizers`` returned (see the module docstring).

        Raises:
            ConfigError: naming ``configure_optimizers``, what it returned and the accepted forms.
        """
        optimizers, schedules = _normalise(returned)
        if not optimizers:
            raise _refuse(returned, "no optimizer")
        _check(optimizers, schedules, returned)
        return cls(optimizers, schedules)

    def step(self, scaler: Any = None) -> None:
        """Step every optimizer (through ``scaler``, a ``GradScaler``, when given)."""
        for optimizer in self.optimizers:
            if scaler is None:
                optimizer.step()
            else:
                scaler.step(optimizer)

    def learning_rates(self) -> dict[str, float]:
        """``train/lr/<optimizer>/pg<i>`` of every optimizer's every parameter group, when there is
        more than one group in all (``train/lr`` alone, the first group's, is the training log's
        own); the optimizer is named by its class, with its index when several share one."""
        groups = [(o, i, g) for o in self.optimizers for i, g in enumerate(o.param_groups)]
        if len(groups) < 2:
            return {}
        names = [type(o).__name__ for o in self.optimizers]
        name = {id(o): n if names.count(n) == 1 else f"{n}{k}" for k, (o, n) in enumerate(zip(self.optimizers, names))}
        return {f"train/lr/{name[id(o)]}/pg{i}": float(g["lr"]) for o, i, g in groups}

    def zero_grad(self) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)

    def step_schedules(self, interval: str, count: int, metrics: dict[str, float], step: int) -> None:
        """Step the schedules of ``interval`` due at its ``count``-th occurrence (1-based).

        ``ReduceLROnPlateau`` gets ``metrics[monitor]``; ``step`` is for the error when it is missing.
        """
        for schedule in self.schedules:
            if schedule.interval != interval or count % schedule.frequency:
                continue
            if not schedule.on_plateau:
                schedule.scheduler.step()
                continue
            if schedule.monitor not in metrics:
                raise missing_metric_error("ReduceLROnPlateau", schedule.monitor, metrics, step)
            schedule.scheduler.step(float(metrics[schedule.monitor]))

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint's ``optimizer`` and ``scheduler`` entries: one state dict each when there is
        one (the layout of single-optimizer checkpoints), else lists in the order returned."""
        optimizers = [o.state_dict() for o in self.optimizers]
        schedulers = [s.scheduler.state_dict() for s in self.schedules]
        return {
            "optimizer": optimizers[0] if len(optimizers) == 1 else optimizers,
            "scheduler": (schedulers[0] if len(schedulers) == 1 else schedulers) if schedulers else None,
        }

    def load_state_dict(self, checkpoint: dict[str, Any]) -> None:
        """Restore from a checkpoint's ``optimizer`` and ``scheduler`` entries.

        Raises:
            ConfigError: when the checkpoint holds another number of optimizers or schedulers.
        """
        saved = checkpoint["optimizer"]
        saved = saved if isinstance(saved, list) else [saved]
        _same_count("optimizer", len(saved), len(self.optimizers))
        for optimizer, state in zip(self.optimizers, saved):
            optimizer.load_state_dict(state)
        schedulers = checkpoint.get("scheduler")
        if schedulers is None:
            return  # older checkpoints of runs without a scheduler; a new scheduler starts fresh
        schedulers = schedulers if isinstance(schedulers, list) else [schedulers]
        _same_count("scheduler", len(schedulers), len(self.schedules))
        for schedule, state in zip(self.schedules, schedulers):
            schedule.scheduler.load_state_dict(state)


def _same_count(what: str, saved: int, now: int) -> None:
    if saved != now:
        raise ConfigError(
            f"the checkpoint holds {saved} {what} state(s) but configure_optimizers now returns {now}: "
            f"resume with the configure_optimizers that wrote it, or start a new run"
        )


def _normalise(returned: Any) -> tuple[list[Optimizer], list[Schedule]]:
    if isinstance(returned, Optimizer):
        return [returned], []
    if isinstance(returned, dict):
        return _from_dict(returned, returned)
    if not isinstance(returned, (list, tuple)) or not returned:
        raise _refuse(returned)
    items = list(returned)
    if len(items) == 2 and isinstance(items[0], Optimizer) and (items[1] is None or _is_scheduler(items[1])):
        return [items[0]], [] if items[1] is None else [_bare(items[1], returned)]
    if len(items) == 2 and all(isinstance(i, (list, tuple)) for i in items):
        optimizers, schedulers = list(items[0]), list(items[1])
        if all(isinstance(o, Optimizer) for o in optimizers) and all(map(_is_scheduler, schedulers)):
            return optimizers, [_bare(s, returned) for s in schedulers]
        raise _refuse(returned, "expected ([optimizers], [schedulers])")
    if all(isinstance(i, Optimizer) for i in items):
        return items, []
    if all(isinstance(i, dict) for i in items):
        optimizers, schedules = [], []
        for item in items:
            more_optimizers, more_schedules = _from_dict(item, returned)
            optimizers += more_optimizers
            schedules += more_schedules
        return optimizers, schedules
    raise _refuse(returned)


def _bare(scheduler: Any, returned: Any) -> Schedule:
    if isinstance(scheduler, ReduceLROnPlateau):
        raise _refuse(
            returned,
            "ReduceLROnPlateau needs a metric: return it as "
            '{"optimizer": opt, "lr_scheduler": {"scheduler": plateau, "monitor": "eval/loss"}}',
        )
    return Schedule(scheduler, interval="step")


def _from_dict(entry: dict, returned: Any) -> tuple[list[Optimizer], list[Schedule]]:
    unknown = set(entry) - {"optimizer", "lr_scheduler", "monitor"}
    if unknown or not isinstance(entry.get("optimizer"), Optimizer):
        why = f"unknown key(s) {sorted(unknown)}" if unknown else "'optimizer' must be an optimizer"
        raise _refuse(returned, why)
    spec = entry.get("lr_scheduler")
    if spec is None:
        return [entry["optimizer"]], []
    if not isinstance(spec, dict):
        spec = {"scheduler": spec}
    known = {"scheduler", "interval", "frequency", "monitor", "name", "strict"}
    if set(spec) - known or not _is_scheduler(spec.get("scheduler")):
        raise _refuse(returned, f"lr_scheduler must be a scheduler or a dict with keys {sorted(known)}")
    schedule = Schedule(
        spec["scheduler"],
        interval=spec.get("interval", "epoch"),
        frequency=int(spec.get("frequency", 1)),
        monitor=spec.get("monitor", entry.get("monitor")),
    )
    if schedule.interval not in INTERVALS or schedule.frequency < 1:
        raise _refuse(returned, f"interval={schedule.interval!r} must be 'step' or 'epoch', frequency >= 1")
    if schedule.on_plateau and not schedule.monitor:
        raise _refuse(returned, 'ReduceLROnPlateau needs "monitor": the metric it watches, e.g. "eval/loss"')
    return [entry["optimizer"]], [schedule]


def _check(optimizers: list[Optimizer], schedules: list[Schedule], returned: Any) -> None:
    """No parameter in two optimizers (it would be updated twice); every scheduler drives one of them."""
    owner: dict[int, int] = {}
    for index, optimizer in enumerate(optimizers):
        for group in optimizer.param_groups:
            for p in group["params"]:
                if owner.setdefault(id(p), index) != index:
                    raise _refuse(
                        returned,
                        f"a parameter of shape {tuple(p.shape)} is in optimizers {owner[id(p)]} and {index}: "
                        "it would be updated twice per step; give each optimizer its own parameters",
                    )
    for schedule in schedules:
        target = getattr(schedule.scheduler, "optimizer", None)
        if target is not None and not any(target is o for o in optimizers):
            raise _refuse(returned, f"{type(schedule.scheduler).__name__} drives an optimizer that was not returned")


# == the defaults: from the config =============================================================
def build_optimizer(config: OptimizerConfig, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """SGD, Adam or AdamW with the config's hyper-parameters."""
    params = [p for p in params if p.requires_grad]
    if config.name == "sgd":
        return torch.optim.SGD(
            params, lr=config.lr, momentum=config.momentum, nesterov=config.nesterov, weight_decay=config.weight_decay
        )
    betas = check_betas("optimizer.betas", config.betas)  # the field's rule (a script may not have validated)
    if config.name == "adam":
        return torch.optim.Adam(params, lr=config.lr, betas=betas, weight_decay=config.weight_decay)
    if config.name == "adamw":
        return torch.optim.AdamW(params, lr=config.lr, betas=betas, weight_decay=config.weight_decay)
    raise ConfigError(f"optimizer.name={config.name!r} is not one of {', '.join(OPTIMIZERS)}")


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
