"""The phases of a training step, made visible on purpose: profiler labels and phase listeners.

``profiled("ddptrain/forward_backward")`` is ``torch.profiler.record_function`` while a profiler is
recording (``trainer.profiler.enabled=true``, :class:`.callbacks.profiler.ProfilerCallback`) and a no-op
otherwise, so the loop pays nothing for the labels when it is not profiled.

:class:`StepPhases` announces the same phases to listeners (``ddptrain doctor`` times steps this
way): the loop marks them itself, so no tool needs to wrap or replace the trainer's methods. With
no listener a mark costs one check.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

__all__ = ["profiled", "StepPhases", "PhaseListener"]

PhaseListener = Callable[[str, float, Any], None]
"""``listener(phase, time.perf_counter(), payload)``; see :class:`StepPhases` for the phases."""


def profiled(name: str) -> contextlib.AbstractContextManager:
    """A ``record_function(name)`` scope when the profiler is on, else a null context."""
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


class StepPhases:
    """The moments of every optimizer step, in order, as the Trainer's loop marks them:

    - ``data``: the loop asks for the next step's micro-batches (so also: the previous step is over);
    - ``data_end``: they are here (payload: the list of micro-batches);
    - ``forward_backward`` / ``forward_backward_end``: forward and backward of the step (``Trainer.forward_backward``);
    - ``optimizer_step`` / ``optimizer_step_end``: ``Trainer.optimizer_step``;
    - ``param_all_gather`` / ``param_all_gather_end``: inside it, ZeRO's all-gather of the updated
      parameters (``dist.zero_stage``), communication like the reduction in backward.

    ``data`` comes once more after an epoch's last step, when its iterator is found empty.
    Listeners run on the training thread, synchronously: keep them cheap.
    """

    def __init__(self) -> None:
        self.listeners: list[PhaseListener] = []

    def add_listener(self, listener: PhaseListener) -> None:
        self.listeners.append(listener)

    def remove_listener(self, listener: PhaseListener) -> None:
        self.listeners.remove(listener)

    def mark(self, phase: str, payload: Any = None) -> None:
        if self.listeners:
            now = time.perf_counter()
            for listener in list(self.listeners):
                listener(phase, now, payload)

    @contextlib.contextmanager
    def span(self, phase: str) -> Iterator[None]:
        """``phase`` then ``phase_end`` around the block, which is also a profiler label ``ddptrain/phase``."""
        self.mark(phase)
        with profiled(f"ddptrain/{phase}"):
            yield
        self.mark(f"{phase}_end")

    def batches(self, steps: Iterable[Any]) -> Iterator[Any]:
        """``steps`` with ``data`` marked before each is asked for and ``data_end`` when it came."""
        it = iter(steps)
        while True:
            self.mark("data")
            try:
                item = next(it)
            except StopIteration:
                return
            self.mark("data_end", item)
            yield item
