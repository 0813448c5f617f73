"""Static dataset partitioning, as in the PyTorch distributed tutorial.

``DataPartitioner`` shuffles the indices of a dataset once, with a fixed seed, and cuts
them into consecutive slices of the requested fractions. Every rank builds the same
partitioner (same seed, same dataset length) and picks its own slice with ``use(rank)``,
so the slices are disjoint without any communication.

Unlike ``DistributedSampler``, the split is fixed for the whole run: there is no
per-epoch reshuffle across ranks (shuffle *within* a partition with the DataLoader).
"""

from __future__ import annotations

import math
from collections.abc import Sequence, Sized
from random import Random
from typing import Any

__all__ = ["Partition", "DataPartitioner", "partition_dataset"]

# Fractions are floats chosen by people (1/3 + 1/3 + 1/3); allow rounding noise.
_SUM_TOLERANCE = 1e-6


class Partition:
    """A view of ``data`` restricted to the positions in ``index``.

    Args:
        data: Any object with ``__getitem__`` (a map-style dataset).
        index: Positions into ``data``; ``partition[i]`` is ``data[index[i]]``.
    """

    def __init__(self, data: Any, index: Sequence[int]) -> None:
        self.data = data
        self.index = index

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, index: int) -> Any:
        data_idx = self.index[index]
        return self.data[data_idx]


class DataPartitioner:
    """Split a dataset into disjoint, randomly drawn partitions of given fractions.

    The behaviour is the tutorial's, exactly: the indices ``0..len(data)-1`` are shuffled
    with ``random.Random(seed).shuffle`` and partition ``i`` takes the next
    ``int(sizes[i] * len(data))`` of them. Rounding down means up to ``len(sizes)``
    samples may belong to no partition.

    Args:
        data: A sized, map-style dataset.
        sizes: Fraction of the dataset for each partition; each must be positive and
            they must sum to at most 1.
        seed: Seed of the shuffle. Every rank must use the same seed, otherwise the
            partitions overlap.

    Raises:
        ValueError: If a fraction is not positive or the fractions sum to more than 1.
    """

    def __init__(self, data: Sized, sizes: Sequence[float] = (0.7, 0.2, 0.1), seed: int = 1234) -> None:
        sizes = list(sizes)
        _validate_sizes(sizes)
        self.data = data
        self.sizes = sizes
        self.seed = seed
        self.partitions: list[list[int]] = []
        rng = Random()
        rng.seed(seed)
        data_len = len(data)
        indexes = list(range(data_len))
        rng.shuffle(indexes)
        for frac in sizes:
            part_len = int(frac * data_len)
            self.partitions.append(indexes[0:part_len])
            indexes = indexes[part_len:]

    def __len__(self) -> int:
        return len(self.partitions)

    def use(self, partition: int) -> Partition:
        """Return partition number ``partition`` as a dataset.

        Raises:
            IndexError: If there is no such partition.
        """
        if not 0 <= partition < len(self.partitions):
            raise IndexError(
                f"partition {partition} does not exist: this DataPartitioner has "
                f"{len(self.partitions)} partitions (sizes={self.sizes}), valid numbers are "
                f"0..{len(self.partitions) - 1}. With one partition per rank, pass "
                f"sizes=[1/world_size] * world_size."
            )
        return Partition(self.data, self.partitions[partition])


def partition_dataset(data: Sized, rank: int, world_size: int, seed: int = 1234) -> Partition:
    """Return this rank's equal share of ``data`` (the tutorial's ``partition_dataset``).

    Args:
        data: A sized, map-style dataset.
        rank: This process's rank, in ``[0, world_size)``.
        world_size: Number of ranks; the dataset is split into that many equal parts.
        seed: Shuffle seed; must be the same on every rank.

    Raises:
        ValueError: If ``world_size < 1`` or ``rank`` is outside ``[0, world_size)``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size - 1}] for world_size={world_size}, got {rank}")
    return DataPartitioner(data, [1.0 / world_size] * world_size, seed=seed).use(rank)


def _validate_sizes(sizes: list[float]) -> None:
    if not sizes:
        raise ValueError("sizes must list at least one fraction, got an empty sequence")
    bad = [s for s in sizes if not (isinstance(s, (int, float)) and math.isfinite(s) and s > 0)]
    if bad:
        raise ValueError(f"every partition fraction must be a positive number; got {bad} in sizes={sizes}")
    total = sum(sizes)
    if total > 1.0 + _SUM_TOLERANCE:
        raise ValueError(
            f"partition fractions must sum to at most 1, but sizes={sizes} sum to {total:.6g}; "
            f"the partitions would overlap. Scale them down (e.g. [1/world_size] * world_size)."
        )
