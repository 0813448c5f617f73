"""Values that user code reports with ``Trainer.log``: collected on each rank, reduced over all
ranks together with the trainer's own scalars (one gather per logging window, per epoch end and
per evaluation, however many names were logged).

Where a value goes depends on where it was logged and on ``on_step`` / ``on_epoch``:

- in ``training_step`` (and in callbacks outside an evaluation) the default is ``on_step=True``:
  reduced over the ranks and the steps of each logging window (``trainer.log_every_steps``), it
  reaches ``on_log`` with ``train/loss``; ``on_epoch=True`` reduces it over the whole epoch, at
  the epoch's end;
- in ``validation_step`` the default (and only choice) is ``on_epoch=True``: reduced over the whole
  validation set, it joins the evaluation's metrics. The trainer removes the sampler's padding
  duplicates from validation batches before calling ``validation_step``, so each sample counts
  exactly once — sums of counts (``reduce="sum"``) give exact totals for metrics that are not
  per-sample means (precision, recall, F1 from true/false positives...);
- logged both ways, the names get Lightning's suffixes ``<name>_step`` and ``<name>_epoch``.

``reduce``: ``mean`` (weighted by ``batch_size``, default the batch's size), ``sum``, ``max``,
``min``. A ``torchmetrics.Metric`` may be logged instead of a value (epoch level): its states are
synchronised through ddptrain's process group (not ``torch.distributed``'s), then computed and
reset once per evaluation or epoch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..comm.objects import all_gather_object
from ..comm.process_group import ProcessGroup

__all__ = ["REDUCTIONS", "LogHook", "LoggedMetrics", "reduce_together", "compute_metric"]

REDUCTIONS = ("mean", "sum", "max", "min")
Entries = dict[str, tuple[str, float, float]]
"""``{name: (reduce, total, weight)}`` of one rank, ready to be gathered."""


def _is_metric(value: Any) -> bool:
    """A torchmetrics ``Metric`` (duck-typed: torchmetrics is an optional dependency)."""
    return all(callable(getattr(value, a, None)) for a in ("update", "compute", "reset", "sync"))


class LoggedMetrics:
    """What ``Trainer.log`` collected on this rank since the last reductions.

    The trainer sets ``phase`` (``"train"`` or ``"validation"``) and ``batch_size`` (the batch
    being processed) around the user's steps.
    """

    def __init__(self) -> None:
        self.phase = "train"
        self.batch_size = 1
        self.buckets: dict[str, dict[str, list]] = {"step": {}, "epoch": {}, "validation": {}}
        self.metrics: dict[str, dict[str, Any]] = {"epoch": {}, "validation": {}}
        self.prog_bar: set[str] = set()
        """Names to show on the progress bar."""

    def log(
        self,
        name: str,
        value: Any,
        reduce: str = "mean",
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        prog_bar: bool = False,
        batch_size: int | None = None,
    ) -> None:
        """Record ``value`` under ``name`` (see ``Trainer.log``)."""
        validation = self.phase == "validation"
        on_step = (not validation) if on_step is None else on_step
        on_epoch = validation if on_epoch is None else on_epoch
        _check_call(name, reduce, on_step, on_epoch, validation, value)
        epoch_bucket = "validation" if validation else "epoch"
        names = (
            {"step": name, "epoch": name} if on_step != on_epoch else {"step": f"{name}_step", "epoch": f"{name}_epoch"}
        )
        if prog_bar:
            self.prog_bar.update(names[k] for k, on in (("step", on_step), ("epoch", on_epoch)) if on)
        if _is_metric(value):
            self.metrics[epoch_bucket][names["epoch"]] = value
            return
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(
                    f"self.log({name!r}, ...) needs one number, got a tensor of shape {tuple(value.shape)}"
                )
            value = value.detach().reshape(())
        else:
            value = float(value)
        weight = float(self.batch_size if batch_size is None else batch_size)
        if on_step:
            _add(self.buckets["step"], names["step"], reduce, value, weight)
        if on_epoch:
            _add(self.buckets[epoch_bucket], names["epoch"], reduce, value, weight)

    def take(self, bucket: str) -> Entries:
        """This rank's entries of ``bucket`` (``step``, ``epoch``, ``validation``) as plain floats; emptied."""
        entries = {name: (r, float(total), float(weight)) for name, (r, total, weight) in self.buckets[bucket].items()}
        self.buckets[bucket] = {}
        return entries

    def take_metrics(self, bucket: str) -> dict[str, Any]:
        """The torchmetrics metrics logged into ``bucket`` (``epoch`` or ``validation``); forgotten."""
        metrics, self.metrics[bucket] = self.metrics[bucket], {}
        return metrics

    def reduced(self, bucket: str, process_group: ProcessGroup, reduce: Any) -> dict[str, float]:
        """Reduce ``bucket`` (collective): ``reduce(entries, metric_names)`` does the gather (with the
        trainer's own sums) and returns a dict; logged torchmetrics metrics are then computed, in
        name order, and added to it."""
        objects = self.take_metrics(bucket)
        values = reduce(self.take(bucket), sorted(objects))
        for name in sorted(objects):
            values[name] = compute_metric(process_group, objects[name])
        return values


class LogHook:
    """``Trainer.log``: the method user code calls (the Trainer holds a :class:`LoggedMetrics` as ``logged``)."""

    logged: LoggedMetrics
    callback_metrics: dict[str, float]

    def log(
        self,
        name: str,
        value: Any,
        reduce: str = "mean",
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        prog_bar: bool = False,
        batch_size: int | None = None,
    ) -> None:
        """Report a number (or a ``torchmetrics`` metric) from ``training_step``, ``validation_step``
        or a callback, reduced over every rank and written to every logger.

        Args:
            name: the metric's name (``on_log`` scalars, evaluation metrics, ``callback_metrics``).
            value: a number, a one-element tensor, or a torchmetrics ``Metric`` (epoch level;
                synchronised through ddptrain's process group).
            reduce: over ranks and steps: ``mean`` (weighted by ``batch_size``), ``sum``, ``max``, ``min``.
            on_step: reduce over each logging window (default in training).
            on_epoch: reduce over the epoch, or the whole validation set (default in validation).
            prog_bar: also show it on the progress bar.
            batch_size: the weight of this value in a mean (default: the current batch's size).

        See :mod:`ddptrain.trainer.logged` for where each value goes.
        """
        self.logged.log(name, value, reduce, on_step, on_epoch, prog_bar, batch_size)

    @property
    def progress_bar_metrics(self) -> dict[str, float]:
        """The latest reduced values of what was logged with ``prog_bar=True``."""
        return {k: v for k, v in self.callback_metrics.items() if k in self.logged.prog_bar}


def _check_call(name: str, reduce: str, on_step: bool, on_epoch: bool, validation: bool, value: Any) -> None:
    where = "validation_step" if validation else "training_step"
    if reduce not in REDUCTIONS:
        raise ValueError(f"self.log({name!r}, reduce={reduce!r}): reduce must be one of {', '.join(REDUCTIONS)}")
    if validation and on_step:
        raise ValueError(
            f"self.log({name!r}, on_step=True) in validation_step: validation values are reduced over the "
            "whole validation set once per evaluation; leave on_step unset (on_epoch=True)"
        )
    if not (on_step or on_epoch):
        raise ValueError(f"self.log({name!r}, on_step=False, on_epoch=False) in {where} would never report it")
    if _is_metric(value) and on_step:
        raise ValueError(
            f"self.log({name!r}, <torchmetrics metric>, on_step=True): a metric object is computed once per "
            "epoch or evaluation (on_epoch=True); for a per-step value log the batch's value, metric(preds, target)"
        )


def _add(bucket: dict[str, list], name: str, reduce: str, value: Any, weight: float) -> None:
    entry = bucket.get(name)
    if entry is None:
        bucket[name] = [reduce, value * weight if reduce == "mean" else value, weight]
        return
    if entry[0] != reduce:
        raise ValueError(f"self.log({name!r}) was called with reduce={entry[0]!r} and with reduce={reduce!r}")
    if reduce == "mean":
        entry[1], entry[2] = entry[1] + value * weight, entry[2] + weight
    elif reduce == "sum":
        entry[1] = entry[1] + value
    else:
        pick = max if reduce == "max" else min
        entry[1] = (
            pick(entry[1], value) if not isinstance(value, torch.Tensor) else _tensor_pick(reduce, entry[1], value)
        )


def _tensor_pick(reduce: str, a: Any, b: torch.Tensor) -> torch.Tensor:
    a = torch.as_tensor(a, dtype=b.dtype, device=b.device)
    return torch.maximum(a, b) if reduce == "max" else torch.minimum(a, b)


def _combine(per_rank: Sequence[Entries]) -> dict[str, float]:
    """Every rank's entries reduced by their ``reduce``: the same dict on every rank."""
    out: dict[str, float] = {}
    for name in sorted(set().union(*per_rank)):
        entries = [rank[name] for rank in per_rank if name in rank]
        reduce = entries[0][0]
        if any(e[0] != reduce for e in entries):
            raise ValueError(f"self.log({name!r}) used different reduce= on different ranks: {[e[0] for e in entries]}")
        totals = [e[1] for e in entries]
        if reduce == "mean":
            out[name] = sum(totals) / max(sum(e[2] for e in entries), 1e-300)
        else:
            out[name] = {"sum": sum, "max": max, "min": min}[reduce](totals)
    return out


def reduce_together(
    process_group: ProcessGroup, sums: Sequence[float], entries: Entries, metric_names: Sequence[str] = ()
) -> tuple[list[float], dict[str, float]]:
    """``sums`` summed element-wise over the ranks (float64, rank order) and every rank's logged
    ``entries`` reduced, in one gather (collective).

    ``metric_names``: the torchmetrics metrics this rank logged; every rank must have logged the
    same ones (each is then synchronised, in name order, by :func:`compute_metric`).
    """
    payload = ([float(s) for s in sums], entries, sorted(metric_names))
    gathered = all_gather_object(process_group, payload)
    names = [g[2] for g in gathered]
    if any(n != names[0] for n in names):
        raise ValueError(
            "self.log(name, <torchmetrics metric>) must log the same metrics on every rank; per rank: "
            + "; ".join(f"rank {r}: {n}" for r, n in enumerate(names))
        )
    totals = [sum(column) for column in zip(*(g[0] for g in gathered))] if sums else []
    return totals, _combine([g[1] for g in gathered])


def compute_metric(process_group: ProcessGroup, metric: Any) -> float:
    """A torchmetrics metric computed over every rank's states, synchronised through
    ``process_group`` (collective), then reset for the next epoch or evaluation."""

    def gather(tensor: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
        return [t.to(tensor.device) for t in all_gather_object(process_group, tensor.detach().cpu())]

    saved = metric.dist_sync_fn, metric.distributed_available_fn
    metric.dist_sync_fn, metric.distributed_available_fn = gather, lambda: process_group.size() > 1
    try:
        value = metric.compute()
    finally:
        metric.dist_sync_fn, metric.distributed_available_fn = saved
        metric.reset()
    return float(value)
