"""One validation pass: ``validation_step`` over this rank's share of the validation set, each
sample exactly once, reduced over every rank; and the sanity check before training, a few
batches of it that leave no trace.

The sampler pads ranks with duplicates so that all take the same number of batches; the
duplicates are a suffix of each rank's share. They are cut off the batch before
``validation_step`` sees it, so per-sample metrics, ``self.log`` values (sums of counts
included) and torchmetrics metrics all count each sample once. A batch of a type that cannot be
cut is passed whole and its per-sample metrics are masked instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from .data import batch_size_of, move_to
from .metrics import ExactMean
from .view import LoopView

__all__ = ["validation_pass", "sanity_check", "take_first"]


def take_first(batch: Any, count: int) -> Any:
    """The first ``count`` samples of a collated batch (tensors, dicts, tuples, lists, per-sample
    lists of plain values), or None when ``batch`` holds something else."""
    if isinstance(batch, torch.Tensor):
        return batch[:count]
    if isinstance(batch, dict):
        parts = {k: take_first(v, count) for k, v in batch.items()}
        return None if any(v is None for v in parts.values()) else parts
    if isinstance(batch, (list, tuple)):
        if batch and all(isinstance(v, (str, bytes, int, float, bool)) for v in batch):
            return batch[:count]  # one plain value per sample (collated strings, ids)
        parts = [take_first(v, count) for v in batch]
        if any(v is None for v in parts):
            return None
        return type(batch)(*parts) if hasattr(batch, "_fields") else type(batch)(parts)
    return None


def _real_batches(trainer: LoopView, padding: torch.Tensor) -> Iterator[tuple[Any, int]]:
    """``(batch, samples it counts for)`` over this rank's validation share, the padding cut off."""
    real, position = int((~padding).sum()), 0
    for batch in trainer.val_batches():
        size = batch_size_of(batch)
        keep = max(0, min(size, real - position))
        position += size
        if keep == size:
            yield batch, size
        elif keep > 0:
            cut = take_first(batch, keep)
            yield (batch, size) if cut is None else (cut, keep)


def validation_pass(trainer: LoopView, autocast: Any = contextlib.nullcontext) -> dict[str, float]:
    """``validation_step``'s per-sample metrics (``eval/<name>``), ``self.log`` values and logged
    torchmetrics metrics over exactly the validation set, the same on every rank (collective)."""
    module = trainer.model.module
    was_training = module.training
    module.eval()
    padding = trainer.val_sampler.padding_mask()
    mean, logged = ExactMean(padding), trainer.logged
    logged.phase = "validation"
    try:
        with torch.no_grad(), autocast():
            for batch, size in _real_batches(trainer, padding):
                logged.batch_size = size
                values = trainer.validation_step(module, move_to(batch, trainer.device))
                mean.add(values or {}, size)
    finally:
        logged.phase, logged.batch_size = "train", 1
        module.train(was_training)
    pg = trainer.process_group
    return logged.reduced("validation", pg, lambda entries, names: mean.reduce(pg, "eval/", entries, names))


def sanity_check(trainer: LoopView, num_batches: int, autocast: Any = contextlib.nullcontext) -> int:
    """Run ``validation_step`` on this rank's first ``num_batches`` validation batches, as an
    evaluation would (eval mode, no_grad, autocast), and forget what it returned or logged: a
    broken validation raises here, before the first training step. The random state is restored
    and nothing is reduced, so the training's bits do not depend on it. Returns the batches run."""
    module, logged = trainer.model.module, trainer.logged
    was_training, done = module.training, 0
    module.eval()
    logged.phase = "validation"
    try:
        with torch.random.fork_rng(devices=[trainer.device] if trainer.device.type == "cuda" else []):
            with torch.no_grad(), autocast():
                for batch in trainer.val_batches():
                    if done == num_batches:
                        break
                    logged.batch_size = batch_size_of(batch)
                    trainer.validation_step(module, move_to(batch, trainer.device))
                    done += 1
    except Exception as exc:
        exc.add_note(
            f"ddptrain: raised by validation_step in the sanity check (trainer.num_sanity_val_steps="
            f"{num_batches}), before the first training step; trainer.num_sanity_val_steps=0 skips it"
        )
        raise
    finally:
        logged.take("validation")  # a sanity check logs nothing
        for metric in logged.take_metrics("validation").values():
            metric.reset()
        logged.phase, logged.batch_size = "train", 1
        module.train(was_training)
    return done
