"""Shares by speed (``trainer.balance``): a slow rank gets less of each global batch.

Synchronous data parallelism runs at the pace of its slowest rank. With ``trainer.balance.shares``
set, the step strategies that walk global batches by position
(:mod:`.global_batch_steps`) cut each step by share instead of equally:

- **normal mode** (:class:`.global_batch_steps.SharedBatchSteps`): each micro-batch is cut into
  one slice per rank, sized by share, and each rank's loss is weighted by its slice's size, so
  ``.grad`` is still the step's per-sample mean;
- **invariant mode** (:class:`.invariant.InvariantSteps`): the ``virtual_ranks`` fixed shards of
  each micro-batch are dealt to the ranks by share; the exact sum does not depend on who computed
  a shard, so the bits do not change.

``auto`` measures each rank's own compute time per sample (not the time it waits for the others
in the all-reduce) over ``window`` steps; every ``window`` steps the ranks all-gather their
measurements and each computes the same new shares, in proportion to speed, capped at
``max_share``, at least one sample (one shard) per rank and micro-batch. The shares change only
when the predicted step time falls by more than ``min_gain`` (so noise does not make them flap),
at a step boundary, on every rank at once. Every change is logged, kept in ``metrics.json``
(``balance``) and the current shares are logged as ``balance/share_r<r>``. Each window also
measures the median wall time of a step, so a change's gain is measured (the window after it
against the window before), not only predicted; with ``trainer.doctor`` the doctor's report ends
with it. A change after which a step measured slower is taken back at the next window's end
(the ranks' speeds moved with the shares: noise on shared cores, or a slowdown that went
elsewhere), and each change taken back doubles the gain the next one must be predicted to make.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from ..comm.objects import all_gather_object
from ..comm.process_group import ProcessGroup
from ..config import BalanceConfig, ConfigError
from ..data.global_batches import split_by_weight

__all__ = ["Balancer", "BalanceChange", "capped_proportions"]

log = logging.getLogger("ddptrain.trainer")


def capped_proportions(weights: Sequence[float], cap: float | None) -> list[float]:
    """``weights`` as fractions summing to 1, none above ``cap``: what a capped share gives up
    goes to the others in proportion to their weights (water-filling)."""
    fractions = [w / sum(weights) for w in weights]
    if cap is None:
        return fractions
    capped: set[int] = set()
    while True:
        over = [r for r, f in enumerate(fractions) if f > cap + 1e-12 and r not in capped]
        if not over:
            return fractions
        capped.update(over)
        free = [r for r in range(len(weights)) if r not in capped]
        left = 1.0 - cap * len(capped)
        free_weight = sum(weights[r] for r in free)
        fractions = [cap if r in capped else left * weights[r] / free_weight for r in range(len(weights))]


@dataclass(frozen=True)
class BalanceChange:
    """One change of the shares: at which step, to what, and why (``metrics.json``'s ``balance.changes``)."""

    step: int
    shares: list[float]
    """Each rank's fraction of a global batch, after the change."""
    seconds_per_sample: list[float]
    """Each rank's measured compute time per sample over the window."""
    predicted_step_s: float
    """The compute time of a step with the new shares (the slowest rank's)."""
    previous_step_s: float
    """The same with the shares before the change."""
    measured_step_s_before: float
    """The median wall time of a step over the window before the change (what the ranks waited
    for included), measured."""
    measured_step_s_after: float | None = None
    """The same over the window after it; None until that window ends."""
    kind: str = "faster"
    """``faster``: shares predicted to make the step faster; ``taken back``: the shares before the
    previous change, after which a step measured slower."""

    @property
    def predicted_gain(self) -> float:
        """How many times faster the step is predicted to run with the new shares."""
        return self.previous_step_s / self.predicted_step_s

    @property
    def measured_gain(self) -> float | None:
        """How many times faster a step ran in the window after the change than in the one before."""
        return None if self.measured_step_s_after is None else self.measured_step_s_before / self.measured_step_s_after

    @property
    def made_it_slower(self) -> bool:
        """A change to faster shares after which a step measured slower than before it."""
        gain = self.measured_gain
        return self.kind == "faster" and gain is not None and gain < 1.0


class Balancer:
    """Each rank's share of a global batch (see the module docstring). Every rank holds one and
    calls it at the same steps, so all decide alike.

    Args:
        config: ``trainer.balance``.
        group: the ranks that share the batches.
        units: how finely a micro-batch is cut (its samples, or invariant mode's ``virtual_ranks``):
            the predictions round shares to these units, as the cut does.
        samples_per_step: the samples of a global batch (for predictions in seconds).
    """

    def __init__(self, config: BalanceConfig, group: ProcessGroup, units: int, samples_per_step: int):
        self.config, self.group, self.units = config, group, units
        self.samples_per_unit = samples_per_step / units
        world_size = group.size()
        fixed = config.shares if isinstance(config.shares, (list, tuple)) else [1.0] * world_size
        if len(fixed) != world_size:
            raise ConfigError(
                f"trainer.balance.shares={list(fixed)} names {len(fixed)} weight(s), and the job has {world_size} "
                "rank(s): give one weight per rank, or trainer.balance.shares=auto"
            )
        self.weights = capped_proportions([float(w) for w in fixed], config.max_share)
        """Each rank's fraction of every global batch (the same on every rank)."""
        self.auto = config.shares == "auto"
        self.changes: list[BalanceChange] = []
        self.measured: list[float] | None = None
        """Each rank's compute seconds per sample over the latest window (``auto``)."""
        self.measured_step_s: float | None = None
        """The median wall time of a step over the latest window (``auto``)."""
        self._compute_s = 0.0
        self._samples = 0
        self._steps = 0
        self._started: float | None = None
        self._step_walls: list[float] = []  # the window's wall time of each step, boundary to boundary
        self._boundary: float | None = None
        self._before_change: list[float] = self.weights  # the shares a change that made the step slower goes back to
        self.taken_back = 0
        """Changes taken back so far: each doubles the predicted gain the next change needs."""

    # == measuring (auto) =========================================================================
    def start(self) -> None:
        """This rank's compute of a step starts."""
        self._started = time.perf_counter()

    def stop(self, samples: int, waited_s: float = 0.0) -> None:
        """This rank's compute of a step ended, over ``samples`` samples; ``waited_s`` of the time
        since :meth:`start` was spent waiting for the other ranks (the all-reduce), not computing."""
        if self._started is not None:
            self._compute_s += max(time.perf_counter() - self._started - waited_s, 0.0)
            self._samples += samples
            self._started = None

    # == deciding =================================================================================
    def at_step_boundary(self, step: int) -> bool:
        """Called by every rank before each step: every ``window`` steps under ``auto``, gather the
        measurements (collective) and perhaps change :attr:`weights`. True when they changed."""
        if not self.auto:
            return False
        now_s = time.perf_counter()
        if self._boundary is not None:
            self._step_walls.append(now_s - self._boundary)
        self._boundary = now_s
        self._steps += 1
        if self._steps <= self.config.window:
            return False
        # The median wall time: a step that also evaluated or checkpointed does not count.
        walls = sorted(self._step_walls)
        mine = (self._compute_s, self._samples, walls[len(walls) // 2] if walls else 0.0)
        measured = all_gather_object(self.group, mine)
        self._compute_s, self._samples, self._steps, self._step_walls = 0.0, 0, 1, []
        per_sample = [s / n for s, n, _ in measured]
        self.measured = per_sample  # every rank had a sample in every step of the window: n > 0
        self.measured_step_s = max(wall for _, _, wall in measured)  # the same on every rank
        self._boundary = time.perf_counter()  # the gather is not the next step's
        if self.changes and self.changes[-1].measured_step_s_after is None:  # the window after a change
            last = self.changes[-1] = replace(self.changes[-1], measured_step_s_after=self.measured_step_s)
            if last.made_it_slower:  # noise, or a slowdown that moved: go back, and ask more of the next one
                return self._take_back(step, last, per_sample)
        proposed = capped_proportions([1.0 / t for t in per_sample], self.config.max_share)
        now, then = self.predicted_step_s(self.weights, per_sample), self.predicted_step_s(proposed, per_sample)
        if then >= now * (1.0 - self.required_gain):
            return False
        self._before_change = self.weights
        self._move_to(step, proposed, per_sample, "faster")
        if self.group.rank() == 0:
            log.info(
                "balance: shares %s from step %d (compute per sample %s ms; predicted step %.1f ms, was %.1f ms)",
                ", ".join(f"{w:.3f}" for w in proposed),
                step,
                ", ".join(f"{t * 1e3:.3f}" for t in per_sample),
                then * 1e3,
                now * 1e3,
            )
        return True

    @property
    def required_gain(self) -> float:
        """The fraction by which a change must be predicted to shorten the step: ``min_gain``,
        doubled for each change taken back (up to 0.9, or ``min_gain`` when that is higher)."""
        return max(self.config.min_gain, min(0.9, self.config.min_gain * 2**self.taken_back))

    def _take_back(self, step: int, last: BalanceChange, per_sample: list[float]) -> bool:
        """Go back to the shares before ``last``, after which a step measured slower."""
        self.taken_back += 1
        back = self._before_change
        self._move_to(step, back, per_sample, "taken back")
        if self.group.rank() == 0:
            log.info(
                "balance: shares back to %s from step %d: the change at step %d measured %.2fx, predicted %.2fx "
                "(the next change needs a predicted gain of %.0f%%)",
                ", ".join(f"{w:.3f}" for w in back),
                step,
                last.step,
                last.measured_gain,
                last.predicted_gain,
                100 * self.required_gain,
            )
        return True

    def _move_to(self, step: int, shares: list[float], per_sample: list[float], kind: str) -> None:
        """Take ``shares`` from the next step on, recorded as a change with its predictions."""
        then, now = self.predicted_step_s(shares, per_sample), self.predicted_step_s(self.weights, per_sample)
        rounded = [round(w, 6) for w in shares]
        self.changes.append(BalanceChange(step, rounded, per_sample, then, now, self.measured_step_s, kind=kind))
        self.weights = shares

    def predicted_step_s(self, weights: Sequence[float], seconds_per_sample: Sequence[float]) -> float:
        """A step's compute time with ``weights``, rounded to the units a step is cut in: the
        slowest rank's."""
        counts = split_by_weight(self.units, weights)
        return max(c * self.samples_per_unit * t for c, t in zip(counts, seconds_per_sample))

    def state_dict(self) -> dict[str, Any]:
        """The shares and every change so far: what a checkpoint, or an elastic job's state
        hand-over, keeps of the balance (the measurements of a window in progress are not kept)."""
        return {"shares": list(self.weights), "changes": [asdict(c) for c in self.changes]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`: the history of changes always, and under ``auto`` the
        shares when they name one per rank of this group (a resume at the same world size goes on
        with the shares it learnt; after a change of world size they start equal again)."""
        self.changes = [BalanceChange(**c) for c in state["changes"]]
        self.taken_back = sum(c.kind == "taken back" for c in self.changes)
        if self.auto and len(state["shares"]) == len(self.weights):
            self.weights = [float(w) for w in state["shares"]]
            if len(self.changes) > 1 and len(self.changes[-2].shares) == len(self.weights):
                self._before_change = list(self.changes[-2].shares)  # where the last change came from

    def report(self) -> dict[str, Any]:
        """``metrics.json``'s ``balance`` entry: the shares now, every change (with its measured
        gain, once the window after it ended), and (``auto``) each rank's compute seconds per
        sample and the median step time over the latest window."""
        report: dict[str, Any] = {
            "shares": [round(w, 6) for w in self.weights],
            "changes": [
                {**asdict(c), "predicted_gain": c.predicted_gain, "measured_gain": c.measured_gain}
                for c in self.changes
            ],
        }
        if self.measured is not None:
            report["seconds_per_sample"] = self.measured
            report["measured_step_s"] = self.measured_step_s
        return report
