"""Ctrl-C and SIGTERM around a job: launchers pass them on once, and a killed launcher leaves nothing.

A terminal's Ctrl-C reaches its foreground process group; SLURM's ``scancel`` and schedulers send
SIGTERM. Ranks started here sit in process groups of their own, so only the launcher receives a
terminal's signal, and :class:`SignalForwarder` passes it on to every rank exactly once: the
ranks then stop at the next step boundary they agree on and write a checkpoint
(:mod:`ddptrain.trainer.stopping`). A second signal, a moment later, means "now": the launcher
raises ``KeyboardInterrupt`` and its cleanup kills the ranks.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable

__all__ = [
    "take_stop_signals",
    "restore_signals",
    "SignalForwarder",
    "STOP_SIGNALS",
    "StoppedBySignal",
    "die_with_parent",
    "exit_on_stop_signals",
    "SECOND_SIGNAL_AFTER_S",
]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
SECOND_SIGNAL_AFTER_S = 1.0
"""A second signal counts as "stop now" only this long after the first: one keypress may reach a
process twice within milliseconds (from the terminal and from a launcher passing it on)."""

_log = logging.getLogger("ddptrain.launch")


class StoppedBySignal(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped the job before its ranks could stop cleanly (they were starting)."""

    def __init__(
        self,
        signal_name: str,
        detail: str = "during start-up, before any rank trained: nothing to resume; run the command again",
    ):
        super().__init__(detail)
        self.signal_name = signal_name


def take_stop_signals(handler: Callable, signals: tuple[int, ...] = STOP_SIGNALS) -> dict[int, object]:
    """Handle ``signals`` (default SIGINT and SIGTERM) with ``handler``, in the main thread
    (elsewhere: nothing); the previous handlers, for :func:`restore_signals`.

    A signal this process inherited as ignored stays ignored, as Python leaves it: ``nohup``, or a
    background job of a non-interactive shell, starts with SIGINT ignored, and a Ctrl-C in that
    terminal is not meant for it.
    """
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, handler) for sig in signals if signal.getsignal(sig) is not signal.SIG_IGN}


def restore_signals(previous: dict[int, object]) -> None:
    """Put back the handlers :func:`take_stop_signals` replaced."""
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def exit_on_stop_signals() -> None:
    """Until the trainer installs its own handlers: SIGINT or SIGTERM ends this process at once,
    silently, with status 128 + signal (no ``KeyboardInterrupt`` traceback from a starting rank)."""

    def _exit(signum: int, frame) -> None:
        os._exit(128 + signum)

    for sig in STOP_SIGNALS:
        signal.signal(sig, _exit)


class SignalForwarder:
    """While active (a context manager, main thread only), SIGINT/SIGTERM go on to ``targets()``.

    Args:
        targets: the pids to pass a signal on to, asked when it arrives.
    """

    def __init__(self, targets: Callable[[], Iterable[int]]):
        self.targets = targets
        self.received: str | None = None
        self._first_at = 0.0
        self._previous: dict[int, object] = {}

    def __enter__(self) -> SignalForwarder:
        self._previous = take_stop_signals(self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        restore_signals(self._previous)
        self._previous = {}

    def _on_signal(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.received is None:
            self.received, self._first_at = name, time.monotonic()
            _log.warning("%s: the ranks stop after their current step and write a checkpoint (again: stop now)", name)
            for pid in self.targets():
                try:
                    os.kill(pid, signum)
                except ProcessLookupError:
                    pass
        elif time.monotonic() - self._first_at >= SECOND_SIGNAL_AFTER_S:
            raise KeyboardInterrupt(f"second {name}: stopping the ranks now")


def die_with_parent(signum: int = signal.SIGKILL) -> None:
    """Ask the kernel to send ``signum`` to this process when its parent dies (Linux; elsewhere a
    no-op): a launcher killed outright must not leave ranks running."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signum)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
