"""What a fit reports: the logging window, the loss history, exact evaluation means, the final
metrics with the parameters' checksum, and the smoke check.

Collectives (every rank must call them at the same point, which the Trainer's loop guarantees):
:func:`reduce_sum` and what is built on it, :meth:`TrainingMetrics.reduce_window` and
:meth:`ExactMean.reduce`, and :meth:`TrainingMetrics.final`. Everything else here is local to a rank.
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
from .data import batch_size_of, make_batches, move_to
from .logged import Entries, reduce_together
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
        self.process_group = process_group
        self.window = LoggingWindow()
        self.loss_history: list[tuple[int, float]] = []
        """``(step, train/loss)`` at every logging point of the run."""
        self.last_eval: dict[str, float] = {}
        self.last_eval_step = -1
        self.times = {"train_s": 0.0, "eval_s": 0.0}
        self.smoke_probe_start: tuple[int, float] | None = None
        """``(step, loss)`` of the smoke check's probe before training (``None`` until measured)."""

    def reduce_window(self, step: int, lr: float, logged: Entries | None = None) -> dict[str, float]:
        """The window's scalars reduced over ranks (collective); appends to the loss history.

        ``logged``: this rank's ``self.log`` entries of the window, reduced in the same collective
        and returned with the window's scalars.
        """
        w = self.window
        sums = [w.loss_sum, w.steps, w.samples]
        (loss_sum, steps, samples), user = _reduce(self.process_group, sums, logged)
        elapsed = max(time.perf_counter() - w.start, 1e-9)
        scalars = {
            "train/loss": loss_sum / max(steps, 1),
            "train/lr": lr,
            "train/samples_per_s": samples / elapsed,
            "train/comm_wait_s": w.comm_wait_s / max(w.steps, 1),  # this rank's: no reduction
        }
        self.loss_history.append((step, scalars["train/loss"]))
        w.reset()
        return {**scalars, **user}

    def end_epoch(
        self, loss_sum: float, steps: int, seconds: float, logged: Entries | None = None, metric_names=()
    ) -> dict[str, float]:
        """Account an epoch's training time; ``train/epoch_loss`` over every rank's steps (collective),
        with ``logged`` (this rank's epoch-level ``self.log`` entries) reduced in the same collective."""
        self.times["train_s"] += seconds
        (total_loss, total_steps), user = _reduce(self.process_group, [loss_sum, steps], logged, metric_names)
        return {**({"train/epoch_loss": total_loss / total_steps} if total_steps > 0 else {}), **user}

    def record_eval(self, metrics: dict[str, float], step: int, seconds: float) -> None:
        self.last_eval, self.last_eval_step = metrics, step
        self.times["eval_s"] += seconds

    def final(self, module: nn.Module, *, step: int, epoch: int, fit_s: float) -> dict[str, Any]:
        """What ``fit`` returns and writes to ``metrics.json`` (collective: gathers every rank's
        checksum of ``module``'s parameters, so ``params_agree`` says whether the ranks agree)."""
        digests = all_gather_object(self.process_group, parameters_digest(module))
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


class SmokeCheckError(RuntimeError):
    """``trainer.smoke_check``: the loss did not fall, or the ranks' parameters differ."""


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
