"""Step strategies: how one optimizer step's micro-batches become a parameter update.

The Trainer builds its strategy once, in ``setup``: the one of the config's mode
(:func:`ddptrain.modes.mode_of`; a new mode registers its own, docs/architecture.md: Adding a
mode), and its loop never asks which one it has. A strategy sees the loop as a
:class:`.view.LoopView`. Per optimizer step the loop calls, in this order:

1. :meth:`StepStrategy.batches` (once per epoch): the rest of the epoch, one item per step;
2. :meth:`StepStrategy.forward_backward`: forward and backward of the step's micro-batches, with
   the gradients reduced across ranks into ``.grad``; returns the step's loss;
3. :meth:`StepStrategy.optimizer_step`: unscale, clip, step every optimizer and its per-step
   schedule, zero the gradients (the strategy's :class:`OptimizerUpdate`);
4. :meth:`StepStrategy.samples`: how many of this rank's sampler positions the step covered (the
   loop reports them to the sampler, the one owner of the position in the epoch);
5. :meth:`StepStrategy.take_votes`: the stop votes summed over ranks in that step's reduction
   (``None`` when the step carried none: the loop then agrees with a collective of its own).

State a strategy keeps across steps goes into checkpoints through
:meth:`StepStrategy.state_dict` / :meth:`StepStrategy.load_state_dict`; the optimizers' and
schedules' entries through :meth:`StepStrategy.optimizer_state_dict` /
:meth:`StepStrategy.load_optimizer_state_dict`, which its :class:`OptimizerUpdate` answers (a
sharded optimizer consolidates them there).

Five strategies come with ddptrain (their modes and rules: :mod:`ddptrain.modes.builtin`):

- :class:`DataParallelSteps`: plain DDP. All micro-batches but the last run under ``no_sync()``;
  the last one's backward all-reduces the gradients in buckets, and the stop votes ride in that
  all-reduce (:meth:`ddptrain.ddp.DistributedDataParallel.register_sideband`).
- :class:`.invariant.InvariantSteps` (``trainer.world_size_invariant=true``): fixed shards and an
  exact integer sum, the same bits at any world size.
- :class:`.global_batch_steps.SharedBatchSteps` (``trainer.elastic=true`` or
  ``trainer.balance.shares`` in normal mode): plain DDP over one share per rank of each global
  batch, cut by position, so any number of members can share it; each rank's loss is weighted by
  its share.
- :class:`.zero_steps.ZeroSteps` (``dist.zero_stage=1|2``): plain DDP's backward with the buckets
  reduce-scattered, and ZeRO's update (:class:`.zero_steps.ZeroUpdate`): each rank steps its shard
  and all-gathers the parameters; a checkpoint consolidates the shards.
- :class:`.local_steps.LocalSteps` (``dist.sync=local_sgd|diloco``): no reduction in backward;
  every rank steps its own copy and the copies meet in an outer step every ``dist.sync_every``
  steps. Its ranks disagree between outer steps, so it also overrides
  :meth:`StepStrategy.synchronized_weights` (what evaluation and the final checksum see),
  :meth:`StepStrategy.model_state_dict` (the checkpoint's ``model`` entry) and
  :meth:`StepStrategy.end_fit`.

In-place elasticity would rebuild a strategy over the new group between two steps, which is why a
strategy holds no state that the checkpoint does not capture.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ..ddp import UnusedParametersError
from .data import batch_size_of, group_micro_batches, move_to, num_batches
from .view import LoopView

__all__ = [
    "OptimizerUpdate",
    "StepStrategy",
    "MicroBatchSteps",
    "DataParallelSteps",
    "ride_in_gradients",
    "unused_parameters_named_as_config",
]


class OptimizerUpdate:
    """How a step's reduced gradients update the parameters, and what of the optimizers' state a
    checkpoint holds: every rank holds every optimizer whole and steps it (plain DDP's update).

    A strategy owns one as ``update`` (:attr:`StepStrategy.update`) and delegates its
    ``optimizer_step`` and optimizer checkpoint entries to it. ZeRO's updates, which hold 1/W of the
    state on each rank, are in :mod:`.zero_steps`: a strategy whose mode composes with
    ``dist.zero_stage`` takes one of those instead.
    """

    def __init__(self, trainer: LoopView):
        self.trainer = trainer

    def step(self) -> None:
        """Unscale (16-mixed), clip (``trainer.grad_clip_norm``), :meth:`update_parameters`, the
        per-step schedules, zero every optimizer's gradients."""
        t = self.trainer
        clip = t.config.trainer.grad_clip_norm
        t.precision.unscale(t.optimizer_set.optimizers)  # 16-mixed: true gradients before clipping
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(t.model.parameters(), clip)
        elif t.config.trainer.log_grad_norm:
            norm = torch.nn.utils.get_total_norm([p.grad for p in t.model.parameters() if p.grad is not None])
        if t.config.trainer.log_grad_norm:
            log_grad_norm(t, norm)
        self.update_parameters()
        t.precision.update()
        step = t.state.step + 1  # the step being completed
        t.optimizer_set.step_schedules("step", step, t.callback_metrics, step)
        t.optimizer_set.zero_grad()

    def update_parameters(self) -> None:
        """Step every optimizer with the gradients in ``.grad`` (through the gradient scaler under
        16-mixed): :meth:`step`'s update, between clipping and the schedules."""
        self.trainer.optimizer_set.step(self.trainer.precision.scaler)

    def state_dict(self, optimizers: Any) -> dict[str, Any]:
        """The checkpoint's ``optimizer`` and ``scheduler`` entries: ``optimizers.state_dict()``."""
        return optimizers.state_dict()

    def shard(self) -> dict[str, Any] | None:
        """This rank's shard of the optimizer state, for a file of its own beside the checkpoint
        (``trainer.checkpoint.sharded``; then :meth:`state_dict` leaves it out), or None: the
        checkpoint's ``optimizer`` entry holds the whole state. Not collective."""
        return None

    def load_state_dict(self, optimizers: Any, checkpoint: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s entries of ``checkpoint`` into ``optimizers``."""
        optimizers.load_state_dict(checkpoint)


class StepStrategy(ABC):
    """One way of turning a step's micro-batches into a parameter update; see the module docstring.

    Args:
        trainer: the Trainer, once its model (in DDP), data, optimizers and precision are set up.
            A strategy uses only its public attributes.
        votes: this rank's stop votes (:meth:`.stopping.GracefulStop.votes`), to be cast after the
            step's backward and summed over ranks in the step's own reduction.
    """

    def __init__(self, trainer: LoopView, votes: Callable[[], list[float]]):
        self.trainer = trainer
        self.votes = votes
        self.update = OptimizerUpdate(trainer)
        """How the reduced gradients are applied and the optimizer state checkpointed: every
        optimizer whole on every rank, unless the strategy takes a sharded one (ZeRO's)."""

    @abstractmethod
    def batches(self) -> Iterator[Any]:
        """The rest of the current epoch, one item per optimizer step (what ``forward_backward`` takes)."""

    @abstractmethod
    def forward_backward(self, step: Any) -> float:
        """Forward and backward of one step; the gradients summed over ranks are in ``.grad``.
        Returns this step's loss (a Python float)."""

    @abstractmethod
    def samples(self, step: Any) -> int:
        """How many of this rank's sampler positions ``step`` covered. Called once per step, after
        the step was applied (a strategy may record the step as done here)."""

    def one_micro_batch(self, step: Any) -> Any:
        """One micro-batch of ``step`` (an item of :meth:`batches`), as ``training_step`` takes it:
        what the doctor's compute probe runs again. The last one by default."""
        return step[-1]

    def steps_done_in_epoch(self) -> int:
        """Optimizer steps of the current epoch already done, from the sampler's position (an
        epoch's last step may hold fewer micro-batches)."""
        t = self.trainer
        micro_batches = num_batches(t.state.samples_in_epoch, max(1, t.batch_size))
        return num_batches(micro_batches, t.config.trainer.grad_accum_steps)

    def close(self) -> None:
        """Release what the strategy attached to the model (hooks): it is being replaced, e.g.
        after an elastic job's membership changed. Nothing by default."""
        return None

    @abstractmethod
    def take_votes(self) -> list[float] | None:
        """The stop votes summed over ranks in the latest step, once (None if no step carried them)."""

    def optimizer_step(self) -> None:
        """Apply the reduced gradients: :meth:`OptimizerUpdate.step` of the strategy's ``update``."""
        self.update.step()

    def final_metrics(self) -> dict[str, Any]:
        """Entries of the strategy's own for ``metrics.json`` (the same on every rank; none by default)."""
        return {}

    @contextlib.contextmanager
    def synchronized_weights(self) -> Iterator[None]:
        """The weights every rank agrees on, in the model for the block: what evaluation, ``test``,
        ``predict`` and the final checksum use. The model's own after every step, except where the
        ranks train copies that meet only now and then (:mod:`.local_steps`)."""
        yield

    def end_fit(self) -> bool:
        """Called when the ranks agreed to stop early (``should_stop``): finish what the strategy
        owes the last steps (collective). True if the weights changed, so the last evaluation is
        out of date. Nothing to do by default."""
        return False

    def model_state_dict(self, model: Any) -> dict[str, Any]:
        """The checkpoint's ``model`` entry: ``model.state_dict()`` (the same on every rank)."""
        return model.state_dict()

    def optimizer_state_dict(self, optimizers: Any) -> dict[str, Any]:
        """The checkpoint's ``optimizer`` and ``scheduler`` entries, from ``optimizers`` (the fit's
        :class:`.optimizers.OptimizerSet`): :meth:`OptimizerUpdate.state_dict`. Collective."""
        return self.update.state_dict(optimizers)

    def optimizer_shard(self) -> dict[str, Any] | None:
        """This rank's shard of the optimizer state for a file of its own, or None: :meth:`OptimizerUpdate.shard`."""
        return self.update.shard()

    def load_optimizer_state_dict(self, optimizers: Any, checkpoint: dict[str, Any]) -> None:
        """Restore :meth:`optimizer_state_dict`'s entries of ``checkpoint`` into ``optimizers``."""
        self.update.load_state_dict(optimizers, checkpoint)

    def state_dict(self) -> dict[str, Any]:
        """What this strategy keeps across steps, for a checkpoint (nothing by default)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`. This one keeps nothing, so it refuses a state that holds
        something: that checkpoint was written by a strategy that needs it back."""
        if state:
            raise ValueError(
                f"the checkpoint holds step-strategy state ({', '.join(sorted(state))}) that "
                f"{type(self).__name__} does not keep: resume with the settings that wrote it"
            )


def accumulate_micro_batches(trainer: LoopView, micro_batches: Sequence[Any], reduce: bool) -> float:
    """Forward and backward of each micro-batch, each loss divided by their number, so ``.grad``
    holds the gradient of their mean. ``reduce``: the last backward all-reduces it over ranks (the
    others run under ``no_sync()``); otherwise every one does and ``.grad`` stays this rank's.
    Returns the step's loss on this rank."""
    t = trainer
    count, step_loss = len(micro_batches), 0.0
    for i, batch in enumerate(micro_batches):
        sync = reduce and i == count - 1
        with contextlib.nullcontext() if sync else t.model.no_sync():
            t.logged.batch_size = batch_size_of(batch)  # the weight of this micro-batch's self.log values
            with t.precision.autocast():  # trainer.precision: bf16/fp16 autocast, or nothing
                loss = t.training_step(t.model, move_to(batch, t.device, non_blocking=True))
            t.precision.backward(loss / count)  # scaled under 16-mixed
        step_loss += loss.item() / count
    return step_loss


def log_grad_norm(trainer: LoopView, norm: torch.Tensor) -> None:
    """``trainer.log_grad_norm``: the step's global gradient norm (after the reduction over ranks,
    before clipping: the same on every rank) as ``train/grad_norm``, averaged over the logging window."""
    trainer.log("train/grad_norm", norm, on_step=True, on_epoch=False, batch_size=1)


def ride_in_gradients(model: Any, votes: Callable[[], list[float]]) -> None:
    """Have DDP ``model`` sum ``votes()`` over ranks in each synchronised backward's last bucket (no
    collective of their own). Their number is fixed for the fit (the stop votes, and in an elastic
    job the admission vote), so one call tells the sideband's size."""
    model.register_sideband(len(votes()), votes)


class MicroBatchSteps(StepStrategy):
    """A step of ``trainer.grad_accum_steps`` micro-batches of this rank's samples (the last step of
    an epoch may get fewer), each loss divided by their number so the gradient is that of their
    mean: what plain DDP, ZeRO and local SGD share. Subclasses say whether backward reduces."""

    def batches(self) -> Iterator[list[Any]]:
        return group_micro_batches(self.trainer.train_batches(), self.trainer.config.trainer.grad_accum_steps)

    def samples(self, micro_batches: Sequence[Any]) -> int:
        return sum(batch_size_of(b) for b in micro_batches)


class DataParallelSteps(MicroBatchSteps):
    """Plain data parallelism through our DDP: gradients accumulated locally under ``no_sync()``
    and averaged over ranks in the last micro-batch's backward."""

    def __init__(self, trainer: LoopView, votes: Callable[[], list[float]]):
        super().__init__(trainer, votes)
        ride_in_gradients(trainer.model, votes)

    def forward_backward(self, micro_batches: Sequence[Any]) -> float:
        return accumulate_micro_batches(self.trainer, micro_batches, reduce=True)

    def take_votes(self) -> list[float] | None:
        return self.trainer.model.take_sideband()


@contextlib.contextmanager
def unused_parameters_named_as_config() -> Iterator[None]:
    """DDP's refusal of a backward that left parameters without a gradient, with the config key
    that turns on their detection instead of DDP's keyword."""
    try:
        yield
    except UnusedParametersError as exc:
        raise UnusedParametersError(exc.names, fix="set dist.find_unused_parameters=true") from None
