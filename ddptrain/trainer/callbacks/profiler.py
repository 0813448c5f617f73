"""``trainer.profiler.enabled=true``: torch.profiler over a few optimizer steps, one trace per rank.

The schedule is torch's: skip ``wait`` steps, warm up ``warmup`` (recorded, then discarded),
record ``active`` steps, once. Each rank writes ``<output_dir>/profile/rank<r>.<time>.pt.trace.json``
(``torch.profiler.tensorboard_trace_handler``), Chrome-trace JSON that TensorBoard's profiler plugin
(``tensorboard --logdir <output_dir>/profile``, with ``torch-tb-profiler``) and Perfetto
(https://ui.perfetto.dev, "Open trace file") both open. Each step is a ``ProfilerStep#<n>`` span,
with the Trainer's phases inside it as ``ddptrain/forward_backward`` and ``ddptrain/optimizer_step``
(:func:`ddptrain.trainer.profiling.profiled`); CUDA kernels are recorded too on a GPU.

One profiler per process: ranks that are threads of one process (``ddptrain.testing.run_threaded``)
profile on the first rank only.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from .base import Callback, TrainerView

__all__ = ["ProfilerCallback"]

log = logging.getLogger("ddptrain.profile")


class ProfilerCallback(Callback):
    """Profile steps ``wait + warmup + 1`` to ``wait + warmup + active`` of the fit (1-based).

    Args:
        wait, warmup, active: torch.profiler's schedule, in optimizer steps.
        directory: where traces go (default ``<output_dir>/profile``).
    """

    def __init__(self, wait: int = 1, warmup: int = 1, active: int = 3, directory: Path | None = None):
        self.wait, self.warmup, self.active = wait, warmup, active
        self.directory = None if directory is None else Path(directory)
        self.profiler: torch.profiler.profile | None = None

    def on_fit_start(self, trainer: TrainerView) -> None:
        if torch.autograd._profiler_enabled():
            log.warning("a profiler is already running in this process; this rank is not profiled")
            return
        directory = self.directory or trainer.run_dir.profile
        self.directory = directory
        activities = [torch.profiler.ProfilerActivity.CPU]
        if trainer.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=self.wait, warmup=self.warmup, active=self.active, repeat=1),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(
                str(directory), worker_name=f"rank{trainer.process_group.rank()}"
            ),
        )
        self.profiler.start()

    def on_train_batch_end(self, trainer: TrainerView, loss: float) -> None:
        if self.profiler is not None:
            self.profiler.step()

    def on_fit_end(self, trainer: TrainerView, metrics: dict[str, Any]) -> None:
        self._stop()
        if trainer.is_main and self.directory is not None:
            traces = sorted(self.directory.glob("*.pt.trace.json"))
            log.info(
                "profile: %d trace(s) in %s (tensorboard --logdir %s, or ui.perfetto.dev)",
                len(traces),
                self.directory,
                self.directory,
            )

    def on_exception(self, trainer: TrainerView, exc: BaseException) -> None:
        self._stop()

    def _stop(self) -> None:
        if self.profiler is not None:
            profiler, self.profiler = self.profiler, None
            profiler.stop()  # writes the trace if the active window was still open
