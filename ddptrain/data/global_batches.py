"""Global batches cut into fixed shards by sample position, never by rank (world-size-invariant mode).

An epoch's order is the sampler's (``torch.randperm`` seeded with ``seed + epoch``, the same for
every world size). Optimizer step ``k`` of the epoch trains on positions ``[k*G, (k+1)*G)`` of that
order (``G`` the global batch; the epoch's last step may be shorter). Those ``n`` samples are cut
into ``A * V`` contiguous shards of near-equal size (``torch.tensor_split`` sizes: the first
``n % (A*V)`` shards hold one sample more), ``A`` the accumulation steps and ``V`` the virtual
ranks; shard ``a*V + v`` is the ``v``-th of micro-batch ``a``. Rank ``r`` of ``W`` computes
virtual ranks ``r*V/W .. (r+1)*V/W - 1`` of every micro-batch. Which samples form a shard
depends only on the seed, the epoch, the step and the shard index, so a shard is the same on 1,
2 or 8 ranks; only who computes it changes. No sample is padded or repeated.

Shares by speed (``trainer.balance``) use two more cuts: invariant mode deals each micro-batch's
``V`` shards to the ranks in blocks sized by weight (:func:`virtual_ranks_by_weight`: the shards
stay the same, only who computes them changes); normal mode cuts each micro-batch into one slice
per rank sized by weight (``weights`` of :func:`shards_of_step`).

This module is plain arithmetic: it never talks to a process group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "valid_world_sizes",
    "virtual_ranks_of",
    "virtual_ranks_by_weight",
    "split_by_weight",
    "shard_bounds",
    "Shard",
    "epoch_order",
    "shards_of_step",
]


def valid_world_sizes(virtual_ranks: int) -> list[int]:
    """The world sizes that can share ``virtual_ranks`` evenly: its divisors."""
    return [w for w in range(1, virtual_ranks + 1) if virtual_ranks % w == 0]


def virtual_ranks_of(rank: int, world_size: int, virtual_ranks: int, *, spread: bool = False) -> range:
    """The virtual ranks rank ``rank`` of ``world_size`` computes: ``r*V/W .. (r+1)*V/W - 1``.

    ``spread=True`` (elastic jobs, whose world size changes as members come and go) accepts any
    world size: rank ``r`` computes ``floor(r*V/W) .. floor((r+1)*V/W) - 1``, so the shares differ
    by at most one virtual rank (and a rank of a job larger than ``V`` may compute none). Which
    samples a virtual rank holds never depends on who computes it.

    Raises:
        ValueError: if ``world_size`` does not divide ``virtual_ranks`` without ``spread`` (naming
            both and the valid world sizes), or ``rank`` is out of range.
    """
    if world_size < 1 or virtual_ranks < 1 or (virtual_ranks % world_size and not spread):
        raise ValueError(
            f"world-size-invariant training: the world size W must divide the virtual ranks V, got "
            f"W={world_size} and V={virtual_ranks}. Use W in {valid_world_sizes(max(virtual_ranks, 1))}, "
            f"or a V that W divides"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, {world_size})")
    return range(rank * virtual_ranks // world_size, (rank + 1) * virtual_ranks // world_size)


def split_by_weight(total: int, weights: Sequence[float], minimum: int = 1) -> list[int]:
    """``total`` units dealt in proportion to ``weights``, each at least ``minimum`` (largest
    remainders first, ties to the lower index): the same answer on every rank.

    Raises:
        ValueError: fewer than ``minimum`` units per weight.
    """
    n = len(weights)
    if total < minimum * n:
        raise ValueError(f"{total} units cannot give each of {n} ranks at least {minimum}")
    whole = sum(weights)
    exact = [total * w / whole for w in weights]
    counts = [int(x) for x in exact]
    for r in sorted(range(n), key=lambda r: (counts[r] - exact[r], r))[: total - sum(counts)]:
        counts[r] += 1
    for r in range(n):  # raise the smallest to the minimum, from the largest
        while counts[r] < minimum:
            counts[max(range(n), key=lambda q: (counts[q], -q))] -= 1
            counts[r] += 1
    return counts


def virtual_ranks_by_weight(rank: int, virtual_ranks: int, weights: Sequence[float]) -> range:
    """The virtual ranks rank ``rank`` computes when each rank takes a block sized by its weight
    (at least one each; :func:`split_by_weight`)."""
    counts = split_by_weight(virtual_ranks, weights)
    start = sum(counts[:rank])
    return range(start, start + counts[rank])


def shard_bounds(num_samples: int, num_shards: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each of ``num_shards`` contiguous shards of ``num_samples`` positions
    (``torch.tensor_split``'s sizes; some are empty when there are fewer samples than shards)."""
    base, extra = divmod(num_samples, num_shards)
    bounds, start = [], 0
    for i in range(num_shards):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


@dataclass(frozen=True)
class Shard:
    """One shard of a step: its index in the step (``a*V + v``), and its sample positions in the
    epoch's order ``[start, end)``."""

    index: int
    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


def epoch_order(dataset_len: int, seed: int, epoch: int, shuffle: bool = True) -> torch.Tensor:
    """The epoch's order of sample indices: ``DistributedSampler``'s before its split over ranks."""
    if not shuffle:
        return torch.arange(dataset_len)
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    return torch.randperm(dataset_len, generator=generator)


@dataclass(frozen=True)
class StepShards:
    """One optimizer step as this rank sees it: the step's first position in the epoch, its
    number of samples over all ranks, the shard count over all ranks, and this rank's shards."""

    start: int
    num_samples: int
    num_shards: int
    shards: tuple[Shard, ...]


def shards_of_step(
    start: int,
    num_samples: int,
    micro_batches: int,
    virtual_ranks: int,
    mine: range,
    weights: Sequence[float] | None = None,
) -> StepShards:
    """The step of ``num_samples`` samples from global position ``start``, with the shards of
    virtual ranks ``mine``. ``weights`` (one per virtual rank): each micro-batch (a near-equal
    ``1/micro_batches`` of the step) is cut into slices sized by weight instead of equally."""
    num_shards = micro_batches * virtual_ranks
    if weights is None:
        bounds = shard_bounds(num_samples, num_shards)
    else:
        bounds = []
        for lo, hi in shard_bounds(num_samples, micro_batches):
            minimum = 1 if hi - lo >= len(weights) else 0
            for count in split_by_weight(hi - lo, weights, minimum):
                bounds.append((lo, lo + count))
                lo += count
    shards = tuple(
        Shard(a * virtual_ranks + v, start + bounds[a * virtual_ranks + v][0], start + bounds[a * virtual_ranks + v][1])
        for a in range(micro_batches)
        for v in mine
    )
    return StepShards(start, num_samples, num_shards, shards)
