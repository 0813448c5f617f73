"""ZeRO as a step strategy (``dist.zero_stage=1|2``): plain DDP's micro-batches, a sharded optimizer.

Forward and backward are :class:`.steps.DataParallelSteps`' (``no_sync`` for all micro-batches
but the last; the stop votes ride in the reduction, in an all-reduce of their own). What changes:

- **the update**: :class:`ddptrain.ddp.zero.ZeroOptimizer` steps this rank's shard of every
  bucket and all-gathers the parameters; ``trainer.grad_clip_norm`` clips by the global norm
  over every rank's shard (one small all-reduce);
- **checkpoints**: the ``optimizer`` entry is consolidated, in torch's per-parameter format, so a
  checkpoint loads in plain DDP and at any world size (the shards are cut again on resume). With
  ``trainer.checkpoint.sharded=true`` each rank writes its shard to a file of its own instead
  (:meth:`optimizer_shard`), which reading the checkpoint puts together again.

The trainer's ``optimizer`` keeps its ``param_groups`` (what schedulers and ``train/lr`` use) but
never holds state: the shards' optimizer does. Refused here: more than one optimizer. What the
config cannot combine with ZeRO is refused before any process starts, by its mode's rules
(``ZERO`` in :mod:`ddptrain.modes.builtin`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

from ..config import ConfigError
from ..ddp.comm_hooks import COMPRESSIONS
from ..ddp.zero import ZeroOptimizer
from .steps import DataParallelSteps, log_grad_norm
from .view import LoopView

__all__ = ["ZeroSteps", "single_optimizer", "sharded_optimizer_entries", "sharded_optimizer_shard"]

log = logging.getLogger("ddptrain.trainer")


class ZeroSteps(DataParallelSteps):
    """Plain DDP's forward and backward, a ZeRO update (see the module docstring)."""

    def __init__(self, trainer: LoopView, votes: Callable[[], list[float]]):
        super().__init__(trainer, votes)
        dist = trainer.config.dist
        optimizer = single_optimizer(trainer)
        try:
            reduce_dtype = COMPRESSIONS[dist.grad_compression][0] if dist.grad_compression != "none" else None
            self.zero = ZeroOptimizer(trainer.model, optimizer, dist.zero_stage, dist.algorithm, reduce_dtype)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        held = sum(hi - lo for ranges in self.zero.shard_gradient_elements().values() for lo, hi in ranges)
        total = sum(p.numel() for p in trainer.model.reducer.params)
        log.info(
            "ZeRO stage %d (%s reduce-scatter%s): this rank steps %d of %d parameter elements",
            dist.zero_stage,
            dist.algorithm,
            "" if reduce_dtype is None else f" in {dist.grad_compression}",
            held,
            total,
        )

    def optimizer_step(self) -> None:
        t = self.trainer
        clip = t.config.trainer.grad_clip_norm
        if clip is not None or t.config.trainer.log_grad_norm:  # the norm over every rank's shards
            norm = self.zero.clip_grad_norm_(math.inf if clip is None else clip)  # inf: scales by exactly 1
            if t.config.trainer.log_grad_norm:
                log_grad_norm(t, norm)
        if self.zero.step(all_gather=False):  # False: nothing stepped, so nothing to gather
            with t.phases.span("param_all_gather"):  # communication: the doctor counts it as such
                self.zero.all_gather_params()
        step = t.state.step + 1  # the step being completed
        t.optimizer_set.step_schedules("step", step, t.callback_metrics, step)
        self.zero.zero_grad()

    def optimizer_state_dict(self, optimizers: Any) -> dict[str, Any]:
        return sharded_optimizer_entries(self.zero, self.trainer, optimizers)

    def optimizer_shard(self) -> dict[str, Any] | None:
        return sharded_optimizer_shard(self.zero, self.trainer)

    def load_optimizer_state_dict(self, optimizers: Any, checkpoint: dict[str, Any]) -> None:
        optimizers.load_state_dict(checkpoint)  # the full state into the trainer's optimizer, schedules
        self.zero.shard_loaded_state()  # ... then cut into this rank's shards


def single_optimizer(trainer: LoopView) -> Any:
    """The fit's one optimizer, which ZeRO shards.

    Raises:
        ConfigError: ``configure_optimizers`` returned more than one.
    """
    optimizers = trainer.optimizer_set.optimizers
    if len(optimizers) != 1:
        stage = trainer.config.dist.zero_stage
        raise ConfigError(
            f"dist.zero_stage={stage} shards one optimizer, and configure_optimizers returned {len(optimizers)}: "
            "return a single optimizer (parameter groups may differ in hyper-parameters), or train with "
            "dist.zero_stage=0"
        )
    return optimizers[0]


def sharded_optimizer_entries(zero: Any, trainer: LoopView, optimizers: Any) -> dict[str, Any]:
    """A checkpoint's ``optimizer`` and ``scheduler`` entries when ``zero`` (a
    :class:`~ddptrain.ddp.zero.ZeroOptimizer` or :class:`~ddptrain.ddp.zero_whole.WholeGradientZero`)
    holds the state: the consolidated state (collective), or, when each rank saves its own shard
    (``trainer.checkpoint.sharded`` or ``format=dcp``), the groups and the number of shards."""
    entries = optimizers.state_dict()  # the wrapped optimizer holds no state: only its groups
    if trainer.config.trainer.checkpoint.shards_optimizer_state:
        groups = entries["optimizer"]["param_groups"]
        return {**entries, "optimizer": {"param_groups": groups, "shards": trainer.world_size}}
    return {**entries, "optimizer": zero.state_dict()}


def sharded_optimizer_shard(zero: Any, trainer: LoopView) -> dict[str, Any] | None:
    """This rank's shard for a checkpoint that keeps shards apart, else None (:func:`sharded_optimizer_entries`)."""
    return zero.shard_state_dict() if trainer.config.trainer.checkpoint.shards_optimizer_state else None
