"""The data hooks ``train_dataloader()`` / ``val_dataloader()`` (Lightning's names), and the rule
for what they may return.

- A **Dataset**: ddptrain splits it over the ranks with its ``DistributedSampler`` (training:
  shuffled with ``trainer.seed + epoch``, resumable mid-epoch; validation: in order, padding
  left out of the metrics) and batches it with ``data.global_batch_size`` / ``data.eval_batch_size``.
  The default hooks return ``train_dataset()`` / ``val_dataset()``.
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

from typing import Any

from torch.utils.data import DataLoader, Dataset, IterableDataset, RandomSampler, SequentialSampler
from torch.utils.data import DistributedSampler as TorchDistributedSampler

from ..config import ConfigError, per_rank_batch_size
from ..data import DistributedSampler

__all__ = ["DataHooks", "split_loader", "resolve_data_hooks"]

_REPLACEABLE = (SequentialSampler, RandomSampler, TorchDistributedSampler, DistributedSampler)
_KEPT = ("collate_fn", "num_workers", "pin_memory", "worker_init_fn", "persistent_workers", "timeout")


class DataHooks:
    """The data hooks of :class:`ddptrain.Trainer` (mixed into it); see this module for the rule."""

    def train_dataloader(self) -> Dataset | DataLoader:
        """The training data: a Dataset (default: ``train_dataset()``) or a DataLoader (its sampler replaced)."""
        return self.train_dataset()

    def val_dataloader(self) -> Dataset | DataLoader | None:
        """The validation data (``None``: no evaluation). Default: ``val_dataset()``."""
        return self.val_dataset()


def split_loader(result: Any, hook: str) -> tuple[Dataset | None, dict[str, Any] | None, int | None]:
    """``(dataset, DataLoader options to keep or None, the loader's batch_size or None)`` of what a hook returned.

    Raises:
        TypeError: neither a Dataset nor a DataLoader; ValueError: a DataLoader ddptrain cannot distribute.
    """
    if result is None or (isinstance(result, Dataset) and not isinstance(result, IterableDataset)):
        return result, None, None
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
    return result.dataset, options, result.batch_size


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


def resolve_data_hooks(trainer) -> tuple[Dataset, Dataset | None]:
    """Call the data hooks; set ``trainer.train_loader_options`` / ``val_loader_options`` and
    ``val_batch_size``; return the two datasets.

    Raises:
        ConfigError: a training DataLoader whose ``batch_size`` is not the config's per-rank batch.
    """
    train_set, trainer.train_loader_options, batch_size = split_loader(trainer.train_dataloader(), "train_dataloader")
    if train_set is None:
        raise TypeError("train_dataloader() returned None: there is nothing to train on")
    expected = per_rank_batch_size(trainer.config, trainer.world_size)
    if batch_size is not None and batch_size != expected:
        raise ConfigError(
            f"train_dataloader() returned a DataLoader with batch_size={batch_size}, but the config gives "
            f"{expected} per rank (data.global_batch_size={trainer.config.data.global_batch_size} over "
            f"{trainer.world_size} rank(s) x trainer.grad_accum_steps={trainer.config.trainer.grad_accum_steps}). "
            f"Set data.global_batch_size={batch_size * trainer.world_size * trainer.config.trainer.grad_accum_steps}, "
            f"or build the DataLoader with batch_size={expected}."
        )
    val_set, trainer.val_loader_options, val_batch = split_loader(trainer.val_dataloader(), "val_dataloader")
    trainer.val_batch_size = val_batch or trainer.config.data.eval_batch_size
    return train_set, val_set
