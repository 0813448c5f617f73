"""Moments on the timeline of the device that does the work: the host's clock on a CPU, CUDA
events on a GPU.

On a GPU the host runs ahead of the kernels it queues, so ``time.perf_counter()`` read at a phase
boundary says when the phase was *queued*, not when the GPU got there; and waiting for an NCCL
all-reduce makes the stream wait, not the host, so a host clock around it reads almost nothing.
:meth:`DeviceClock.now` records a CUDA event on the current stream instead. Once the measured work
is done, :meth:`DeviceClock.resolver` maps events onto the host's ``perf_counter`` seconds through
one anchor (an event recorded on an idle GPU, read at once on the host), so moments of both kinds
sit on one timeline. Measuring tools only (the doctor): the resolver synchronises the device.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["DeviceClock", "finish_queued_work"]


class DeviceClock:
    """``now()`` and ``resolver()`` for ``device`` (see the module doc)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def now(self) -> Any:
        """A moment: ``perf_counter`` seconds on a CPU; a recorded CUDA event on a GPU."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def resolver(self) -> Callable[[Any], Any]:
        """A function from a moment to ``perf_counter`` seconds (floats and None pass through).
        On a GPU it first waits for the device: call it once the measured work is queued."""
        if not self.cuda:
            return lambda moment: moment
        torch.cuda.synchronize()
        anchor = torch.cuda.Event(enable_timing=True)
        anchor.record()
        anchor.synchronize()
        host = time.perf_counter()

        def resolve(moment: Any) -> Any:
            if moment is None or isinstance(moment, float):
                return moment
            return host - moment.elapsed_time(anchor) / 1000.0

        return resolve


def finish_queued_work(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a measurement's bounds); nothing on a CPU, whose work
    is done when its call returns."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
