"""Labels for torch.profiler traces: the Trainer's phases under names of their own.

``profiled("ddptrain/train_step")`` is ``torch.profiler.record_function`` while a profiler is
recording (``trainer.profile=true``, :class:`.callbacks.profiler.ProfilerCallback`) and a no-op
otherwise, so the loop pays nothing for the labels when it is not profiled.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["profiled"]


def profiled(name: str) -> contextlib.AbstractContextManager:
    """A ``record_function(name)`` scope when the profiler is on, else a null context."""
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()
