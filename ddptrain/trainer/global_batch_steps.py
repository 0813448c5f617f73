"""Steps that walk an epoch by global sample position, whoever computes them.

:mod:`ddptrain.data.global_batches` cuts each optimizer step's global batch into contiguous shards
by position in the epoch's order. Two step strategies walk the data that way, and share
:class:`GlobalBatchSteps`:

- :class:`.invariant.InvariantSteps` (``trainer.world_size_invariant=true``): ``virtual_ranks``
  shards per micro-batch, spread over the ranks and summed exactly;
- :class:`SharedBatchSteps` (``trainer.elastic=true`` or ``trainer.balance.shares`` in normal
  mode): one shard per rank and micro-batch, each rank's gradient weighted by its share, reduced
  by our DDP (with ``dist.zero_stage``, reduce-scattered into ZeRO's update).

What they share: the position in the epoch (the samples of the epoch's order the applied steps
took). It is exact at any world size and survives a change of it, where the sampler's per-rank
count times the world size does not once the world size no longer divides what was consumed.
It travels in checkpoints and in an elastic job's state hand-over (:meth:`GlobalBatchSteps.state_dict`).

Each shard is read by index in the training process (:meth:`GlobalBatchSteps.load_shard`), collated
with a ``train_dataloader()`` DataLoader's ``collate_fn``: that DataLoader's worker processes are
not used in these modes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset, TensorDataset, default_collate

from ..config import ConfigError
from ..data.global_batches import StepShards, epoch_order, shards_of_step
from .balance import Balancer
from .data import move_to
from .steps import StepStrategy, ride_in_gradients
from .view import LoopView
from .zero_steps import ZeroUpdate

__all__ = ["GlobalBatchSteps", "GlobalStep", "SharedBatchSteps"]


@dataclass(frozen=True)
class GlobalStep:
    """One optimizer step of this rank: its shards, the epoch's order, and how many of this rank's
    sampler positions it covers (``rank_samples``, what the Trainer reports to the sampler)."""

    epoch: int
    work: StepShards
    order: torch.Tensor
    rank_samples: int


class GlobalBatchSteps(StepStrategy):
    """A step strategy whose steps are global batches cut into ``shards_per_micro_batch`` shards
    per micro-batch by position, of which this rank computes the shards ``mine``; see the module
    docstring. Subclasses implement ``forward_backward`` and ``take_votes``."""

    def __init__(self, trainer: LoopView, votes: Callable[[], list[float]], shards_per_micro_batch: int, mine: range):
        super().__init__(trainer, votes)
        cfg = trainer.config
        self.shards_per_micro_batch = shards_per_micro_batch
        self.mine = mine
        self.micro_batches = cfg.trainer.grad_accum_steps
        self.global_batch = cfg.data.global_batch_size
        # (epoch, samples of that epoch's order the applied steps took); None: take the sampler's.
        self.position: tuple[int, int] | None = None
        self.balancer: Balancer | None = None
        """``trainer.balance``: each rank's share (:mod:`.balance`); None: equal shares."""

    def balance_by(self, units: int) -> None:
        """Take shares from ``trainer.balance`` (when set), cutting a micro-batch in ``units``."""
        config = self.trainer.config
        if config.trainer.balance.shares != "off":
            self.balancer = Balancer(config.trainer.balance, self.trainer.process_group, units, self.global_batch)
            self.follow_shares()

    def follow_shares(self) -> None:
        """Apply the balancer's new shares to how steps are cut (a subclass's; called at a step boundary)."""

    @property
    def slice_weights(self) -> list[float] | None:
        """Weights to cut each micro-batch's ``shards_per_micro_batch`` slices by (None: equally)."""
        return None

    def batches(self) -> Iterator[GlobalStep]:
        """The rest of this epoch, one :class:`GlobalStep` per optimizer step."""
        sampler, world_size = self.trainer.train_sampler, self.trainer.world_size
        dataset_len = sampler.dataset_len
        start = self._global_position()  # the same for every world size
        sampler.set_consumed(-(-start // world_size))  # this world size's count, as its steps advance it
        order = epoch_order(dataset_len, sampler.seed, sampler.epoch, sampler.shuffle)
        # Every rank is done setting up (a resume restores the global generator) before any shard
        # draws from it: ranks that are threads (ddptrain.testing.run_threaded) share that generator.
        self.trainer.process_group.barrier().wait()
        while start < dataset_len:
            if self.balancer is not None and self.balancer.at_step_boundary(self.trainer.state.step):
                self.follow_shares()  # every rank at once: the same step boundary, the same decision
            end = min(start + self.global_batch, dataset_len)
            work = shards_of_step(
                start, end - start, self.micro_batches, self.shards_per_micro_batch, self.mine, self.slice_weights
            )
            rank_samples = -(-end // world_size) - -(-start // world_size)
            if self.balancer is not None:  # the shares of this step, for the loggers (TensorBoard, CSV)
                for r, weight in enumerate(self.balancer.weights):
                    self.trainer.log(f"balance/share_r{r}", weight, reduce="max", on_step=True, on_epoch=False)
            yield GlobalStep(sampler.epoch, work, order, rank_samples)
            start = end

    def load_shard(self, step: GlobalStep, start: int, end: int) -> Any:
        """The samples at positions ``[start, end)`` of the step's epoch order, as one batch on the
        trainer's device, collated as a ``train_dataloader()`` DataLoader's ``collate_fn`` would."""
        t = self.trainer
        indices = step.order[start:end]
        options = t.train_loader_options
        collate = (options or {}).get("collate_fn") or default_collate
        dataset: Dataset = t.train_set
        if isinstance(dataset, TensorDataset) and collate is default_collate:
            batch = tuple(x.index_select(0, indices) for x in dataset.tensors)  # x[indices]'s, cheaper
        else:
            batch = collate([dataset[i] for i in indices.tolist()])
        return move_to(batch, t.device, non_blocking=True)

    def one_micro_batch(self, step: GlobalStep) -> Any:
        """This rank's last shard of ``step`` that holds samples (the doctor's compute probe)."""
        shard = next(s for s in reversed(step.work.shards) if s.size > 0)
        return self.load_shard(step, shard.start, shard.end)

    def samples(self, step: GlobalStep) -> int:
        self.position = (step.epoch, step.work.start + step.work.num_samples)  # the step is applied
        return step.rank_samples

    def final_metrics(self) -> dict[str, Any]:
        """``balance``: the shares at the end and every change (``trainer.balance``), else nothing."""
        return {} if self.balancer is None else {"balance": self.balancer.report()}

    def steps_done_in_epoch(self) -> int:
        """Every step of an epoch but its last takes a whole global batch."""
        return -(-self._global_position() // self.global_batch)

    def _global_position(self) -> int:
        """Samples of the current epoch's order the applied steps took: the recorded position, or
        (a new epoch, a checkpoint written before positions were recorded) the sampler's count
        times the world size, exact at the world size that wrote it."""
        sampler = self.trainer.train_sampler
        if self.position is not None and self.position[0] == sampler.epoch:
            return self.position[1]
        return min(sampler.consumed * self.trainer.world_size, sampler.dataset_len)

    def state_dict(self) -> dict[str, Any]:
        """The exact position in the epoch (none before the first step) and, with
        ``trainer.balance``, the shares and their history (:meth:`.balance.Balancer.state_dict`)."""
        state = {} if self.position is None else {"epoch": self.position[0], "position": self.position[1]}
        if self.balancer is not None:
            state["balance"] = self.balancer.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; without a position (a checkpoint written before the first
        step, or before positions were recorded) the sampler's count stands. A balance state is
        taken when this run balances too (and ignored when it does not)."""
        self.position = (int(state["epoch"]), int(state["position"])) if "position" in state else None
        if self.balancer is not None and "balance" in state:
            self.balancer.load_state_dict(state["balance"])
            self.follow_shares()


class SharedBatchSteps(GlobalBatchSteps):
    """Plain data parallelism over a global batch that any number of ranks can share: the step
    strategy of an elastic job, and of ``trainer.balance.shares``, in normal mode (without
    ``trainer.world_size_invariant``). With ``dist.zero_stage`` its update is ZeRO's
    (:class:`.zero_steps.ZeroUpdate`): the weighted gradients are reduce-scattered instead.

    Each micro-batch of the step is cut into ``W`` contiguous shards by position (``W`` the world
    size; sizes differ by at most one sample where ``W`` does not divide it), and rank ``r``
    computes shard ``r``. Rank ``r``'s loss on its ``n_r`` samples is scaled by ``W * n_r / n``
    (``n`` the step's samples) before DDP averages the gradients over the ``W`` ranks, so ``.grad``
    holds the gradient of the mean over the step's samples however they were shared. With ``W``
    dividing the micro-batch this is plain DDP's ``1 / grad_accum_steps``.

    A step covers the same samples as plain DDP's step (positions ``[k*G, (k+1)*G)`` of the
    epoch's order), at every world size, so after a membership change the survivors redo the
    interrupted step on the same global batch. Not bitwise: the sum's order follows the shares.
    The stop votes ride in DDP's last bucket, as in :class:`.steps.DataParallelSteps`.

    Raises:
        ConfigError: when a step would leave a rank without a sample in some micro-batch (the
            epoch's short last step): every rank takes part in each micro-batch's forward.
    """

    def __init__(self, trainer: LoopView, votes: Callable[[], list[float]]):
        world_size = trainer.world_size
        super().__init__(trainer, votes, world_size, range(trainer.rank, trainer.rank + 1))
        _check_every_rank_has_samples(trainer, len(trainer.train_set))
        ride_in_gradients(trainer.model, votes)
        if trainer.config.dist.zero_stage:  # ZeRO's shards cut parameters, the shares samples: they compose
            self.update = ZeroUpdate(trainer)
        self.balance_by(self.global_batch // self.micro_batches)

    @property
    def slice_weights(self) -> list[float] | None:
        return None if self.balancer is None else self.balancer.weights

    def forward_backward(self, step: GlobalStep) -> float:
        """Forward and backward of this rank's shard of each micro-batch, the last one reducing;
        returns this rank's weighted loss (the mean over ranks is the step's per-sample mean)."""
        t, work = self.trainer, step.work
        count, world_size, step_loss = len(work.shards), t.world_size, 0.0
        if self.balancer is not None:
            self.balancer.start()
        for i, shard in enumerate(work.shards):
            share = world_size * shard.size / work.num_samples
            with contextlib.nullcontext() if i == count - 1 else t.model.no_sync():
                t.logged.batch_size = shard.size  # the weight of this micro-batch's self.log values
                with t.precision.autocast():
                    loss = t.training_step(t.model, self.load_shard(step, shard.start, shard.end))
                t.precision.backward(loss, scale=share)
            step_loss += loss.item() * share
        if self.balancer is not None:  # what this rank computed: the time it waited for the others aside
            stats = t.model.last_iteration_stats
            self.balancer.stop(sum(s.size for s in work.shards), 0.0 if stats is None else stats.finalize_wait_s)
        return step_loss

    def take_votes(self) -> list[float] | None:
        return self.trainer.model.take_sideband()


def _check_every_rank_has_samples(trainer: LoopView, dataset_len: int) -> None:
    """Every micro-batch of every step an epoch runs must give each rank a sample, at the most
    ranks the job can have (an elastic job's ``dist.world_size``)."""
    config = trainer.config
    accum, world_size = config.trainer.grad_accum_steps, max(trainer.world_size, config.dist.world_size)
    global_batch = config.data.global_batch_size
    last = dataset_len % global_batch
    runs_the_last_step = trainer.steps_per_epoch * global_batch >= dataset_len  # trainer.limit_train_batches
    if runs_the_last_step and 0 < last < accum * world_size:
        raise ConfigError(
            f"{'trainer.elastic=true' if config.trainer.elastic else 'trainer.balance.shares'} in normal mode "
            f"gives each of up to dist.world_size={world_size} rank(s) a "
            f"share of every micro-batch, but the epoch's last step holds {last} sample(s) ({dataset_len} % "
            f"data.global_batch_size={global_batch}), fewer than trainer.grad_accum_steps x dist.world_size = "
            f"{accum * world_size}. Pick a data.global_batch_size that leaves a last step of 0 or at least "
            f"{accum * world_size} samples, or set trainer.world_size_invariant=true (its shards need no rank each)"
        )
