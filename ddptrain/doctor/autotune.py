"""``dist.bucket_cap_mb=auto``: time a few bucket sizes in the first steps and keep the fastest.

The sizes: ``CAPS_MB``, and the model's gradient bytes over ``SPLITS`` (a model smaller than the
fixed caps gets all its gradients in one bucket from each of them, and only smaller buckets can
overlap its communication with backward). Every rank runs the same schedule: for each size that
gives a layout of its own (caps that give the same buckets are tried once), lay the buckets out again
(:meth:`~ddptrain.ddp.reducer.Reducer.rebucket`, between steps, in the current launch order),
run one step to settle, then time ``STEPS_PER_CAP`` steps. The median step times are all-reduced
(MAX: the job goes at its slowest rank's pace), so every rank computes the same minimum and
installs the same layout; the choice and the timings are logged by rank 0. Training goes on
during the trial (the steps are real steps; only their bucket layout differs).
"""

from __future__ import annotations

import logging
import statistics
import time

import torch

from ..comm.types import ReduceOp
from ..config import DEFAULT_BUCKET_CAP_MB
from ..ddp.buckets import MB
from ..trainer.callbacks.base import Callback

log = logging.getLogger("ddptrain.doctor")

CAPS_MB = (1.0, 5.0, DEFAULT_BUCKET_CAP_MB, 100.0)
SPLITS = (2, 4, 8)
STEPS_PER_CAP = 5


def candidate_caps(gradient_bytes: int) -> tuple[float, ...]:
    """The bucket sizes (MiB) to try for a model of ``gradient_bytes``: ``CAPS_MB`` and the gradient
    over ``SPLITS``, smallest first."""
    split = {round(gradient_bytes / MB / k, 4) for k in SPLITS}
    return tuple(sorted({*CAPS_MB, *(c for c in split if c > 0)}))


def _distinct_layouts(reducer, caps_mb: tuple[float, ...]) -> tuple[float, ...]:
    """The caps that give different bucket layouts (the first of equals; the same on every rank:
    the layout depends on the parameters only). Trying one layout twice would let noise choose."""
    seen, kept = set(), []
    for cap in caps_mb:
        layout = tuple(tuple(b) for b in reducer.layout_at(int(cap * MB)))
        if layout not in seen:
            seen.add(layout)
            kept.append(cap)
    return tuple(kept)


class BucketAutotune(Callback):
    """Try ``caps_mb`` for ``1 + steps_per_cap`` steps each, then keep the fastest (see the module doc)."""

    implements = ("dist.bucket_cap_mb=auto",)

    def __init__(self, caps_mb: tuple[float, ...] | None = None, steps_per_cap: int = STEPS_PER_CAP):
        """``caps_mb``: the sizes to try (default: :func:`candidate_caps` of the model)."""
        self.caps_mb, self.steps_per_cap = (tuple(caps_mb) if caps_mb else None), steps_per_cap
        self.times: list[list[float]] = []
        self.chosen_mb: float | None = None
        self._trial = 0
        self._step_in_trial = 0
        self._started = 0.0

    def on_fit_start(self, trainer) -> None:
        reducer = trainer.model.reducer
        caps = self.caps_mb or candidate_caps(sum(p.numel() * p.element_size() for p in reducer.params))
        self.caps_mb = _distinct_layouts(reducer, caps)
        self.times = [[] for _ in self.caps_mb]
        trainer.model.reducer.rebucket(int(self.caps_mb[0] * MB))
        self._started = time.perf_counter()

    def on_train_batch_end(self, trainer, loss: float) -> None:
        if self.chosen_mb is not None or not self.caps_mb:
            return
        now = time.perf_counter()
        if self._step_in_trial > 0:  # the first step of a layout settles it (allocation, caches)
            self.times[self._trial].append(now - self._started)
        self._step_in_trial += 1
        if self._step_in_trial > self.steps_per_cap:
            self._trial, self._step_in_trial = self._trial + 1, 0
            if self._trial == len(self.caps_mb):
                self._choose(trainer)
            else:
                trainer.model.reducer.rebucket(int(self.caps_mb[self._trial] * MB))
        self._started = time.perf_counter()

    def _choose(self, trainer) -> None:
        pg = trainer.process_group
        medians = torch.tensor([statistics.median(t) for t in self.times], dtype=torch.float64, device=pg.device)
        pg.all_reduce(medians, ReduceOp.MAX).wait()  # agreed: the same numbers, so the same choice, everywhere
        best = min(range(len(self.caps_mb)), key=lambda i: float(medians[i]))
        self.chosen_mb = self.caps_mb[best]
        trainer.model.reducer.rebucket(int(self.chosen_mb * MB))
        if trainer.is_main:
            tried = ", ".join(f"{c:g} MB: {float(m) * 1e3:.1f} ms" for c, m in zip(self.caps_mb, medians))
            log.info("dist.bucket_cap_mb=auto chose %g MB (median step: %s)", self.chosen_mb, tried)
