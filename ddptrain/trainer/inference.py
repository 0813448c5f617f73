"""Test and predict: ``Trainer.test()`` and ``Trainer.predict(dataset)`` over all ranks, after
``fit`` or from a checkpoint (Lightning's ``trainer.test`` / ``trainer.predict``).

Both split the dataset over the ranks with a ``DistributedSampler`` in dataset order (no shuffle)
and run the bare module in eval mode under ``no_grad``:

- ``test`` averages the per-sample metrics of ``test_step`` over exactly the dataset, the
  sampler's padding duplicates left out (as ``evaluate`` does for validation): ``test/<name>``,
  the same on every rank; rank 0 writes them to ``<output_dir>/test_metrics.json``.
- ``predict`` returns ``predict_step``'s outputs for every sample, in dataset order, on every
  rank: each rank's outputs are gathered, interleaved back into dataset order (rank ``r`` holds
  samples ``r, r + W, r + 2W, ...``), and the padding duplicates at the end are cut off. The
  result equals what one process would compute. ``predict_step`` returns a tensor, or a tuple,
  list or dict of tensors, each with one row per sample of the batch.

The weights: the fitted model after ``fit``; else ``checkpoint`` (a file, a run directory,
``latest`` or ``best``, resolved as ``trainer.resume`` is); else ``configure_model()`` as it
comes, rank 0's copy broadcast so every rank predicts with the same weights.

Outside ``fit``, each call joins the job's process group (or reuses an existing one) and leaves
it at the end if it created it.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from ..comm.objects import all_gather_object
from ..data import DistributedSampler
from .checkpoint import CheckpointError, agree_on_checkpoint, load_checkpoint, model_weights
from .data import batch_size_of, first_samples, make_batches, move_to
from .dataloaders import LoaderParts, split_loader
from .metrics import ExactMean

__all__ = ["run_test", "run_predict", "gather_in_dataset_order"]

log = logging.getLogger("ddptrain.trainer")


def run_test(trainer: Any, data: Any, checkpoint: str | None, write: bool = True) -> dict[str, float]:
    """``Trainer.test``: ``trainer.test_step``'s metrics averaged over exactly ``data`` (a Dataset
    or a DataLoader, its sampler replaced: see :mod:`.dataloaders`; None: ``test_dataloader()``,
    called once this rank is in the group), on every rank; rank 0 writes them unless ``write`` is False."""
    with _session(trainer, checkpoint) as module:
        loader = split_loader(trainer.test_dataloader() if data is None else data, "test")
        sampler = DistributedSampler(loader.dataset, trainer.world_size, trainer.rank, shuffle=False)
        mean = ExactMean(sampler.padding_mask())
        for batch in _batches(trainer, loader, sampler):
            mean.add(trainer.test_step(module, batch), batch_size_of(batch))
        metrics = mean.reduce(trainer.process_group, prefix="test/")
    if trainer.is_main and write:
        trainer.output_dir.mkdir(parents=True, exist_ok=True)
        trainer.run_dir.test_metrics.write_text(json.dumps(metrics, indent=2) + "\n")
        log.info("test: %s", " ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
    return metrics


def run_predict(trainer: Any, data: Any, checkpoint: str | None) -> Any:
    """``Trainer.predict``: ``trainer.predict_step``'s outputs for every sample of ``data``, in
    dataset order, on every rank."""
    loader = split_loader(data, "predict")
    with _session(trainer, checkpoint) as module:
        sampler = DistributedSampler(loader.dataset, trainer.world_size, trainer.rank, shuffle=False)
        outputs = []
        for batch in _batches(trainer, loader, sampler):
            out = _to_cpu(trainer.predict_step(module, batch))
            _check_rows(out, batch_size_of(batch))
            outputs.append(out)
        mine = _concat(outputs)
        gathered = all_gather_object(trainer.process_group, mine)  # collective
    return gather_in_dataset_order(gathered, len(loader.dataset))


def _batches(trainer: Any, loader: LoaderParts, sampler: DistributedSampler) -> Iterator[Any]:
    (dataset, options, batch_size), d = loader, trainer.config.data
    pin = trainer.device.type == "cuda"
    with torch.no_grad():
        for batch in make_batches(dataset, sampler, batch_size or d.eval_batch_size, d.num_workers, pin, 0, options):
            yield move_to(batch, trainer.device)


@contextlib.contextmanager
def _session(trainer: Any, checkpoint: str | None) -> Iterator[nn.Module]:
    """This rank in the job's group, and the module to run (eval mode, restored afterwards)."""
    with trainer.joined():
        module = _module(trainer, checkpoint)
        was_training = module.training
        module.eval()
        fitted = module is getattr(trainer.model, "module", None)
        try:
            with trainer.evaluated_weights() if fitted else contextlib.nullcontext():  # trainer.ema.evaluate
                yield module
        finally:
            module.train(was_training)


def _module(trainer: Any, checkpoint: str | None) -> nn.Module:
    if checkpoint is None and trainer.model is not None:
        return trainer.model.module
    module = trainer.configure_model().to(trainer.device)
    pg = trainer.process_group
    if checkpoint is None:
        for tensor in [*module.parameters(), *module.buffers()]:  # rank 0's weights everywhere
            pg.broadcast(tensor.data, 0).wait()
        return module
    path = agree_on_checkpoint(pg, checkpoint, trainer.checkpoint_dir, "checkpoint")
    if path is None:
        raise CheckpointError(f"checkpoint={checkpoint}: there is no checkpoint in {trainer.checkpoint_dir}")
    saved = load_checkpoint(path, map_location=trainer.device)
    ema = bool(trainer.config.trainer.ema.evaluate and saved.get("ema"))  # trainer.ema.evaluate: the average
    module.load_state_dict(model_weights(saved, path, ema))
    return module


def _to_cpu(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.detach().cpu()
    if isinstance(out, dict):
        return {k: _to_cpu(v) for k, v in out.items()}
    if isinstance(out, (tuple, list)):
        return type(out)(_to_cpu(v) for v in out)
    raise TypeError(
        f"predict_step returned a {type(out).__name__}: return a tensor, or a tuple, list or dict of "
        "tensors, each with one row per sample of the batch"
    )


def _leaves(out: Any) -> Iterator[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        yield out
    else:
        for v in out.values() if isinstance(out, dict) else out:
            yield from _leaves(v)


def _check_rows(out: Any, batch_size: int) -> None:
    for tensor in _leaves(out):
        if tensor.dim() == 0 or len(tensor) != batch_size:
            shape = tuple(tensor.shape)
            raise ValueError(
                f"predict_step returned a tensor of shape {shape} for a batch of {batch_size}: "
                "every output needs one row per sample (first dimension = batch size)"
            )


def _concat(parts: list[Any]) -> Any:
    """The batches' outputs of one rank joined along the first dimension (same structure)."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts)
    if isinstance(first, dict):
        return {k: _concat([p[k] for p in parts]) for k in first}
    return type(first)(_concat([p[i] for p in parts]) for i in range(len(first)))


def gather_in_dataset_order(per_rank: list[Any], length: int) -> Any:
    """Every rank's outputs (rank ``r`` holding samples ``r, r + W, ...`` then padding) back in
    dataset order, the padding cut off: position ``p`` of rank ``r`` is sample ``p * W + r``."""
    first = per_rank[0]
    if isinstance(first, torch.Tensor):
        return torch.stack(per_rank, dim=1).flatten(0, 1)[:length]
    if isinstance(first, dict):
        return {k: gather_in_dataset_order([p[k] for p in per_rank], length) for k in first}
    return type(first)(gather_in_dataset_order([p[i] for p in per_rank], length) for i in range(len(first)))


def run_dev_test(trainer: Any, n: int) -> dict[str, Any]:
    """``trainer.fast_dev_run``'s test pass: ``test_step`` on ``n`` batches per rank; what ran."""
    parts = split_loader(trainer.test_dataloader(), "test_dataloader")
    tested: dict[str, float] = {}
    if parts.dataset is not None:
        batch_size = parts.batch_size or trainer.config.data.eval_batch_size
        head = first_samples(parts.dataset, n * trainer.world_size * batch_size)
        data = head if parts.options is None else DataLoader(head, batch_size=batch_size, **parts.options)
        tested = run_test(trainer, data, None, write=False)
    return {"fast_dev_run": {"batches": n, "tested": bool(tested)}, **tested}
