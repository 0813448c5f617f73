"""ZeRO (``dist.zero_stage=1|2``): its step strategy, and its updates that other strategies take.

:class:`ZeroSteps` is ZeRO's own mode: plain DDP's micro-batches (``no_sync`` for all but the
last; the stop votes ride in the reduction, in an all-reduce of their own) with a sharded update.
The update is a component (:class:`~.steps.OptimizerUpdate`), so a mode whose backward differs
takes it too:

- :class:`ZeroUpdate`, for a backward that reduces in DDP's buckets (plain DDP's micro-batches,
  ``trainer.balance.shares``' shared batches): the reducer reduce-scatters the buckets, and
  :class:`ddptrain.ddp.zero.ZeroOptimizer` steps this rank's shard of every bucket and all-gathers
  the parameters; ``trainer.grad_clip_norm`` clips by the global norm over every rank's shard (one
  small all-reduce);
- :class:`WholeGradientUpdate`, for world-size-invariant mode, whose exact sum leaves the whole
  gradient on every rank (stage 1 only):
  :class:`ddptrain.ddp.zero_whole.WholeGradientZero` steps a contiguous range of the parameters and
  all-gathers them, so the bits are the unsharded step's.

**Checkpoints**: the ``optimizer`` entry is consolidated, in torch's per-parameter format, so a
checkpoint loads in plain DDP and at any world size (the shards are cut again on resume). With
``trainer.checkpoint.sharded=true`` or ``format=dcp`` each rank writes its own shard instead
(:meth:`ShardedUpdate.shard`), which reading the checkpoint puts together again.

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
from ..ddp.zero_whole import WholeGradientZero
from .steps import DataParallelSteps, OptimizerUpdate, log_grad_norm
from .view import LoopView

__all__ = ["ZeroSteps", "ShardedUpdate", "ZeroUpdate", "WholeGradientUpdate"]

log = logging.getLogger("ddptrain.trainer")


class ZeroSteps(DataParallelSteps):
    """Plain DDP's forward and backward, ZeRO's update (see the module docstring)."""

    def __init__(self, trainer: LoopView, votes: Callable[[], list[float]]):
        super().__init__(trainer, votes)
        self.update = ZeroUpdate(trainer)


class ShardedUpdate(OptimizerUpdate):
    """An update whose optimizer state is sharded over the ranks by ``zero`` (a
    :class:`~ddptrain.ddp.zero.ZeroOptimizer` or :class:`~ddptrain.ddp.zero_whole.WholeGradientZero`):
    the checkpoint entries they share."""

    zero: Any

    def state_dict(self, optimizers: Any) -> dict[str, Any]:
        """The consolidated state (collective), or, when each rank saves its own shard
        (``trainer.checkpoint.sharded`` or ``format=dcp``), the groups and the number of shards."""
        entries = optimizers.state_dict()  # the wrapped optimizer holds no state: only its groups
        if self.trainer.config.trainer.checkpoint.shards_optimizer_state:
            groups = entries["optimizer"]["param_groups"]
            return {**entries, "optimizer": {"param_groups": groups, "shards": self.trainer.world_size}}
        return {**entries, "optimizer": self.zero.state_dict()}

    def shard(self) -> dict[str, Any] | None:
        """This rank's shard for a checkpoint that keeps shards apart, else None (:meth:`state_dict`)."""
        return self.zero.shard_state_dict() if self.trainer.config.trainer.checkpoint.shards_optimizer_state else None

    def load_state_dict(self, optimizers: Any, checkpoint: dict[str, Any]) -> None:
        optimizers.load_state_dict(checkpoint)  # the full state into the trainer's optimizer, schedules
        self.zero.shard_loaded_state()  # ... then cut into this rank's shards


class ZeroUpdate(ShardedUpdate):
    """ZeRO-1/2 over DDP's buckets (see the module docstring). Built after the strategy registered
    its sideband: the reducer reduce-scatters from then on."""

    def __init__(self, trainer: LoopView):
        super().__init__(trainer)
        dist = trainer.config.dist
        optimizer = _single_optimizer(trainer)
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

    def step(self) -> None:
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


class WholeGradientUpdate(ShardedUpdate):
    """ZeRO-1 over whole gradients: world-size-invariant mode's (see the module docstring). Clipping
    and the schedules are plain DDP's (every rank holds the whole gradient); only the step is sharded."""

    def __init__(self, trainer: LoopView):
        super().__init__(trainer)
        optimizer = _single_optimizer(trainer)
        if trainer.precision.scaler is not None:
            raise ConfigError(
                "dist.zero_stage=1 in world-size-invariant mode steps shards of the parameters, and "
                "trainer.precision=16-mixed's gradient scaler steps whole optimizers: use trainer.precision=bf16-mixed"
            )
        try:
            self.zero = WholeGradientZero(optimizer, trainer.process_group)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        start, stop = self.zero.ranges[trainer.rank]
        log.info("ZeRO stage 1: this rank steps parameter elements %d-%d of %d", start, stop, self.zero.ranges[-1][1])

    def update_parameters(self) -> None:
        self.zero.step()


def _single_optimizer(trainer: LoopView) -> Any:
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
