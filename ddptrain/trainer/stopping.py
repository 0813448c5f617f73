"""Stopping a run cleanly on SIGINT (Ctrl-C) or SIGTERM (what SLURM sends before a kill), or when
a callback or hook sets ``trainer.should_stop`` (e.g. :class:`~ddptrain.trainer.EarlyStopping`).

While :class:`GracefulStop` is installed, the first such signal does not interrupt the rank: it
asks to stop. Ranks receive signals at different moments, so they agree on *when*: after every
optimizer step each rank posts an asynchronous all-reduce (MAX) of its request and, one step
later, reads the answer — every rank reads the same answer after the same step, so they all stop
there, write a checkpoint together and end. The price is one 16-byte all-reduce per step that
nobody waits for until the next step. ``trainer.should_stop`` travels in the same all-reduce: one
rank setting it is enough, and all ranks stop at the same step. At evaluations and epoch ends the
trainer asks with ``wait=True`` instead, so a decision taken there stops before the next step.
A second signal, a moment after the first, raises ``KeyboardInterrupt`` as Python's default
handler would.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from pathlib import Path

import torch

from ..comm.process_group import ProcessGroup
from ..comm.types import ReduceOp
from ..launch.signals import SECOND_SIGNAL_AFTER_S, STOP_SIGNALS
from .callbacks import CheckpointCallback, TrainerView
from .checkpoint_io import checkpoint_name

__all__ = ["GracefulStop", "checkpoint_now"]

_log = logging.getLogger("ddptrain.trainer")
# MAX over ranks: SIGINT (the user at a terminal) wins over SIGTERM.
_CODES = {"SIGTERM": 1, "SIGINT": 2}
_NAMES = {code: name for name, code in _CODES.items()}


class GracefulStop:
    """The signal handlers of one fit and the agreement on the step to stop at."""

    def __init__(self) -> None:
        self.requested: str | None = None
        """The first signal this rank received (``"SIGINT"``/``"SIGTERM"``), or None."""
        self._first_at = 0.0
        self._previous: dict[int, object] = {}
        self._flag: torch.Tensor | None = None
        self._work = None

    def install(self) -> None:
        """Take over SIGINT and SIGTERM (main thread only; elsewhere signals keep their handlers)."""
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _on_signal(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested is None:
            self.requested, self._first_at = name, time.monotonic()
            _log.warning("%s received: stopping after the current step, with a checkpoint", name)
        elif time.monotonic() - self._first_at >= SECOND_SIGNAL_AFTER_S:
            raise KeyboardInterrupt(f"second {name}")

    def agreed(
        self, process_group: ProcessGroup, should_stop: bool = False, wait: bool = False
    ) -> tuple[str | None, bool]:
        """Call after every optimizer step, on every rank: ``(signal, should_stop)`` agreed by all ranks.

        ``signal`` is the signal every rank now stops for (or None); ``should_stop`` is True when
        any rank had set its flag. Reads the answer to the request posted after the previous step
        and posts this step's; with ``wait=True`` also waits for this step's answer (a blocking
        collective, for points where every rank already waits: evaluations, epoch ends).
        """
        signal_code, flag = self._read()
        code = _CODES.get(self.requested, 0)
        self._flag = torch.tensor([code, int(bool(should_stop))], dtype=torch.int64, device=process_group.device)
        self._work = process_group.all_reduce(self._flag, ReduceOp.MAX)
        if wait:
            now_code, now_flag = self._read()
            signal_code, flag = max(signal_code, now_code), flag or now_flag
        return _NAMES.get(signal_code), flag

    def _read(self) -> tuple[int, bool]:
        """The posted request's answer (waits for it), or ``(0, False)`` when none is pending."""
        if self._work is None:
            return 0, False
        self._work.wait()
        self._work = None
        signal_code, flag = (int(v) for v in self._flag.tolist())
        return signal_code, bool(flag)

    def finish(self) -> None:
        """Wait for the last posted request (every rank, at the same point) and give back the signals."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        self.uninstall()


def checkpoint_now(trainer: TrainerView, callbacks: list) -> Path:
    """A checkpoint of the current step, written unless one exists (collective; after a signal).

    Through the run's :class:`CheckpointCallback` when it has one (it skips a step it already
    saved and prunes old ones), else straight into ``trainer.checkpoint_dir``: a run stopped by a
    signal always leaves something to resume from.
    """
    path = trainer.checkpoint_dir / checkpoint_name(trainer.state.step)
    callback = next((c for c in callbacks if isinstance(c, CheckpointCallback)), None)
    if callback is None:
        return trainer.save_checkpoint(path)
    return callback.save(trainer) or callback.directory / checkpoint_name(trainer.state.step)
