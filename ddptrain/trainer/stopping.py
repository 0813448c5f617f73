"""Stopping a run cleanly on SIGINT (Ctrl-C) or SIGTERM (what SLURM sends before a kill), at
``trainer.max_time``, or when a callback or hook sets ``trainer.should_stop`` (e.g.
:class:`~ddptrain.trainer.EarlyStopping`).

While :class:`GracefulStop` is installed, the first such signal does not interrupt the rank: it
asks to stop. Ranks receive signals at different moments, so they agree on *when*, by votes
summed over ranks: ``(SIGINT, SIGTERM, max_time, should_stop)``, each 0 or 1 per rank. Every step's votes
ride in that step's gradient all-reduce (:meth:`ddptrain.ddp.DistributedDataParallel.register_sideband`:
no collective of their own); they are cast when the bucket that carries them launches, during
backward. So a flag set in ``training_step`` (or before it) stops the run after that very step,
on every rank; one set after the backward (``on_train_batch_end``) after the next step. At
evaluations and epoch ends the trainer asks with a blocking all-reduce of the same votes
(:meth:`GracefulStop.agreed`), so a decision taken there stops before the next step. One rank
voting is enough. SIGINT (the user at a terminal) wins over SIGTERM. A second signal, a moment
after the first, raises ``KeyboardInterrupt`` as Python's default handler would. Reaching
``max_time`` counts as a third kind of signal, ``"max_time"``, raised by the rank's own clock when
it casts its votes; the ranks' clocks differ a little, and the votes make them stop together.
The checkpoint a stopped run leaves is the Checkpointer's
(:meth:`~ddptrain.trainer.checkpoint.Checkpointer.save_at_stop`).
"""

from __future__ import annotations

import logging
import signal
import time

import torch

from ..comm.process_group import ProcessGroup
from ..comm.types import ReduceOp
from ..launch.signals import SECOND_SIGNAL_AFTER_S, StoppedBySignal, restore_signals, take_stop_signals

__all__ = ["GracefulStop"]

_log = logging.getLogger("ddptrain.trainer")
# The votes' order; a signal listed first wins when ranks got different ones.
_SIGNALS = ("SIGINT", "SIGTERM", "max_time")
NUM_VOTES = len(_SIGNALS) + 1  # the signals, then should_stop


class GracefulStop:
    """The signal handlers and the time limit of one fit, and the votes on the step to stop at.

    Args:
        max_time_s: stop after this many seconds from :meth:`install` (``trainer.max_time``); None: never.
        sigterm_leaves: SIGTERM ends this process at once instead of stopping the job: in an
            elastic job whose workers another launcher supervises, SIGTERM is that launcher taking
            this member away (torchrun stops all of a host's workers to restart them), and the
            others go on without it.
    """

    def __init__(self, max_time_s: float | None = None, sigterm_leaves: bool = False) -> None:
        self.requested: str | None = None
        """The first signal this rank received (``"SIGINT"``/``"SIGTERM"``, or ``"max_time"``), or None."""
        self._first_at = 0.0
        self._previous: dict[int, object] = {}
        self._max_time_s = max_time_s
        self._deadline: float | None = None
        self._sigterm_leaves = sigterm_leaves

    def install(self) -> None:
        """Take over SIGINT and SIGTERM (main thread only, and not one inherited as ignored:
        :func:`~ddptrain.launch.signals.take_stop_signals`); start the ``max_time`` clock."""
        if self._sigterm_leaves:
            self._previous = take_stop_signals(self._on_signal, (signal.SIGINT,))
            self._previous.update(take_stop_signals(_leave_the_job, (signal.SIGTERM,)))
        else:
            self._previous = take_stop_signals(self._on_signal)
        if self._max_time_s is not None:
            self._deadline = time.monotonic() + self._max_time_s

    def uninstall(self) -> None:
        restore_signals(self._previous)
        self._previous = {}

    def _on_signal(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested in (None, "max_time"):  # a signal after the time limit is still a first signal
            self.requested, self._first_at = name, time.monotonic()
            _log.warning("%s received: stopping after the current step, with a checkpoint", name)
        elif time.monotonic() - self._first_at >= SECOND_SIGNAL_AFTER_S:
            raise KeyboardInterrupt(f"second {name}")

    def votes(self, should_stop: bool) -> list[float]:
        """This rank's votes: 1.0 for the signal it received (``max_time`` once its clock passed
        the limit) and for ``should_stop``, else 0.0."""
        if self.requested is None and self._deadline is not None and time.monotonic() >= self._deadline:
            self.requested = "max_time"
            _log.warning("trainer.max_time reached: stopping after the current step, with a checkpoint")
        return [float(self.requested == name) for name in _SIGNALS] + [float(bool(should_stop))]

    @staticmethod
    def decide(sums: list[float]) -> tuple[str | None, bool]:
        """``(signal, should_stop)`` from the votes summed over ranks: any vote counts."""
        signal_name = next((name for name, n in zip(_SIGNALS, sums) if n > 0), None)
        return signal_name, sums[-1] > 0

    def agreed(self, process_group: ProcessGroup, should_stop: bool) -> tuple[str | None, bool]:
        """The votes summed now, in a blocking all-reduce of their own (collective: every rank,
        at the same point). For evaluations and epoch ends, and for steps whose votes did not
        ride in a gradient all-reduce."""
        votes = torch.tensor(self.votes(should_stop), dtype=torch.float64, device=process_group.device)
        process_group.label_next_collective("stop votes")
        process_group.all_reduce(votes, ReduceOp.SUM).wait()
        return self.decide(votes.tolist())


def _leave_the_job(signum: int, frame) -> None:
    raise StoppedBySignal("SIGTERM", "this worker's launcher took it away; the elastic job goes on with the others")
