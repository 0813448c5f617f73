"""A DistributedSampler that also resumes mid-epoch and reports its padding.

The arithmetic is that of ``torch.utils.data.distributed.DistributedSampler``, so the
same (seed, epoch, world size) give the same indices on every rank as torch does:

1. The epoch's order is ``torch.randperm(dataset_len)`` drawn from a ``torch.Generator``
   seeded with ``seed + epoch`` (or ``range(dataset_len)`` without shuffle). It depends
   on neither the rank nor the world size, which is what makes resuming on a different
   world size possible.
2. Without ``drop_last`` the order is padded to a multiple of ``num_replicas`` by
   repeating its first indices; with ``drop_last`` the tail is cut instead.
3. Rank ``r`` takes the interleaved slice ``indices[r::num_replicas]``, so after every
   rank has taken ``k`` samples, exactly the first ``k * num_replicas`` of the order
   are consumed.

Added on top of torch:

* ``state_dict``/``load_state_dict`` to continue an interrupted epoch exactly, refusing
  a checkpoint from another world size unless told to convert the position.
* ``num_padded``/``is_padding``/``padding_mask`` so evaluation can ignore the padding
  duplicates and reduce metrics over exactly ``dataset_len`` samples.
* A warning when a shuffled sampler is iterated twice in one epoch, the usual symptom of
  forgetting ``set_epoch``.

This module needs only integers for the rank and world size; it never talks to the
process group.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Mapping, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

__all__ = ["DistributedSampler", "STATE_VERSION"]

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
    ``num_padded()`` of them are duplicates added so that all ranks take the same number
    of steps; with ``drop_last`` up to ``num_replicas - 1`` samples are left out.

    Resuming: ``state_dict()["consumed"]`` counts this rank's indices already handed out
    in the current epoch. The sampler counts what it yields, but a ``DataLoader`` fetches
    ahead of the training step (workers, prefetching), so a trainer that knows how many
    samples it has actually trained on should report that with ``advance(n)`` after each
    step or ``set_consumed(n)`` before saving; from that call on the sampler stops
    counting on its own until the next pass. After ``load_state_dict`` the next pass
    yields exactly the indices of the epoch that remain; calling ``set_epoch`` with the
    *same* epoch keeps that position, a different epoch starts it fresh.

    Args:
        dataset_or_len: The dataset (anything with ``len``) or its length.
        num_replicas: Number of ranks sharing the dataset (the world size). Default, as in
            torch: the size of the current process group (ddptrain's, else torch.distributed's).
        rank: This rank, in ``[0, num_replicas)``. Default: this process's rank in that group.
        shuffle: Draw a new random order every epoch (``set_epoch``).
        seed: Base seed of the shuffle; must be the same on every rank.
        drop_last: Cut the tail so that ranks need no padding, instead of repeating
            samples.

    Raises:
        ValueError: If ``num_replicas < 1``, ``rank`` is outside ``[0, num_replicas)``,
            the dataset is empty, or ``drop_last`` leaves every rank without samples.
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
        dataset_len = _length_of(dataset_or_len)
        if num_replicas is None or rank is None:
            group_size, group_rank = _current_group()
            num_replicas = group_size if num_replicas is None else num_replicas
            rank = group_rank if rank is None else rank
        _validate_replicas(num_replicas, rank)
        if dataset_len == 0:
            raise ValueError("DistributedSampler got an empty dataset (length 0); there is nothing to sample")
        if drop_last and dataset_len < num_replicas:
            raise ValueError(
                f"drop_last=True with a dataset of {dataset_len} samples and num_replicas="
                f"{num_replicas} would give every rank 0 samples. Use drop_last=False (samples "
                f"are repeated to fill every rank) or fewer replicas."
            )
        self.dataset = None if isinstance(dataset_or_len, int) else dataset_or_len
        self.dataset_len = dataset_len
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.num_samples = _samples_per_rank(dataset_len, num_replicas, drop_last)
        self.total_size = self.num_samples * num_replicas
        self.epoch = 0
        self._consumed = 0
        # A position set by load_state_dict, used by the next pass only.
        self._resume_pending = False
        # False once the trainer reports progress itself (advance/set_consumed).
        self._auto_count = True
        self._pass_start = 0
        # Generators of an older pass (or epoch) must not update the count.
        self._pass_id = 0
        self._passes_this_epoch = 0
        self._warned_repeat = False

    # ------------------------------------------------------------------ iteration

    def __len__(self) -> int:
        """Number of indices this rank yields in a full epoch (padding included)."""
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        start = self._consumed if self._resume_pending else 0
        if self.shuffle and not self._resume_pending and self._passes_this_epoch > 0:
            self._warn_repeated_epoch()
        self._resume_pending = False
        self._passes_this_epoch += 1
        self._pass_id += 1
        self._pass_start = start
        self._consumed = start
        self._auto_count = True
        # Set up eagerly (not inside the generator) so that state is right as soon as
        # iter() returns, before the first next().
        return self._generate(self.epoch_indices()[start:], start, self._pass_id)

    def _generate(self, indices: list[int], start: int, pass_id: int) -> Iterator[int]:
        for offset, index in enumerate(indices):
            if pass_id == self._pass_id and self._auto_count:
                self._consumed = start + offset + 1
            yield index

    def epoch_indices(self) -> list[int]:
        """Return all of this rank's indices for the current epoch, in order.

        This is what a full pass yields; a resumed pass yields its tail from position
        ``consumed``.
        """
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            indices = torch.randperm(self.dataset_len, generator=generator).tolist()
        else:
            indices = list(range(self.dataset_len))
        if self.drop_last:
            indices = indices[: self.total_size]
        else:
            padding_size = self.total_size - len(indices)
            # Repeat the whole order when the padding is longer than the dataset
            # (fewer samples than ranks), as torch does.
            repeats = math.ceil(padding_size / len(indices)) if padding_size else 0
            indices += (indices * repeats)[:padding_size]
        return indices[self.rank : self.total_size : self.num_replicas]

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch, which seeds the shuffle (``seed + epoch``).

        Call it at the start of every epoch with a new number; otherwise every epoch
        repeats the same order. A different epoch starts at its beginning; the epoch
        already set (for example, just restored by ``load_state_dict``) keeps its
        position.
        """
        if epoch == self.epoch:
            return
        self.epoch = epoch
        self._consumed = 0
        self._resume_pending = False
        self._auto_count = True
        self._pass_start = 0
        self._pass_id += 1
        self._passes_this_epoch = 0

    def _warn_repeated_epoch(self) -> None:
        if self._warned_repeat:
            return
        self._warned_repeat = True
        warnings.warn(
            f"DistributedSampler (rank {self.rank}) is iterated again in epoch {self.epoch} "
            f"with shuffle=True, so this pass repeats the previous order exactly. Call "
            f"sampler.set_epoch(epoch) at the start of each epoch, with a different epoch "
            f"each time, to get a new shuffle.",
            UserWarning,
            stacklevel=3,
        )

    # ------------------------------------------------------------------ progress

    @property
    def consumed(self) -> int:
        """This rank's samples already handed out (or reported) in the current epoch."""
        return self._consumed

    def advance(self, num_samples: int) -> None:
        """Report that this rank trained on ``num_samples`` more samples of this epoch.

        The first call in a pass replaces the sampler's own count (which runs ahead when
        a DataLoader prefetches) with the start of the pass plus what is reported.

        Raises:
            ValueError: If the count would become negative or exceed ``len(self)``.
        """
        base = self._pass_start if self._auto_count else self._consumed
        self.set_consumed(base + num_samples)

    def set_consumed(self, num_samples: int) -> None:
        """Set how many of this rank's samples of the current epoch were trained on.

        This changes what ``state_dict`` reports; it does not move the current pass.

        Raises:
            ValueError: If ``num_samples`` is outside ``[0, len(self)]``.
        """
        if not 0 <= num_samples <= self.num_samples:
            raise ValueError(
                f"consumed must be in [0, {self.num_samples}] (this rank's samples per epoch), got {num_samples}"
            )
        self._auto_count = False
        self._consumed = num_samples

    # ------------------------------------------------------------------ padding

    def num_real(self) -> int:
        """Number of this rank's positions per epoch that are not padding."""
        if self.rank >= self.dataset_len:
            return 0
        return min(self.num_samples, math.ceil((self.dataset_len - self.rank) / self.num_replicas))

    def num_padded(self) -> int:
        """Number of this rank's positions per epoch that repeat an earlier sample.

        Padding positions are always the last ``num_padded()`` of the epoch and do not
        depend on the epoch. Summed over ranks this is ``total_size - dataset_len``
        (zero with ``drop_last``).
        """
        return self.num_samples - self.num_real()

    def is_padding(self, position: int) -> bool:
        """Whether this rank's ``position``-th sample of an epoch is a padding duplicate.

        Raises:
            IndexError: If ``position`` is outside ``[0, len(self))``.
        """
        if not 0 <= position < self.num_samples:
            raise IndexError(f"position must be in [0, {self.num_samples}), got {position}")
        return self.rank + position * self.num_replicas >= self.dataset_len

    def padding_mask(self) -> torch.Tensor:
        """Boolean tensor of length ``len(self)``: True where the position is padding.

        Evaluate over a full pass and weigh each sample by ``~padding_mask()`` to reduce
        metrics over exactly ``dataset_len`` samples across ranks.
        """
        positions = torch.arange(self.num_samples)
        return self.rank + positions * self.num_replicas >= self.dataset_len

    # ------------------------------------------------------------------ checkpointing

    def state_dict(self) -> dict[str, Any]:
        """Return the position in the epoch as a small, versioned dictionary.

        ``rank`` is informational: under data parallelism every rank has consumed the
        same number of samples, so any rank's state can be loaded on every rank.
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

        With a different world size the per-rank position is converted into a global
        one: every rank had consumed ``consumed`` samples, i.e. the first
        ``consumed * old_num_replicas`` of the epoch's order (which does not depend on
        the world size). The new ranks resume at ``floor(global / new_num_replicas)``,
        so this is exact when the division is exact and otherwise up to
        ``new_num_replicas - 1`` samples of this epoch are seen a second time (none is
        skipped). The padding or dropped tail of the epoch also differs, as for any run
        with that world size.

        Args:
            state: A dictionary from ``state_dict``.
            allow_world_size_change: Accept a state saved with another ``num_replicas``
                and convert its position as described above.

        Raises:
            ValueError: If the state has an unknown version, comes from a dataset of
                another length, another seed/shuffle/drop_last, or (unless allowed)
                another world size.
        """
        version = state.get("version")
        if version != STATE_VERSION:
            raise ValueError(
                f"cannot load DistributedSampler state of version {version!r}; this "
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
        old_replicas = state["num_replicas"]
        old_samples = _samples_per_rank(self.dataset_len, old_replicas, self.drop_last)
        consumed = state["consumed"]
        if not 0 <= consumed <= old_samples:
            raise ValueError(
                f"corrupt sampler state: consumed={consumed} but each of its {old_replicas} "
                f"ranks had {old_samples} samples per epoch"
            )
        if old_replicas != self.num_replicas:
            if not allow_world_size_change:
                raise ValueError(
                    f"the sampler state was saved with num_replicas={old_replicas}, but this "
                    f"sampler has num_replicas={self.num_replicas}; a rank's position is only "
                    f"exact for the same world size. Relaunch with {old_replicas} processes, or "
                    f"pass allow_world_size_change=True to resume from the equivalent global "
                    f"position (at most {self.num_replicas - 1} sample(s) of the epoch are seen twice)."
                )
            consumed = self._convert_position(consumed, old_replicas, old_samples)
        self.epoch = state["epoch"]
        self._consumed = consumed
        self._pass_start = consumed
        self._resume_pending = True
        self._auto_count = True
        self._pass_id += 1
        self._passes_this_epoch = 0

    def _convert_position(self, consumed: int, old_replicas: int, old_samples: int) -> int:
        global_consumed = consumed * old_replicas
        # Only padding (or nothing) was left: the epoch is over for every world size.
        if consumed == old_samples or global_consumed >= self.dataset_len:
            return self.num_samples
        # Floor: repeat a few samples rather than skip any.
        return min(global_consumed // self.num_replicas, self.num_samples)

    def __repr__(self) -> str:
        return (
            f"DistributedSampler(dataset_len={self.dataset_len}, num_replicas={self.num_replicas}, "
            f"rank={self.rank}, shuffle={self.shuffle}, seed={self.seed}, drop_last={self.drop_last}, "
            f"epoch={self.epoch}, consumed={self._consumed})"
        )


def _length_of(dataset_or_len: Sized | int) -> int:
    if isinstance(dataset_or_len, bool):
        raise TypeError("dataset_or_len must be a dataset with len() or an int, got a bool")
    if isinstance(dataset_or_len, int):
        if dataset_or_len < 0:
            raise ValueError(f"dataset length must be >= 0, got {dataset_or_len}")
        return dataset_or_len
    try:
        return len(dataset_or_len)
    except TypeError as err:
        raise TypeError(
            f"DistributedSampler needs a map-style dataset with __len__ (or its length as an "
            f"int); got {type(dataset_or_len).__name__}, which has no length"
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


def _validate_replicas(num_replicas: int, rank: int) -> None:
    if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"num_replicas (the world size) must be an int >= 1, got {num_replicas!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < num_replicas:
        raise ValueError(
            f"invalid rank {rank!r}: with num_replicas={num_replicas} the rank must be in [0, {num_replicas - 1}]"
        )


def _samples_per_rank(dataset_len: int, num_replicas: int, drop_last: bool) -> int:
    # Same values as torch: ceil((n - r) / r) == n // r when n % r != 0.
    if drop_last:
        return dataset_len // num_replicas
    return math.ceil(dataset_len / num_replicas)
