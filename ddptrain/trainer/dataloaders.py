"""What the data hooks ``train_dataloader()`` / ``val_dataloader()`` / ``test_dataloader()``
(Lightning's names) may return, and how ddptrain takes it apart.

- A **Dataset**: ddptrain splits it over the ranks with its ``DistributedSampler`` (training:
  shuffled with ``trainer.seed + epoch``, resumable mid-epoch; validation: in order, padding
  left out of the metrics) and batches it with ``data.global_batch_size`` / ``data.eval_batch_size``.
  The default hooks return the splits of ``config.data`` (``ddptrain.data.build_dataset``).
- A **DataLoader**: its dataset, ``collate_fn``, ``num_workers``, ``pin_memory``,
  ``worker_init_fn``, ``persistent_workers``, ``prefetch_factor`` and ``timeout`` are kept; its
  sampler is **replaced** by ddptrain's ``DistributedSampler`` (as Lightning does), so ``shuffle``
  does not matter: training is always shuffled per epoch, validation never. Refused, with the
  reason: a custom ``sampler`` or ``batch_sampler`` (ddptrain cannot split its order over ranks:
  return the dataset and let ddptrain sample, or subclass ``DistributedSampler``), an
  ``IterableDataset``, ``drop_last=True`` (use ``data.drop_last``), and for training a
  ``batch_size`` other than the per-rank batch the config gives (``data.global_batch_size /
  (world size x trainer.grad_accum_steps)``); for validation its ``batch_size`` is used.
- ``None`` (validation only): no evaluation.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from torch.utils.data import DataLoader, Dataset, IterableDataset, RandomSampler, SequentialSampler
from torch.utils.data import DistributedSampler as TorchDistributedSampler

from ..config import Config, ConfigError
from ..data import DistributedSampler
from ..preflight import per_rank_batch_size

__all__ = ["LoaderParts", "split_loader", "resolve_data_hooks"]

_REPLACEABLE = (SequentialSampler, RandomSampler, TorchDistributedSampler, DistributedSampler)
_KEPT = ("collate_fn", "num_workers", "pin_memory", "worker_init_fn", "persistent_workers", "timeout")


class LoaderParts(NamedTuple):
    """What ddptrain keeps of a data hook's result."""

    dataset: Dataset | None
    options: dict[str, Any] | None
    """The DataLoader's options that are kept (``collate_fn``, workers...), or None for a Dataset."""
    batch_size: int | None
    """The DataLoader's ``batch_size``, or None for a Dataset."""


def split_loader(result: Any, hook: str) -> LoaderParts:
    """The parts of what a data hook returned (a Dataset, a DataLoader or None).

    Raises:
        TypeError: neither a Dataset nor a DataLoader; ValueError: a DataLoader ddptrain cannot distribute.
    """
    if result is None or (isinstance(result, Dataset) and not isinstance(result, IterableDataset)):
        return LoaderParts(result, None, None)
    if not isinstance(result, DataLoader):
        raise TypeError(
            f"{hook}() returned a {type(result).__name__}: return a torch Dataset (ddptrain applies its "
            "DistributedSampler) or a DataLoader (its sampler is replaced by ddptrain's)"
        )
    why = _refusal(result)
    if why:
        raise ValueError(
            f"{hook}() returned a DataLoader with {why}. ddptrain replaces a loader's sampler with its "
            "DistributedSampler (each rank a disjoint share, shuffled per epoch, resumable); return the "
            "Dataset itself, or a DataLoader(dataset, batch_size=..., collate_fn=...) without a sampler."
        )
    options = {k: getattr(result, k) for k in _KEPT}
    if result.num_workers > 0:
        options["prefetch_factor"] = result.prefetch_factor
    return LoaderParts(result.dataset, options, result.batch_size)


def _refusal(loader: DataLoader) -> str | None:
    if isinstance(loader.dataset, IterableDataset):
        return "an IterableDataset (it has no indices to split over ranks)"
    if loader.batch_size is None:
        return f"a custom batch_sampler ({type(loader.batch_sampler).__name__})"
    if not isinstance(loader.sampler, _REPLACEABLE):
        return f"a custom sampler ({type(loader.sampler).__name__}) whose order cannot be split over ranks"
    if loader.drop_last:
        return "drop_last=True (set data.drop_last=true instead: the sampler then cuts the epoch evenly)"
    return None


def resolve_data_hooks(train: Any, val: Any, config: Config, world_size: int) -> tuple[LoaderParts, LoaderParts]:
    """The parts of what ``train_dataloader()`` and ``val_dataloader()`` returned.

    Raises:
        TypeError: nothing to train on, or not a Dataset/DataLoader; ValueError: a DataLoader
            ddptrain cannot distribute; ConfigError: a training DataLoader whose ``batch_size``
            is not the config's per-rank batch.
    """
    train_parts = split_loader(train, "train_dataloader")
    if train_parts.dataset is None:
        raise TypeError("train_dataloader() returned None: there is nothing to train on")
    expected, batch_size = per_rank_batch_size(config, world_size), train_parts.batch_size
    if batch_size is not None and batch_size != expected:
        accum = config.trainer.grad_accum_steps
        raise ConfigError(
            f"train_dataloader() returned a DataLoader with batch_size={batch_size}, but the config gives "
            f"{expected} per rank (data.global_batch_size={config.data.global_batch_size} over "
            f"{world_size} rank(s) x trainer.grad_accum_steps={accum}). "
            f"Set data.global_batch_size={batch_size * world_size * accum}, "
            f"or build the DataLoader with batch_size={expected}."
        )
    return train_parts, split_loader(val, "val_dataloader")
