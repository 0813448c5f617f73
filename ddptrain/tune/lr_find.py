"""The learning-rate range test (``python -m ddptrain.tune lr``), as Lightning's ``Tuner.lr_find``.

A short run on every rank raises the learning rate of every parameter group exponentially from
``lr_find.min_lr`` to ``lr_find.max_lr`` over ``lr_find.num_training`` optimizer steps. The loss of
each step is the training loss reduced over the ranks (the logging window of one step), smoothed
with an exponential average (weight 0.98, bias-corrected). The run stops early once the smoothed
loss exceeds ``lr_find.early_stop_threshold`` times the best one, or is not finite. The suggestion
(``lr_find.suggestion``) looks at the smoothed loss without its first 10 and its last point:
``minimum`` (fastai's rule) takes a tenth of the rate where it is lowest; ``steepest`` (Lightning's)
the rate where it falls fastest (numpy's gradient), which sits close to where the loss blows up.

Rank 0 writes ``<run>/lr_find.json`` (every rate and loss, the suggestion) and, when matplotlib is
installed (``pip install 'ddptrain[tune]'``), ``<run>/lr_find.png``: loss against rate on a log
axis, the suggestion marked. The weights after the test are spent: no checkpoint is written.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from ..config import LrFindConfig
from ..trainer.callbacks.base import Callback

__all__ = ["LRFinder", "suggest", "smoothed", "plot"]

log = logging.getLogger("ddptrain.tune")
SMOOTHING = 0.98
SKIP_BEGIN, SKIP_END = 10, 1


def rates(config: LrFindConfig) -> list[float]:
    """The learning rate of each of the test's steps: ``min_lr`` to ``max_lr``, evenly spaced in log."""
    n, low, high = config.num_training, config.min_lr, config.max_lr
    return [low * (high / low) ** (i / (n - 1)) for i in range(n)]


def smoothed(losses: list[float], beta: float = SMOOTHING) -> list[float]:
    """The exponential average of ``losses`` with bias correction (Lightning's, fastai's)."""
    average, out = 0.0, []
    for i, loss in enumerate(losses):
        average = beta * average + (1 - beta) * loss
        out.append(average / (1 - beta ** (i + 1)))
    return out


def suggest(lrs: list[float], losses: list[float], rule: str = "steepest") -> float | None:
    """The suggested rate of the (smoothed) ``losses``, the first 10 and the last point left out:
    ``steepest``, the rate at their steepest descent; ``minimum``, a tenth of the rate at their
    lowest. None when fewer than two finite points remain."""
    points = [(i, loss) for i, loss in enumerate(losses) if SKIP_BEGIN <= i < len(losses) - SKIP_END]
    points = [(i, loss) for i, loss in points if math.isfinite(loss)]
    if len(points) < 2:
        return None
    if rule == "minimum":
        return lrs[min(points, key=lambda point: point[1])[0]] / 10
    index, values = [i for i, _ in points], [loss for _, loss in points]
    # numpy.gradient's rule: one-sided at the ends, central inside
    gradients = [values[1] - values[0]]
    gradients += [(values[k + 1] - values[k - 1]) / 2 for k in range(1, len(values) - 1)]
    gradients += [values[-1] - values[-2]]
    return lrs[index[min(range(len(gradients)), key=gradients.__getitem__)]]


def plot(lrs: list[float], losses: list[float], suggestion: float | None, path: Path) -> Any:
    """Draw loss against learning rate (log axis) with the suggestion marked, save it to ``path``
    (a PNG); the matplotlib figure. Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    axes.plot(lrs, losses)
    axes.set_xscale("log")
    axes.set_xlabel("learning rate")
    axes.set_ylabel("training loss (smoothed)")
    if suggestion is not None:
        k = min(range(len(lrs)), key=lambda i: abs(math.log(lrs[i] / suggestion)))  # the nearest rate tried
        axes.plot([suggestion], [losses[k]], marker="o", markersize=9, color="red", label=f"suggested {suggestion:.3g}")
        axes.legend()
    axes.set_title("learning-rate range test")
    figure.tight_layout()
    figure.savefig(path, format="png")
    plt.close(figure)
    return figure


class LRFinder(Callback):
    """The range test inside a fit (``trainer.lr_find``): sets the rates, records the losses,
    stops when the loss diverges, and on rank 0 writes and prints the result."""

    implements = ("trainer.lr_find",)

    def __init__(self, config: LrFindConfig):
        self.config = config
        self.lrs = rates(config)
        self.losses: list[float] = []  # the reduced training loss of each step, raw
        self.start = 0
        self.result: dict[str, Any] | None = None

    def _set_rate(self, trainer: Any) -> None:
        i = min(trainer.state.step - self.start, len(self.lrs) - 1)
        for optimizer in trainer.optimizers:
            for group in optimizer.param_groups:
                group["lr"] = self.lrs[i]

    def on_fit_start(self, trainer: Any) -> None:
        self.start = trainer.state.step
        self._set_rate(trainer)

    def on_epoch_start(self, trainer: Any, epoch: int) -> None:
        self._set_rate(trainer)  # after an epoch-interval schedule stepped

    def on_train_batch_end(self, trainer: Any, loss: float) -> None:
        self._set_rate(trainer)  # the next step's rate, after the per-step schedules

    def on_log(self, trainer: Any, scalars: dict[str, float]) -> None:
        self.losses.append(float(scalars["train/loss"]))  # every step: trainer.log_every_steps=1
        curve = smoothed(self.losses)
        threshold = self.config.early_stop_threshold
        diverged = not math.isfinite(curve[-1]) or (threshold is not None and curve[-1] > threshold * min(curve))
        if diverged or len(self.losses) >= len(self.lrs):
            trainer.should_stop = True  # the same reduced loss on every rank: every rank agrees

    def on_fit_end(self, trainer: Any, metrics: dict[str, Any]) -> None:
        lrs, curve = self.lrs[: len(self.losses)], smoothed(self.losses)
        rule = self.config.suggestion
        suggestion = suggest(lrs, curve, rule)
        others = {name: suggest(lrs, curve, name) for name in ("minimum", "steepest")}
        self.result = {"suggestion": suggestion, "rule": rule, "suggestions": others, "lr": lrs, "loss": curve}
        self.result["raw_loss"] = self.losses
        metrics["lr_find"] = {"suggestion": suggestion, "steps": len(self.losses)}
        if not trainer.is_main:
            return
        run = Path(trainer.output_dir)
        run.mkdir(parents=True, exist_ok=True)
        (run / "lr_find.json").write_text(json.dumps(self.result, indent=1) + "\n")
        try:
            plot(lrs, curve, suggestion, run / "lr_find.png")
            where = f"plot: {run / 'lr_find.png'}"
        except ImportError:
            where = f"no plot: matplotlib is not installed (pip install 'ddptrain[tune]'); data: {run / 'lr_find.json'}"
        if suggestion is None:
            log.warning("lr_find: too few steps (%d) for a suggestion; raise lr_find.num_training", len(curve))
            return
        print(
            f"ddptrain: lr_find suggests optimizer.lr={suggestion:.3g} (lr_find.suggestion={rule}, over "
            f"{len(curve)} rates from {lrs[0]:.3g} to {lrs[-1]:.3g}; {where})",
            flush=True,
        )
