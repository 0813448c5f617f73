"""What a fit reports: the logging window, the loss history, exact evaluation means, the final
metrics with the parameters' checksum, the smoke check, and the values user code reports with
``Trainer.log``.

Collectives (every rank must call them at the same point, which the Trainer's loop guarantees):
:func:`reduce_sum` and what is built on it, :meth:`TrainingMetrics.reduce_window` and
:meth:`ExactMean.reduce`, and :meth:`TrainingMetrics.final`. Everything else here is local to a rank.

``Trainer.log``: values are collected on each rank and reduced over all ranks together with the
trainer's own scalars (one gather per logging window, per epoch end and per evaluation, however
many names were logged).

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

import hashlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from ..comm.objects import all_gather_object
from ..comm.process_group import ProcessGroup
from ..comm.types import ReduceOp
from ..config import DataConfig
from ..errors import SmokeCheckError
from .data import batch_size_of, make_batches, move_to
from .rng import preserved_rng_state

__all__ = [
    "reduce_sum",
    "parameters_digest",
    "LoggingWindow",
    "TrainingMetrics",
    "ExactMean",
    "SmokeCheckError",
    "SmokeProbe",
    "smoke_check",
    "SMOKE_MIN_RELATIVE_FALL",
    "REDUCTIONS",
    "LoggedMetrics",
    "reduce_together",
    "compute_metric",
]

SMOKE_MIN_RELATIVE_FALL = 0.01
"""The smoke check wants the probe loss to fall by at least this fraction of its first value."""


def reduce_sum(process_group: ProcessGroup, values: Sequence[float]) -> list[float]:
    """Sum ``values`` element-wise over the ranks of ``process_group`` (collective), in float64."""
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=process_group.device)
    process_group.all_reduce(t, ReduceOp.SUM).wait()
    return t.cpu().tolist()


def _reduce(
    process_group: ProcessGroup, sums: Sequence[float], logged: Entries | None, metric_names=()
) -> tuple[list[float], dict[str, float]]:
    """:func:`reduce_sum` alone, or with ``self.log`` entries in one gather (collective)."""
    if logged is None:
        return reduce_sum(process_group, sums), {}
    return reduce_together(process_group, sums, logged, metric_names)


def peak_rss_mb() -> float:
    """This process's peak resident memory in MiB: the kernel's high-water mark (``VmHWM``), or
    ``getrusage``'s where ``/proc`` is missing."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def parameters_digest(module: nn.Module) -> str:
    """SHA-256 of ``module``'s state dict (names and raw bytes): equal digests, equal parameters."""
    digest = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class LoggingWindow:
    """Training scalars of this rank accumulated between two logging points."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.loss_sum, self.steps, self.samples, self.comm_wait_s = 0.0, 0, 0, 0.0
        self.start = time.perf_counter()

    def add(self, loss: float, samples: int, comm_wait_s: float) -> None:
        """One optimizer step: its mean loss, the samples it trained on, its wait for all-reduces."""
        self.loss_sum, self.steps, self.samples = self.loss_sum + loss, self.steps + 1, self.samples + samples
        self.comm_wait_s += comm_wait_s


class TrainingMetrics:
    """The numbers of one fit: logging window, loss history, last evaluation, time spent.

    The loss history and the last evaluation travel in checkpoints (:meth:`state_dict`), so a
    resumed run reports the run's first loss, not its own.

    Args:
        process_group: the group the scalars are reduced over (``None`` until the fit joins one).
    """

    def __init__(self, process_group: ProcessGroup | None = None):
        self.window = LoggingWindow()
        self.process_group = process_group
        self.loss_history: list[tuple[int, float]] = []
        """``(step, train/loss)`` at every logging point of the run."""
        self.last_eval: dict[str, float] = {}
        self.last_eval_step = -1
        self.times = {"train_s": 0.0, "eval_s": 0.0}
        self.training_started: float | None = None  # start_training
        self._epoch_started = (0.0, 0.0)  # start_epoch: the clock and eval_s then
        self.smoke_probe_start: tuple[int, float] | None = None
        """``(step, loss)`` of the smoke check's probe before training (``None`` until measured)."""

    @property
    def process_group(self) -> ProcessGroup | None:
        return self._process_group

    @process_group.setter
    def process_group(self, group: ProcessGroup | None) -> None:
        """The group; the bytes it counts from now on are this fit's (``comm/bytes_*``)."""
        self._process_group = group
        self.bytes_at_start = self.bytes_at_window_start = self._bytes_sent()

    def _bytes_sent(self) -> int:
        """This rank's bytes handed to communication so far (:class:`ddptrain.comm.process_group.Traffic`)."""
        return 0 if self._process_group is None else self._process_group.traffic.total

    def reduce_window(self, step: int, lr: float, logged: Entries | None = None) -> dict[str, float]:
        """The window's scalars reduced over ranks (collective); appends to the loss history.

        ``logged``: this rank's ``self.log`` entries of the window, reduced in the same collective
        and returned with the window's scalars.
        """
        w = self.window
        sent = self._bytes_sent() - self.bytes_at_window_start  # before this reduction's own bytes
        sums = [w.loss_sum, w.steps, w.samples]
        (loss_sum, steps, samples), user = _reduce(self.process_group, sums, logged)
        elapsed = max(time.perf_counter() - w.start, 1e-9)
        scalars = {
            "train/loss": loss_sum / max(steps, 1),
            "train/lr": lr,
            "train/samples_per_s": samples / elapsed,
            "train/comm_wait_s": w.comm_wait_s / max(w.steps, 1),  # this rank's: no reduction
            # this rank's payload bytes per step (Traffic), the logging reductions left out
            "comm/bytes_per_step": sent / max(w.steps, 1),
        }
        self.loss_history.append((step, scalars["train/loss"]))
        self.start_window()
        return {**scalars, **user}

    def start_training(self) -> None:
        """The fit's first step starts now (``time/train_s`` of evaluations counts from here)."""
        self.training_started = time.perf_counter()
        self.start_window()

    def start_window(self) -> None:
        """Start a logging window now: its time and its bytes count from here (the fit calls it
        before its first step, so that start-up is in neither)."""
        self.window.reset()
        self.bytes_at_window_start = self._bytes_sent()

    def start_epoch(self) -> None:
        """An epoch's steps start now: its training time counts from here to :meth:`end_epoch`."""
        self._epoch_started = (time.perf_counter(), self.times["eval_s"])

    def end_epoch(
        self, loss_sum: float, steps: int, logged: Entries | None = None, metric_names=()
    ) -> dict[str, float]:
        """Account the epoch's training time (since :meth:`start_epoch`, less the evaluations within
        it: ``trainer.eval_every_steps``); ``train/epoch_loss`` over every rank's steps (collective),
        with ``logged`` (this rank's epoch-level ``self.log`` entries) reduced in the same collective."""
        started, eval_s = self._epoch_started
        self.times["train_s"] += time.perf_counter() - started - (self.times["eval_s"] - eval_s)
        (total_loss, total_steps), user = _reduce(self.process_group, [loss_sum, steps], logged, metric_names)
        return {**({"train/epoch_loss": total_loss / total_steps} if total_steps > 0 else {}), **user}

    def record_eval(self, metrics: dict[str, float], step: int, seconds: float) -> None:
        """Keep an evaluation's metrics, adding ``time/train_s``: the seconds since the first step
        of this fit, evaluations left out (time-to-accuracy curves; a resumed fit counts its own)."""
        if self.training_started is not None:
            metrics["time/train_s"] = time.perf_counter() - self.training_started - self.times["eval_s"] - seconds
        self.last_eval, self.last_eval_step = metrics, step
        self.times["eval_s"] += seconds

    def final(self, module: nn.Module, *, step: int, epoch: int, fit_s: float) -> dict[str, Any]:
        """What ``fit`` returns and writes to ``metrics.json`` (collective: gathers every rank's
        checksum of ``module``'s parameters, so ``params_agree`` says whether the ranks agree)."""
        sent = self._bytes_sent() - self.bytes_at_start
        gathered = all_gather_object(self.process_group, (parameters_digest(module), peak_rss_mb(), sent))
        digests = [digest for digest, _, _ in gathered]
        final: dict[str, Any] = {"step": step, "epoch": epoch, "world_size": self.process_group.size()}
        final.update(self.last_eval)
        if self.loss_history:
            final["train/loss_first"] = self.loss_history[0][1]
            final["train/loss_last"] = self.loss_history[-1][1]
        final["time/train_s"] = self.times["train_s"]
        final["time/eval_s"] = self.times["eval_s"]
        final["time/fit_s"] = fit_s
        final["params_sha256"] = digests[0]
        final["params_agree"] = all(d == digests[0] for d in digests)
        final["memory/peak_rss_mb"] = max(peak for _, peak, _ in gathered)  # the largest rank's high-water mark
        final["comm/bytes_sent"] = max(n for _, _, n in gathered)  # the busiest rank's (payloads; see Traffic)
        return final

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint's ``metrics``, ``loss_history`` and ``smoke_probe_start`` entries (plain types)."""
        probe = self.smoke_probe_start
        return {
            "metrics": {k: float(v) for k, v in self.last_eval.items()},
            "loss_history": [[step, float(loss)] for step, loss in self.loss_history],
            "smoke_probe_start": None if probe is None else [probe[0], float(probe[1])],
        }

    def load_state_dict(self, checkpoint: dict[str, Any]) -> None:
        """Restore from a checkpoint (older ones may lack some entries)."""
        self.last_eval = dict(checkpoint.get("metrics") or {})
        self.last_eval_step = checkpoint["step"] if self.last_eval else -1
        self.loss_history = [(int(step), float(loss)) for step, loss in checkpoint.get("loss_history") or []]
        probe = checkpoint.get("smoke_probe_start")
        self.smoke_probe_start = None if probe is None else (int(probe[0]), float(probe[1]))


class ExactMean:
    """Means of per-sample metrics over exactly a dataset split among ranks.

    A ``DistributedSampler`` pads ranks with duplicates so all take the same number of batches;
    ``padding`` (its ``padding_mask()``) marks them, and they are left out, so each sample counts
    exactly once. Feed every batch of one full pass in order, then :meth:`reduce`.
    """

    def __init__(self, padding: torch.Tensor):
        self.padding = padding
        self.position = 0
        self.sums: dict[str, float] = {}
        self.count = 0.0

    def add(self, values: dict[str, torch.Tensor], batch_size: int) -> None:
        """``values``: ``{name: one value per sample}`` of the next ``batch_size`` samples."""
        keep = (~self.padding[self.position : self.position + batch_size]).to(torch.float64)
        self.position += batch_size
        for name, tensor in values.items():
            tensor = tensor.detach().reshape(-1).to("cpu", torch.float64)
            if len(tensor) != batch_size:
                raise ValueError(
                    f"validation_step returned {len(tensor)} value(s) for metric {name!r} on a "
                    f"batch of {batch_size}: return one value per sample (reduction='none')"
                )
            self.sums[name] = self.sums.get(name, 0.0) + float((tensor * keep).sum())
        self.count += float(keep.sum())

    def reduce(
        self, process_group: ProcessGroup, prefix: str = "eval/", logged: Entries | None = None, metric_names=()
    ) -> dict[str, float]:
        """``{prefix + name: mean}`` and ``{prefix}samples``, the same on every rank (collective).

        ``logged`` (this rank's ``self.log`` entries of the pass) and ``metric_names`` (its logged
        torchmetrics, checked alike on every rank) go in the same collective; their values are
        returned under their own names.
        """
        names = sorted(self.sums)  # the same keys in the same order on every rank
        sums = [self.sums[k] for k in names] + [self.count]
        totals, user = _reduce(process_group, sums, logged, metric_names)
        count = totals[-1]
        metrics: dict[str, float] = {f"{prefix}{k}": totals[i] / count for i, k in enumerate(names)}
        metrics[f"{prefix}samples"] = int(round(count))
        return {**metrics, **user}


class SmokeProbe:
    """The training loss on one fixed set of training samples, measured the same way every time.

    Logging windows average different batches, so comparing them says little: with nothing
    learnt, a later window can still be lower by luck. The probe evaluates the same samples, the
    module in eval mode (no dropout) and without gradients, before and after training; if nothing
    was learnt, both measurements are equal to the bit. It draws no random numbers.

    Args:
        batches: the fixed samples, as batches (held in memory).
        loss: ``loss(module, batch) -> scalar`` (the Trainer's ``training_step``, called with the
            bare module).
        device: where the module lives.
    """

    def __init__(self, batches: list[Any], loss: Callable[[nn.Module, Any], torch.Tensor], device: torch.device):
        self.batches = batches
        self.loss = loss
        self.device = device
        self.num_samples = sum(batch_size_of(b) for b in batches)

    @classmethod
    def first_samples(
        cls, dataset: Dataset, data: DataConfig, loss: Callable, device: torch.device, loader_options=None
    ) -> SmokeProbe:
        """A probe on the first ``data.global_batch_size`` samples of ``dataset`` (the same on every
        rank and every world size), in batches of ``data.eval_batch_size``, collated as training
        collates them (``loader_options``: a ``train_dataloader()`` DataLoader's)."""
        count = min(data.global_batch_size, len(dataset))
        with preserved_rng_state(device):  # a random transform must not move the training stream
            batches = list(make_batches(dataset, range(count), data.eval_batch_size, loader_options=loader_options))
        return cls(batches, loss, device)

    def measure(self, module: nn.Module) -> float:
        """The sample-weighted mean loss of ``module`` on the probe's samples (local, no collective)."""
        was_training = module.training
        module.eval()
        total = 0.0
        with torch.no_grad(), preserved_rng_state(self.device):
            for batch in self.batches:
                total += float(self.loss(module, move_to(batch, self.device))) * batch_size_of(batch)
        module.train(was_training)
        return total / self.num_samples

    def start(self, metrics: TrainingMetrics, step: int, module: nn.Module) -> None:
        """Measure before training, unless ``metrics`` (restored by a resume) holds the run's first measurement."""
        if metrics.smoke_probe_start is None:
            metrics.smoke_probe_start = (step, self.measure(module))

    def check(self, metrics: TrainingMetrics, module: nn.Module, final: dict[str, Any]) -> str:
        """Measure after training and apply :func:`smoke_check` to the start and this; the line to log.

        ``final``: what ``fit`` returns (its ``step``, ``params_agree`` and ``world_size``).
        """
        return smoke_check(
            params_agree=final["params_agree"],
            before=metrics.smoke_probe_start,
            after=(final["step"], self.measure(module)),
            num_samples=self.num_samples,
            world_size=final["world_size"],
        )


def smoke_check(
    *, params_agree: bool, before: tuple[int, float], after: tuple[int, float], num_samples: int, world_size: int
) -> str:
    """Refuse a run whose probe loss did not fall or whose ranks ended with different parameters.

    Args:
        params_agree: whether every rank's parameter checksum was the same.
        before, after: ``(step, loss)`` of the :class:`SmokeProbe` before and after training.
        num_samples: how many samples the probe holds (for the message).
        world_size: ranks of the job (for the message).

    Returns:
        The line to log when the check passes.

    Raises:
        SmokeCheckError: naming each problem and its numbers.
    """
    problems = []
    if not params_agree:
        problems.append("the parameters differ between ranks (checksums all-gathered at the end)")
    (first_step, first), (last_step, last) = before, after
    if not first - last > SMOKE_MIN_RELATIVE_FALL * abs(first):
        problems.append(
            f"the training loss did not fall: {first:.6g} at step {first_step} -> {last:.6g} at step "
            f"{last_step} on the same {num_samples} training sample(s) (it must fall by at least "
            f"{SMOKE_MIN_RELATIVE_FALL:.0%}); check the learning rate and that the optimizer steps"
        )
    if problems:
        raise SmokeCheckError("smoke check failed: " + "; ".join(problems))
    return f"smoke check passed: loss {first:.4f} -> {last:.4f}, parameters identical on {world_size} rank(s)"


# Values user code reports with Trainer.log (see the module docstring)

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
