"""A DistributedSampler that also resumes mid-epoch and marks its padding.

The indices are torch's (``torch.utils.data.distributed.DistributedSampler``): the same
(seed, epoch, world size) give every rank the same indices as torch. The epoch's order is
``epoch_order`` (``torch.randperm`` seeded with ``seed + epoch``, or ``range`` without shuffle),
which does not depend on the world size. It is padded to a multiple of ``num_replicas`` by
repeating its head (cut instead, with ``drop_last``), and rank ``r`` takes
``order[r::num_replicas]``: once every rank has taken ``k`` samples, the first
``k * num_replicas`` of the order are consumed.

Added to torch's: ``state_dict``/``load_state_dict`` for an exact mid-epoch resume,
``padding_mask`` for an exact evaluation, and a warning when ``set_epoch`` is forgotten.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Mapping, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

from .global_batches import epoch_order

__all__ = ["DistributedSampler", "STATE_VERSION", "world_size_change_refused"]

STATE_VERSION = 1
"""Version of the dictionary written by ``DistributedSampler.state_dict``."""


class DistributedSampler(Sampler[int]):
    """Give each rank a disjoint, per-epoch shuffled share of a dataset's indices.

    Typical use::

        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank)
        loader = DataLoader(dataset, batch_size=bs, sampler=sampler)
        for epoch in range(start_epoch, num_epochs):
            sampler.set_epoch(epoch)   # a new order every epoch
            for batch in loader:
                ...

    Every rank yields ``len(sampler)`` indices per epoch. Without ``drop_last`` the last
    ``num_padded()`` of them repeat earlier samples so that all ranks take the same number of
    steps; with ``drop_last`` up to ``num_replicas - 1`` samples are left out instead.

    Resuming: ``consumed`` is this rank's position in the epoch, and ``state_dict`` saves it.
    The sampler counts the indices it yields, but a ``DataLoader`` fetches ahead of training
    (workers, prefetching), so a trainer reports what it actually trained on with
    ``advance(n)`` after each step (or ``set_consumed(n)``); from then on the sampler stops
    counting by itself until its next pass. After ``load_state_dict`` the next pass yields
    exactly what remains of the saved epoch; ``set_epoch`` with that same epoch keeps the
    position, and every other pass starts at the beginning of the epoch.

    Args:
        dataset_or_len: The dataset (anything with ``len``) or its length.
        num_replicas: Number of ranks sharing the dataset (the world size). Default, as in
            torch: the size of the current process group (ddptrain's, else torch.distributed's).
        rank: This rank, in ``[0, num_replicas)``. Default: this process's rank in that group.
        shuffle: Draw a new random order every epoch (``set_epoch``).
        seed: Base seed of the shuffle; must be the same on every rank.
        drop_last: Cut the tail so that ranks need no padding, instead of repeating samples.

    Raises:
        ValueError: If ``num_replicas < 1``, ``rank`` is outside ``[0, num_replicas)``, the
            dataset is empty, or ``drop_last`` leaves every rank without samples.
    """

    def __init__(
        self,
        dataset_or_len: Sized | int,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        super().__init__()
        if num_replicas is None or rank is None:
            group_size, group_rank = _current_group()
            num_replicas = group_size if num_replicas is None else num_replicas
            rank = group_rank if rank is None else rank
        if not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"num_replicas (the world size) must be an int >= 1, got {num_replicas!r}")
        if not isinstance(rank, int) or not 0 <= rank < num_replicas:
            raise ValueError(
                f"invalid rank {rank!r}: with num_replicas={num_replicas} the rank must be in [0, {num_replicas - 1}]"
            )
        self.dataset = None if isinstance(dataset_or_len, int) else dataset_or_len
        self.dataset_len = dataset_or_len if isinstance(dataset_or_len, int) else _length_of(dataset_or_len)
        if self.dataset_len <= 0:
            raise ValueError(f"DistributedSampler got an empty dataset (length {self.dataset_len})")
        if drop_last and self.dataset_len < num_replicas:
            raise ValueError(
                f"drop_last=True with a dataset of {self.dataset_len} samples and num_replicas="
                f"{num_replicas} would give every rank 0 samples. Use drop_last=False (samples "
                f"are repeated to fill every rank) or fewer replicas."
            )
        self.num_replicas, self.rank = num_replicas, rank
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.num_samples = _samples_per_rank(self.dataset_len, num_replicas, drop_last)
        self.total_size = self.num_samples * num_replicas
        self.epoch = 0
        self._consumed = 0
        # Where the next pass starts: the position load_state_dict restored, else 0.
        self._resume_at = 0
        # The pass whose yields move _consumed; None once progress is reported (or before any pass).
        # While it is a pass p: _consumed == p.start + the indices p has yielded.
        self._counting: _Pass | None = None
        self._warned = False

    def __len__(self) -> int:
        """Number of indices this rank yields in a full epoch (padding included)."""
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        start, self._resume_at = self._resume_at, 0
        if start == 0 and self._consumed > 0 and self.shuffle:
            self._warn_repeated_epoch()
        self._consumed = start
        # Set up here, not in the generator: the state is right as soon as iter() returns.
        self._counting = counting = _Pass(start)
        return self._yield(self.epoch_indices()[start:], counting)

    def _yield(self, indices: list[int], counting: _Pass) -> Iterator[int]:
        for index in indices:
            if self._counting is counting:  # an older pass (or epoch) moves nothing
                self._consumed += 1
            yield index

    def epoch_indices(self) -> list[int]:
        """All of this rank's indices for the current epoch, in order (a resumed pass yields a tail)."""
        order = epoch_order(self.dataset_len, self.seed, self.epoch, self.shuffle).tolist()
        if self.drop_last:
            order = order[: self.total_size]
        else:
            # Repeated whole when the padding is longer than the dataset (fewer samples than ranks).
            order += (order * math.ceil(self.total_size / len(order)))[: self.total_size - len(order)]
        return order[self.rank :: self.num_replicas]

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch, which seeds the shuffle (``seed + epoch``).

        Call it at the start of every epoch with a new number, or every epoch repeats the same
        order. A new epoch starts at its beginning; the epoch already set (for example, just
        restored by ``load_state_dict``) keeps its position.
        """
        if epoch != self.epoch:
            self.epoch, self._consumed, self._resume_at, self._counting = epoch, 0, 0, None

    def _warn_repeated_epoch(self) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"DistributedSampler (rank {self.rank}) is iterated again in epoch {self.epoch} "
                f"with shuffle=True, so this pass repeats the previous order exactly. Call "
                f"sampler.set_epoch(epoch) at the start of each epoch, with a different epoch "
                f"each time, to get a new shuffle.",
                UserWarning,
                stacklevel=3,
            )

    @property
    def consumed(self) -> int:
        """This rank's samples of the current epoch already handed out, or reported trained on."""
        return self._consumed

    def advance(self, num_samples: int) -> None:
        """Report that this rank trained on ``num_samples`` more samples of this epoch.

        The first call in a pass replaces the sampler's own count (which runs ahead when a
        DataLoader prefetches) with the start of the pass plus what is reported.

        Raises:
            ValueError: If the count would leave ``[0, len(self)]``.
        """
        base = self._consumed if self._counting is None else self._counting.start
        self.set_consumed(base + num_samples)

    def set_consumed(self, num_samples: int) -> None:
        """Set how many of this rank's samples of the current epoch were trained on.

        This changes what ``state_dict`` saves; it does not move the current pass.

        Raises:
            ValueError: If ``num_samples`` is outside ``[0, len(self)]``.
        """
        if not 0 <= num_samples <= self.num_samples:
            raise ValueError(
                f"consumed must be in [0, {self.num_samples}] (this rank's samples per epoch), got {num_samples}"
            )
        self._consumed, self._counting = num_samples, None

    def padding_mask(self) -> torch.Tensor:
        """Boolean tensor of length ``len(self)``: True where the position repeats an earlier sample.

        Padding is always the tail of a rank's epoch and the same in every epoch. Weigh each
        sample of a full pass by ``~padding_mask()`` to reduce metrics over exactly
        ``dataset_len`` samples across ranks.
        """
        return self.rank + torch.arange(self.num_samples) * self.num_replicas >= self.dataset_len

    def num_padded(self) -> int:
        """Number of this rank's positions per epoch that are padding (0 with ``drop_last``)."""
        return int(self.padding_mask().sum())

    def state_dict(self) -> dict[str, Any]:
        """The epoch and this rank's position in it, with what must match to resume it.

        ``rank`` is informational: every rank has consumed the same number of samples, so any
        rank's state resumes every rank.
        """
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "seed": self.seed,
            "num_replicas": self.num_replicas,
            "rank": self.rank,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "dataset_len": self.dataset_len,
            "consumed": self._consumed,
        }

    def load_state_dict(self, state: Mapping[str, Any], allow_world_size_change: bool = False) -> None:
        """Restore the epoch and position of ``state``; the next pass yields what remains.

        With another world size the position is converted: every old rank had consumed
        ``consumed`` samples, the first ``consumed * old_num_replicas`` of the epoch's order
        (which does not depend on the world size). The new ranks resume at
        ``floor(global / new_num_replicas)``: exact when the division is, else up to
        ``new_num_replicas - 1`` samples of the epoch are seen twice (none is skipped).

        Args:
            state: A dictionary from ``state_dict``.
            allow_world_size_change: Accept a state saved with another ``num_replicas``.

        Raises:
            ValueError: If the state has another version, misses a key, or comes from a
                dataset of another length, another seed/shuffle/drop_last, or (unless allowed)
                another world size.
        """
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"cannot load DistributedSampler state of version {state.get('version')!r}; this "
                f"ddptrain reads version {STATE_VERSION}"
            )
        missing = [key for key in self.state_dict() if key not in state and key != "rank"]
        if missing:
            raise ValueError(f"corrupt sampler state: keys {missing} are missing from {dict(state)}")
        if state["dataset_len"] != self.dataset_len:
            raise ValueError(
                f"the sampler state was saved for a dataset of {state['dataset_len']} samples, but "
                f"this sampler's dataset has {self.dataset_len}; a position in that epoch means "
                f"nothing here. Resume with the same dataset, or skip loading the sampler "
                f"state and start the epoch over."
            )
        mismatched = [
            f"{key}: saved {state[key]!r}, here {getattr(self, key)!r}"
            for key in ("seed", "shuffle", "drop_last")
            if state[key] != getattr(self, key)
        ]
        if mismatched:
            raise ValueError(
                "the sampler state was saved with a different order of samples ("
                + "; ".join(mismatched)
                + "). Build the DistributedSampler with the saved values to resume."
            )
        old_replicas, consumed = state["num_replicas"], state["consumed"]
        old_samples = _samples_per_rank(self.dataset_len, old_replicas, self.drop_last)
        if not 0 <= consumed <= old_samples:
            raise ValueError(
                f"corrupt sampler state: consumed={consumed} but each of its {old_replicas} "
                f"ranks had {old_samples} samples per epoch"
            )
        if old_replicas != self.num_replicas:
            if not allow_world_size_change:
                raise ValueError(
                    world_size_change_refused(
                        "the sampler state",
                        old_replicas,
                        self.num_replicas,
                        f"Build the sampler with num_replicas={old_replicas}",
                        "pass allow_world_size_change=True",
                    )
                )
            if consumed == old_samples or consumed * old_replicas >= self.dataset_len:
                consumed = self.num_samples  # only padding (or nothing) was left: the epoch is over
            else:
                consumed = consumed * old_replicas // self.num_replicas  # floor: repeat, never skip
        self.epoch, self._consumed, self._resume_at, self._counting = state["epoch"], consumed, consumed, None

    def __repr__(self) -> str:
        return (
            f"DistributedSampler(dataset_len={self.dataset_len}, num_replicas={self.num_replicas}, "
            f"rank={self.rank}, shuffle={self.shuffle}, seed={self.seed}, drop_last={self.drop_last}, "
            f"epoch={self.epoch}, consumed={self._consumed})"
        )


class _Pass:
    """One pass over (the rest of) an epoch, from position ``start``; compared by identity."""

    __slots__ = ("start",)

    def __init__(self, start: int) -> None:
        self.start = start


def world_size_change_refused(
    what: str, saved: int, current: int, relaunch: str, allow: str, with_rng: bool = False
) -> str:
    """Why ``what``, saved with ``saved`` ranks, does not resume exactly on ``current``; and the ways out.
    The one text of this refusal, for the sampler's own state and for a trainer's checkpoint.

    ``relaunch`` and ``allow`` name the caller's knobs (a sampler's arguments, a run's config keys),
    e.g. ``"Relaunch with dist.world_size=4"`` and ``"set trainer.allow_world_size_change=true"``;
    ``with_rng``: ``what`` also holds each rank's RNG state (a checkpoint), which says so.
    """
    state = "a rank's position in the epoch" + (" and its RNG state continue" if with_rng else " continues")
    fresh = "; ranks beyond the saved ones get fresh RNG seeds" if with_rng else ""
    return (
        f"{what} was saved with {saved} rank(s), not {current}: {state} exactly only on the same "
        f"number of ranks. {relaunch}, or {allow} to continue from the same global sample position "
        f"(at most {current - 1} sample(s) of the epoch are then seen twice{fresh})."
    )


def _length_of(dataset: Sized) -> int:
    try:
        return len(dataset)
    except TypeError as err:
        raise TypeError(
            f"DistributedSampler needs a map-style dataset with __len__ (or its length as an "
            f"int); got {type(dataset).__name__}, which has no length"
        ) from err


def _current_group() -> tuple[int, int]:
    """(world size, rank) of the current process group: ddptrain's, else torch.distributed's."""
    from ..comm import api

    if api.is_initialized():
        return api.get_world_size(), api.get_rank()
    import torch.distributed as tdist

    if tdist.is_available() and tdist.is_initialized():
        return tdist.get_world_size(), tdist.get_rank()
    raise ValueError(
        "DistributedSampler without num_replicas and rank takes them from the current process group, and "
        "there is none: call ddptrain.comm.init_process_group(...) (or torch.distributed.init_process_group) "
        "first, or pass num_replicas= and rank="
    )


def _samples_per_rank(dataset_len: int, num_replicas: int, drop_last: bool) -> int:
    # Torch's values: with drop_last it computes ceil((n - r) / r), which equals n // r.
    return dataset_len // num_replicas if drop_last else math.ceil(dataset_len / num_replicas)
