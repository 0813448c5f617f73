"""Checkpoints written in the background (``trainer.checkpoint.async_save=true``).

The step that checkpoints copies the state to host memory (:func:`host_snapshot`: pinned buffers
for CUDA tensors) and hands the copy to one writer thread (:class:`BackgroundWriter`); training
goes on while the thread serializes, hashes and writes it. At most one save is in flight: the
next one waits for it first, and says so in the log when it had to wait. The file appears under
its final name only when whole (:func:`.files.save_checkpoint` writes a temporary file and
renames it), so a process killed mid-write leaves the previous checkpoint as the latest.

A failed background write surfaces at the next save, or at :meth:`BackgroundWriter.wait`, which
the fit calls before it ends, stops for a signal, or rebuilds for a new group: as a
:class:`~ddptrain.errors.CheckpointError` naming the file and the cause.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_map

from ...errors import CheckpointError

__all__ = ["BackgroundWriter", "host_snapshot"]

log = logging.getLogger("ddptrain.trainer")

WAIT_NOTED_S = 0.05
"""A save that waited longer than this for the previous one says so in the log."""


def host_snapshot(state: Any) -> Any:
    """``state`` with every tensor copied to host memory (pinned for CUDA tensors, so the copy is
    asynchronous until the one synchronisation at the end): what the state was at this step,
    whatever training does to the live tensors afterwards. Containers are rebuilt; other values
    are shared (they are immutable, or rebuilt by each ``state_dict``)."""
    cuda = False

    def copy(value: Any) -> Any:
        nonlocal cuda
        if not isinstance(value, torch.Tensor):
            return value
        value = value.detach()
        if value.device.type == "cuda":
            cuda = True
            host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            return host.copy_(value, non_blocking=True)
        return value.clone()

    snapshot = tree_map(copy, state)
    if cuda:
        torch.cuda.synchronize()  # every pinned copy has landed before the writer reads it
    return snapshot


class BackgroundWriter:
    """One thread that runs one write at a time; see the module docstring."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._what = ""
        self._error: BaseException | None = None

    def submit(self, what: str, write: Callable[[], None]) -> float:
        """Run ``write()`` in the writer thread once the previous write is done; the seconds this
        call waited for it. ``what`` names the write in errors and log lines.

        Raises:
            CheckpointError: the previous write failed (this one is not started).
        """
        waited = self.wait()
        if waited > WAIT_NOTED_S:
            log.info("checkpoint: %s waited %.2f s for the previous background save to finish", what, waited)
        self._what = what
        # Not a daemon: an interpreter that exits while a checkpoint is being written waits for it.
        self._thread = threading.Thread(target=self._run, args=(write,), name="ddptrain-checkpoint-writer")
        self._thread.start()
        return waited

    def _run(self, write: Callable[[], None]) -> None:
        try:
            write()
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread at the next wait
            self._error = exc

    def wait(self) -> float:
        """Wait for the write in flight, if any; the seconds waited.

        Raises:
            CheckpointError: that write failed, naming it and the cause.
        """
        if self._thread is None:
            return 0.0
        started = time.perf_counter()
        self._thread.join()
        self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise CheckpointError(f"the background save of {self._what} failed: {error}") from error
        return time.perf_counter() - started
