"""Numerical precision of a fit: ``trainer.precision`` = ``32`` | ``bf16-mixed`` | ``16-mixed``.

- ``32``: everything in float32 (the default).
- ``bf16-mixed``: forward passes (``training_step``, ``validation_step``) under
  ``torch.autocast(dtype=torch.bfloat16)``, on CPU and CUDA. Parameters, gradients and optimizer
  states stay float32, so our DDP and its comm hooks all-reduce float32 gradients as before;
  bfloat16 has float32's range, so no loss scaling is needed.
- ``16-mixed``: float16 autocast, CUDA only, with a ``torch.amp.GradScaler``: the loss is scaled
  before backward, gradients are unscaled before clipping, an optimizer step whose gradients hold
  inf/NaN is skipped and the scale adapted. The scaler's state travels in checkpoints
  (``grad_scaler``), so a resume continues with the same scale.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from ..config import PRECISIONS, check_precision

__all__ = ["PRECISIONS", "Precision"]


class Precision:
    """Autocast, loss scaling and the scaler's checkpoint state for one fit.

    Args:
        precision: ``32``, ``bf16-mixed`` or ``16-mixed``.
        device: the rank's device.
    """

    def __init__(self, precision: str, device: torch.device):
        self.name = check_precision(precision, device.type)
        self.device_type = device.type
        self.dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(self.name)
        self.scaler = torch.amp.GradScaler(device.type) if self.name == "16-mixed" else None

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context to run forward passes in."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor, scale: float | None = None) -> None:
        """Backward of ``loss`` (times ``scale``, when given: as ``(loss * scale).backward()``,
        without the extra multiplication in the graph).

        Raises:
            RuntimeError: ``loss`` is not one number (a per-sample loss, say), with the fix.
        """
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            tensor = isinstance(loss, torch.Tensor)
            got = f"a tensor of shape {tuple(loss.shape)}" if tensor else f"a {type(loss).__name__}"
            raise RuntimeError(
                f"training_step must return the loss as one number (a tensor with a graph), got {got}: "
                "reduce it over the batch, e.g. loss.mean() (or F.cross_entropy(..., reduction='mean'), "
                "the default); ddptrain averages it over ranks and micro-batches itself"
            )
        loss = loss if self.scaler is None else self.scaler.scale(loss)
        loss.backward(None if scale is None else torch.full_like(loss, scale))

    def unscale(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """True gradients before clipping (16-mixed); nothing otherwise."""
        if self.scaler is not None:
            for optimizer in optimizers:
                self.scaler.unscale_(optimizer)

    def update(self) -> None:
        """After the optimizers stepped (through ``scaler``): adapt the scale."""
        if self.scaler is not None:
            self.scaler.update()

    def state_dict(self) -> dict[str, Any] | None:
        """The checkpoint's ``grad_scaler`` entry (None without a scaler)."""
        return None if self.scaler is None else self.scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
