"""Stopping a run cleanly on SIGINT (Ctrl-C) or SIGTERM (what SLURM sends before a kill).

While :class:`GracefulStop` is installed, the first such signal does not interrupt the rank: it
asks to stop. Ranks receive signals at different moments, so they agree on *when*: after every
optimizer step each rank posts an asynchronous all-reduce (MAX) of its request and, one step
later, reads the answer — every rank reads the same answer after the same step, so they all stop
there, write a checkpoint together and end. The price is one 8-byte all-reduce per step that
nobody waits for until the next step. A second signal, a moment after the first, raises
``KeyboardInterrupt`` as Python's default handler would.
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

    def agreed(self, process_group: ProcessGroup) -> str | None:
        """Call after every optimizer step, on every rank: the signal all ranks now stop for, or None.

        Reads the answer to the request posted after the previous step and posts this step's.
        """
        decided = None
        if self._work is not None:
            self._work.wait()
            decided = _NAMES.get(int(self._flag.item()))
        code = _CODES.get(self.requested, 0)
        self._flag = torch.tensor([code], dtype=torch.int64, device=process_group.device)
        self._work = process_group.all_reduce(self._flag, ReduceOp.MAX)
        return decided

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
