"""World-size-invariant training steps (``trainer.world_size_invariant=true``): the same bits on 1, 2 or 8 ranks.

The Trainer hands its steps to :class:`InvariantSteps` in this mode. Each optimizer step's global
batch is cut into ``grad_accum_steps * virtual_ranks`` fixed shards by sample position
(:mod:`ddptrain.data.global_batches`); each rank runs forward and backward on its shards one at a
time, on the bare module (no DDP hooks), and keeps each shard's gradient. The gradients are then
summed exactly across ranks (:mod:`ddptrain.ddp.exact`: int64 fixed point), so the sum has the
same bits whatever the world size. What else could depend on the rank is pinned:

- randomness: each shard runs under its own torch generator state, seeded from
  ``(trainer.seed, epoch, step, shard)`` (dropout, random augmentation in ``__getitem__``);
  Python's ``random`` and numpy are not reseeded;
- threads: torch uses ``dist.threads_per_worker`` intra-op threads (1 when it is 0) on every rank,
  so a kernel's reduction order is the same wherever a shard runs;
- the loss: the gradient is that of ``sum over shards of shard_mean * shard_size / step_size``,
  i.e. the step's per-sample mean; the logged step loss is that value, summed in shard order,
  rounded to float32 (so the logging window's sums and means are exact too);
- buffers (BatchNorm): every shard starts from the step's buffers, and computes its own batch
  statistics; the new floating-point buffers are the exact mean of the shards' results (for
  BatchNorm's running stats: one momentum update with the mean of the shards' statistics), the
  integer ones (``num_batches_tracked``) the shards' common value; a buffer no shard changed
  stays as it was.

Parameters no shard used get no gradient (``None``), as in plain training.

With ``dist.zero_stage=1`` the optimizer state is sharded over the ranks
(:class:`.zero_steps.WholeGradientUpdate`): each rank steps a contiguous range of the
parameters with the whole exact gradient and the ranges are all-gathered, so the bits are the
unsharded step's, at any world size. Checkpoints take ZeRO's formats (consolidated, or each
rank's shard with ``trainer.checkpoint.sharded`` or ``format=dcp``).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable

import torch
from torch import nn

from ..data.global_batches import virtual_ranks_by_weight, virtual_ranks_of
from ..ddp.exact import ExactAllReducer
from ..modes.builtin import check_virtual_ranks
from .global_batch_steps import GlobalBatchSteps, GlobalStep
from .view import LoopView
from .zero_steps import WholeGradientUpdate

__all__ = ["InvariantSteps", "shard_seed"]

log = logging.getLogger("ddptrain.trainer")

_SHARD_LOCK = threading.Lock()
"""Held while a shard runs: torch's default generator is per process, and ranks that are threads
(``ddptrain.testing.run_threaded``) must not interleave their shards' seeding and draws."""


def shard_seed(seed: int, epoch: int, step: int, shard: int) -> int:
    """The torch seed of one shard: a hash of ``(seed, epoch, step, shard)``, never of the rank."""
    digest = hashlib.blake2b(f"{seed}:{epoch}:{step}:{shard}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class InvariantSteps(GlobalBatchSteps):
    """The step strategy of world-size-invariant mode (see the module docstring). The stop votes
    ride in the step's exact sum; :meth:`take_votes` gives their sums."""

    def __init__(self, trainer: LoopView, votes: Callable[[], list[float]]):
        cfg = trainer.config
        check_virtual_ranks(cfg, trainer.world_size)  # also for a fit() that no launcher checked
        self.virtual_ranks = cfg.trainer.virtual_ranks
        spread = cfg.trainer.elastic  # an elastic job's world size need not divide the virtual ranks
        mine = virtual_ranks_of(trainer.rank, trainer.world_size, self.virtual_ranks, spread=spread)
        super().__init__(trainer, votes, self.virtual_ranks, mine)
        self._vote_sums: list[float] | None = None
        self.seed = cfg.trainer.seed
        module: nn.Module = trainer.model.module
        self.params = [p for p in module.parameters() if p.requires_grad]  # tied weights: once
        self.float_buffers = [b for b in module.buffers() if b.is_floating_point()]
        self.int_buffers = [b for b in module.buffers() if not b.is_floating_point()]
        self.param_numel = sum(p.numel() for p in self.params)
        # One scale per parameter and per float buffer: the segments of each shard's contribution.
        self.sizes = [p.numel() for p in self.params] + [b.numel() for b in self.float_buffers]
        self.reducer = ExactAllReducer(self.sizes)
        # Each shard's backward accumulates straight into its row of one [shards, numel] buffer
        # (``.grad`` set to views of it, zeros: ``0 + g`` is ``g``), which the exact sum takes as it
        # is. Parameters of another dtype or device keep their own ``.grad``, copied afterwards.
        device = self.params[0].device if self.params else torch.device("cpu")
        # float64 when a parameter or float buffer is: each is summed at its own precision (the
        # others widen exactly); float32 (half the bytes, the exact sum's float32 path) otherwise
        wide = any(t.dtype == torch.float64 for t in (*self.params, *self.float_buffers))
        self._row_dtype = torch.float64 if wide else torch.float32
        self._in_row = [p.dtype == self._row_dtype and p.device == device for p in self.params]
        self._row_device = device
        self._used = [False] * len(self.params)  # set by the hooks: which got a gradient this shard
        self._offsets = [sum(self.sizes[:i]) for i in range(len(self.params))]  # of each parameter in a row
        self._buffer: tuple[torch.Tensor, list[list[torch.Tensor | None]]] | None = None  # _rows
        self._hooks = [p.register_post_accumulate_grad_hook(self._mark_used(i)) for i, p in enumerate(self.params)]
        if cfg.dist.zero_stage:  # stage 1 (the mode refuses 2): shards of the whole exact gradient
            self.update = WholeGradientUpdate(trainer)
        self.balance_by(self.virtual_ranks)
        threads = cfg.dist.threads_per_worker or 1
        torch.set_num_threads(threads)
        if trainer.is_main:
            log.info(
                "world-size-invariant mode: %d virtual ranks (shards %d-%d on this rank), %d intra-op thread(s)",
                self.virtual_ranks,
                self.mine.start,
                self.mine.stop - 1,
                threads,
            )

    # == one step =================================================================================
    def forward_backward(self, step: GlobalStep) -> float:
        """Forward and backward of this rank's shards, the exact sum of the gradients over all ranks
        in each parameter's ``.grad``; the step's loss (the same on every rank and world size).

        One collective per step in the common case (:class:`~ddptrain.ddp.exact.ExactAllReducer`):
        an int64 SUM of the fixed-point gradients and float buffers, each shard's loss as the raw
        bits of a float64 (only its own rank adds it, so the sum is exact), how many shards used
        each parameter and changed each buffer, and the integer buffers of the ranks that ran a
        shard with their number.
        """
        t, module, work = self.trainer, self.trainer.model.module, step.work
        snapshot = [b.detach().clone() for b in (*self.float_buffers, *self.int_buffers)]
        shards = [shard for shard in work.shards if shard.size > 0]
        contributions, views = self._rows(len(shards))
        losses = torch.zeros(work.num_shards, dtype=torch.float64)
        used = [0] * len(self.params)  # how many shards gave each parameter a gradient
        changed = [0] * len(self.float_buffers)  # how many shards changed each float buffer
        # One fork of the generators for the step's shards (each shard seeds its own): the state
        # the rest of the run draws from is as it was before the step.
        with _SHARD_LOCK, torch.random.fork_rng(devices=_cuda_devices(t.device)):
            if self.balancer is not None:  # this rank's compute: from here to the exact sum's wait
                self.balancer.start()
            for shard, row, row_views in zip(shards, contributions, views):
                self._restore(snapshot)
                self._grads_into(row_views)
                _seed(t.device, shard_seed(self.seed, step.epoch, t.state.step, shard.index))
                batch = self.load_shard(step, shard.start, shard.end)  # __getitem__ may draw
                with t.precision.autocast():  # trainer.precision
                    loss = t.training_step(module, batch)
                t.precision.backward(loss, scale=shard.size / work.num_samples)
                losses[shard.index] = float(loss.detach()) * shard.size
                self._take_grads(row, row_views, used)
                self._buffer_state(row, changed, snapshot)
            if self.balancer is not None:
                self.balancer.stop(sum(shard.size for shard in shards))
        counts = torch.tensor(used + changed, dtype=torch.int64)
        ran = torch.tensor([1 if shards else 0], dtype=torch.int64)
        ints = [b.detach().reshape(-1).to("cpu", torch.int64) * ran for b in self.int_buffers]  # last shard's
        self._restore(snapshot)
        votes = torch.tensor(self.votes(), dtype=torch.float64).to(torch.int64)
        extra = torch.cat([losses.view(torch.int64), counts, *ints, ran, votes])
        values, extra = self.reducer.all_reduce(t.process_group, contributions, work.num_shards, extra)
        extra, self._vote_sums = extra[: -len(votes)], [float(v) for v in extra[-len(votes) :].tolist()]
        self._set_grads(values, extra[work.num_shards : work.num_shards + len(self.params)].tolist())
        changed = extra[work.num_shards + len(self.params) : work.num_shards + len(counts)]
        int_values = extra[work.num_shards + len(counts) : -1] // extra[-1]  # all shards agree: their mean
        self._set_buffers(values, changed, int_values, work)
        loss = sum(extra[: work.num_shards].view(torch.float64).tolist()) / work.num_samples  # shard order: fixed
        return float(torch.tensor(loss, dtype=torch.float32))

    def follow_shares(self) -> None:
        """Deal each micro-batch's virtual ranks by the balancer's shares: the same shards, other hands."""
        t = self.trainer
        self.mine = virtual_ranks_by_weight(t.rank, self.virtual_ranks, self.balancer.weights)

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def take_votes(self) -> list[float] | None:
        """The stop votes summed over ranks in the latest step, once (None if no step ran since)."""
        sums, self._vote_sums = self._vote_sums, None
        return sums

    def _mark_used(self, index: int):
        def hook(param: torch.Tensor) -> None:
            self._used[index] = True

        return hook

    def _rows(self, num_shards: int) -> tuple[torch.Tensor, list[list[torch.Tensor | None]]]:
        """A zeroed ``[num_shards, numel]`` buffer, one row per shard, and each row's views for the
        parameters' ``.grad`` (None for a parameter of another dtype or device). Kept between steps:
        a step's sum does not hold on to it."""
        if self._buffer is None or len(self._buffer[0]) != num_shards:
            rows = torch.zeros(num_shards, sum(self.sizes), dtype=self._row_dtype, device=self._row_device)
            places = list(zip(self.params, self._offsets, self._in_row))
            views = [[row[o : o + p.numel()].view_as(p) if ok else None for p, o, ok in places] for row in rows]
            self._buffer = (rows, views)
        else:
            self._buffer[0].zero_()
        return self._buffer

    def _grads_into(self, views: list[torch.Tensor | None]) -> None:
        """Point each parameter's ``.grad`` at its (zero) slice of this shard's row: ``0 + g`` is ``g``."""
        for p, view in zip(self.params, views):
            p.grad = view
        self._used = [False] * len(self.params)

    def _take_grads(self, row: torch.Tensor, views: list[torch.Tensor | None], used: list[int]) -> None:
        """Complete this shard's ``row`` (the gradients that did not land in it: another dtype, or a
        backward that replaced ``.grad``), count the parameters that got a gradient."""
        for i, (p, view, offset) in enumerate(zip(self.params, views, self._offsets)):
            if self._used[i]:
                used[i] += 1
                grad = p.grad
                if view is None or grad.data_ptr() != view.data_ptr():
                    row[offset : offset + p.numel()] = grad.detach().reshape(-1).to(row.device, row.dtype)

    def _set_grads(self, values: torch.Tensor, used: list[int]) -> None:
        """Each used parameter's ``.grad``: its slice of the exact sum, converted once per dtype."""
        converted: dict[torch.dtype, torch.Tensor] = {}
        for p, offset, times in zip(self.params, self._offsets, used):
            if times == 0:
                p.grad = None
                continue
            if p.dtype not in converted:
                converted[p.dtype] = values.to(p.dtype)
            p.grad = converted[p.dtype][offset : offset + p.numel()].view_as(p).to(p.device)

    # == buffers (BatchNorm) ======================================================================
    def _restore(self, snapshot: list[torch.Tensor]) -> None:
        if snapshot:
            with torch.no_grad():
                torch._foreach_copy_([*self.float_buffers, *self.int_buffers], snapshot)  # one call, not one each

    def _buffer_state(self, row: torch.Tensor, changed: list[int], snapshot: list[torch.Tensor]) -> None:
        """This shard's float buffers into the tail of its ``row``; counts those it changed."""
        offset = self.param_numel
        for i, (b, saved) in enumerate(zip(self.float_buffers, snapshot)):
            if not torch.equal(b, saved):
                changed[i] += 1
            row[offset : offset + b.numel()] = b.detach().reshape(-1).to(row.device, row.dtype)
            offset += b.numel()

    def _set_buffers(self, values: torch.Tensor, changed: torch.Tensor, int_values: torch.Tensor, work) -> None:
        """Float buffers: the exact mean over the step's non-empty shards, where any shard changed
        them; integer buffers: the shards' common value (MAX over ranks)."""
        ran = min(work.num_samples, work.num_shards)  # non-empty shards
        offset = self.param_numel
        with torch.no_grad():
            for i, b in enumerate(self.float_buffers):
                if changed[i] > 0:
                    b.copy_((values[offset : offset + b.numel()] / ran).view_as(b))
                offset += b.numel()
            offset = 0
            for b in self.int_buffers:
                b.copy_(int_values[offset : offset + b.numel()].view_as(b))
                offset += b.numel()


def _seed(device: torch.device, seed: int) -> None:
    """``torch.manual_seed(seed)`` for the CPU generator and ``device``'s only: torch's own also
    queues a seed for every CUDA device, recording the Python stack each time when CUDA is not
    initialised (a fifth of a CPU step's time on MNIST)."""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.default_generators[device.index if device.index is not None else 0].manual_seed(seed)


def _cuda_devices(device: torch.device) -> list:
    return [device] if device.type == "cuda" else []
