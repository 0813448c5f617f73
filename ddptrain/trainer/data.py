"""Data wiring for the Trainer: preloading datasets as tensors, batching them, moving batches.

A dataset held as tensors (``torch.utils.data.TensorDataset``) is batched by indexing the tensors
with a whole batch of sampler indices at once: one gather per tensor instead of a ``__getitem__``
and a collate per sample. For MNIST this is what makes a CPU epoch cost the model's time, not
the input pipeline's. Other datasets go through a ``DataLoader``.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, Subset, TensorDataset

from ..config import Config, ConfigError, DataConfig
from ..data import DistributedSampler, build_dataset
from ..modes import mode_of
from ..preflight import per_rank_batch_size

log = logging.getLogger("ddptrain.trainer")

__all__ = [
    "preload",
    "TensorBatches",
    "make_batches",
    "group_micro_batches",
    "default_dataset",
    "batch_size_of",
    "move_to",
    "num_batches",
    "first_samples",
    "limit_datasets",
]


def preload(dataset: Dataset) -> TensorDataset:
    """Materialise ``dataset`` as a ``TensorDataset`` (samples stacked per field).

    A ``TensorDataset`` is returned as is; a dataset exposing ``data`` and ``targets`` tensors
    without a transform (e.g. ``SyntheticClassification``) is wrapped without copying; anything
    else is read item by item once (transforms applied) and stacked.
    """
    if isinstance(dataset, TensorDataset):
        return dataset
    data, targets = getattr(dataset, "data", None), getattr(dataset, "targets", None)
    if (
        isinstance(data, torch.Tensor)
        and isinstance(targets, torch.Tensor)
        and data.is_floating_point()
        and getattr(dataset, "transform", None) is None
        and len(data) == len(targets) == len(dataset)
    ):
        return TensorDataset(data, targets)
    items = [dataset[i] for i in range(len(dataset))]
    if not items:
        raise ValueError("cannot preload an empty dataset")
    if not isinstance(items[0], (tuple, list)):
        return TensorDataset(torch.stack([torch.as_tensor(x) for x in items]))
    columns = zip(*items)
    return TensorDataset(*[torch.stack([torch.as_tensor(x) for x in column]) for column in columns])


class TensorBatches:
    """Batches of a ``TensorDataset`` in the order of ``sampler``, gathered per batch.

    Iterating calls ``iter(sampler)`` once, so a resumed ``DistributedSampler`` yields only what
    is left of its epoch. The last batch may be short, as a ``DataLoader`` without ``drop_last``.
    ``pin_memory`` (training on CUDA): each batch is gathered into pinned memory, so that its copy to
    the GPU (``non_blocking``) does not make the host wait.
    """

    def __init__(self, dataset: TensorDataset, sampler: Sampler, batch_size: int, pin_memory: bool = False):
        self.dataset = dataset
        self.sampler = sampler
        self.batch_size = batch_size
        self.pin_memory = pin_memory

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        indices = iter(self.sampler)
        while True:
            chunk = list(itertools.islice(indices, self.batch_size))
            if not chunk:
                return
            index = torch.tensor(chunk, dtype=torch.long)
            if self.pin_memory:
                yield tuple(t[index].pin_memory() for t in self.dataset.tensors)
            else:
                yield tuple(t[index] for t in self.dataset.tensors)


def make_batches(
    dataset: Dataset,
    sampler: Sampler,
    batch_size: int,
    num_workers: int = 0,
    pin_memory: bool = False,
    seed: int = 0,
    loader_options: dict[str, Any] | None = None,
) -> Iterable:
    """An iterable of batches of ``dataset`` in the sampler's order.

    ``loader_options``: the ``DataLoader`` arguments of a user's loader (``collate_fn``,
    ``num_workers``...; see :mod:`.dataloaders`), which win over ``num_workers``/``pin_memory``; a
    dataset held as tensors is then batched through a ``DataLoader`` too, so its ``collate_fn`` runs.

    The DataLoader gets a generator of its own: otherwise creating its iterator draws from the
    global torch generator, and a run resumed mid-epoch would draw at another moment than the
    uninterrupted run, changing every later dropout mask.
    """
    if isinstance(dataset, TensorDataset) and loader_options is None:
        return TensorBatches(dataset, sampler, batch_size, pin_memory)
    options = {"num_workers": num_workers, "pin_memory": pin_memory, **(loader_options or {})}
    options.setdefault("persistent_workers", options["num_workers"] > 0)
    return DataLoader(
        dataset, batch_size=batch_size, sampler=sampler, generator=torch.Generator().manual_seed(seed), **options
    )


def group_micro_batches(batches: Iterable[Any], per_step: int) -> Iterator[list[Any]]:
    """``batches`` as lists of ``per_step`` micro-batches, one list per optimizer step; the last may be short."""
    group: list[Any] = []
    for batch in batches:
        group.append(batch)
        if len(group) == per_step:
            yield group
            group = []
    if group:
        yield group


def default_dataset(config: DataConfig, train: bool) -> Dataset:
    """The dataset ``config`` names (``data.name``), held as tensors if ``data.preload``."""
    extra = {}
    if config.name == "synthetic":
        extra = {"num_samples": config.num_train_samples if train else config.num_val_samples}
    dataset = build_dataset(config.name, config.root, train=train, download=config.download, **extra)
    return preload(dataset) if config.preload else dataset


def batch_size_of(batch: Any) -> int:
    """Number of samples in a batch: the length of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return len(batch)
    if isinstance(batch, dict):
        return batch_size_of(next(iter(batch.values())))
    if isinstance(batch, (list, tuple)) and batch:
        return batch_size_of(batch[0])
    raise TypeError(
        f"cannot tell the batch size of a {type(batch).__name__}; batches must be tensors, "
        "or tuples/lists/dicts whose first entry is a tensor"
    )


def move_to(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """``batch`` with every tensor on ``device`` (tuples, lists and dicts followed)."""
    if device.type == "cpu":
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, dict):
        return {k: move_to(v, device, non_blocking) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to(v, device, non_blocking) for v in batch)
    return batch


def num_batches(num_samples: int, batch_size: int) -> int:
    """Batches needed for ``num_samples`` (the last one may be short)."""
    return -(-num_samples // batch_size)


def first_samples(dataset: Dataset, count: int) -> Dataset:
    """The first ``count`` samples of ``dataset`` (all of it when it has no more); a
    ``TensorDataset`` stays one, its tensors sliced without a copy."""
    if count >= len(dataset):
        return dataset
    if isinstance(dataset, TensorDataset):
        return TensorDataset(*(t[:count] for t in dataset.tensors))
    return Subset(dataset, range(count))


def limit_datasets(
    config: Config, train_set: Dataset, val_set: Dataset | None, world_size: int, val_batch_size: int
) -> tuple[Dataset, Dataset | None]:
    """The data a fit sees under ``trainer.overfit_batches`` (the first N global batches of the
    training set) and ``trainer.limit_val_batches`` (the first batches of the validation set; with
    ``overfit_batches``, N batches unless it says otherwise). Cutting the dataset, not the loop,
    keeps the evaluation exact over what it sees. ``limit_train_batches`` is the epoch plan's."""
    t = config.trainer
    if t.overfit_batches:
        train_set = first_samples(train_set, t.overfit_batches * config.data.global_batch_size)
    val_limit = t.limit_val_batches if t.limit_val_batches is not None else (t.overfit_batches or None)
    if val_set is not None and val_limit is not None:
        if isinstance(val_limit, float):
            count = max(1, int(val_limit * len(val_set)))
        else:
            count = val_limit * world_size * val_batch_size
        val_set = first_samples(val_set, count)
    return train_set, val_set


@dataclass(frozen=True)
class EpochPlan:
    """How one rank walks the data: its samplers, its micro-batch size, the steps of an epoch
    (``trainer.limit_train_batches`` included) and of the run (``trainer.max_steps`` included)."""

    train_sampler: DistributedSampler
    val_sampler: DistributedSampler | None
    batch_size: int
    steps_per_epoch: int
    total_steps: int


def _check_one_batch_at_least(config: Config, samples: int, rank: int) -> None:
    """A training set smaller than one global batch: with ``data.drop_last`` there is no full batch
    to train on (refused); without, every epoch is one short step (a warning, on rank 0)."""
    batch = config.data.global_batch_size
    if samples >= batch:
        return
    what = f"the training set has {samples} samples, fewer than one global batch (data.global_batch_size={batch})"
    if config.data.drop_last:
        raise ConfigError(
            f"{what}: with data.drop_last=true no full batch is left to train on. Set "
            f"data.global_batch_size={samples} or less, or data.drop_last=false"
        )
    if rank == 0:
        log.warning(
            "%s: every epoch is one step of %d samples. Set data.global_batch_size=%d or less for full batches",
            what,
            samples,
            samples,
        )


def plan_epochs(config: Config, train_set: Dataset, val_set: Dataset | None, world_size: int, rank: int) -> EpochPlan:
    """This rank's samplers and step counts (the global batch split over ranks and accumulation)."""
    t = config.trainer
    _check_one_batch_at_least(config, len(train_set), rank)
    batch_size = per_rank_batch_size(config, world_size)
    seed, drop_last, shuffle = t.seed, config.data.drop_last, not t.overfit_batches  # overfitting: one fixed order
    train_sampler = DistributedSampler(train_set, world_size, rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
    val_sampler = None if val_set is None else DistributedSampler(val_set, world_size, rank, shuffle=False)
    if mode_of(config).whole_global_batches:  # whoever computes them (any world size)
        steps_per_epoch = num_batches(len(train_set), config.data.global_batch_size)
    else:
        steps_per_epoch = num_batches(num_batches(len(train_sampler), batch_size), t.grad_accum_steps)
    if isinstance(t.limit_train_batches, float):  # a fraction of the epoch's steps, at least one
        steps_per_epoch = max(1, int(t.limit_train_batches * steps_per_epoch))
    elif t.limit_train_batches is not None:  # batches per rank, rounded up to whole steps
        steps_per_epoch = min(steps_per_epoch, num_batches(t.limit_train_batches, t.grad_accum_steps))
    total_steps = steps_per_epoch * t.epochs
    if t.max_steps is not None:
        total_steps = min(total_steps, t.max_steps)
    return EpochPlan(train_sampler, val_sampler, batch_size, steps_per_epoch, total_steps)
