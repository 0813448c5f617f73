"""An exponential moving average of the weights (``trainer.ema.*``), kept beside the training.

After each optimizer step (every ``every_n_steps`` from ``start_step``) every rank updates its copy
with torch's EMA rule, ``ema = ema + (1 - decay) * (w - ema)`` (``torch.optim.swa_utils.
get_ema_multi_avg_fn``: ``torch._foreach_lerp_``); the first update copies the weights. With
``warmup`` the decay of the n-th update is ``min(decay, (1 + n) / (10 + n))`` (timm's and
TensorFlow's ramp), so the first weights of a short run fade out of its average.

What is averaged: the parameters, identical on every rank after each step (so are their averages),
and the floating-point buffers (BatchNorm's running statistics, each rank's own between the
broadcasts; an evaluation takes rank 0's, as it does for the trained model). Other buffers
(``num_batches_tracked``) are the module's own. A checkpoint's ``ema`` entry is a whole state dict
of the module, so it loads like its ``model`` entry (``ddptrain.load_model(run, ema=True)``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..config import EmaConfig
from ..ddp.swap import swapped_in

__all__ = ["EmaWeights"]


class EmaWeights:
    """The moving average of ``module``'s parameters and floating-point buffers.

    Args:
        module: the bare module being trained (``trainer.model.module``).
        config: ``trainer.ema`` (its ``decay`` must be set).
    """

    def __init__(self, module: nn.Module, config: EmaConfig):
        self.module, self.config = module, config
        named = [*module.named_parameters(), *((n, b) for n, b in module.named_buffers() if b.is_floating_point())]
        self.names = [name for name, _ in named]
        self.averages: list[torch.Tensor] | None = None  # one per averaged tensor, after the first update
        self.updates = 0

    def _tensors(self) -> list[torch.Tensor]:
        """The module's averaged tensors now, in ``names`` order (buffers may be replaced by the module)."""
        params = [p.detach() for p in self.module.parameters()]
        return params + [b for b in self.module.buffers() if b.is_floating_point()]

    def decay(self) -> float:
        """The decay of the next update."""
        c, n = self.config, self.updates
        return min(c.decay, (1 + n) / (10 + n)) if c.warmup else c.decay

    def update(self, step: int) -> None:
        """Fold the weights into the average after optimizer step ``step`` (1 = the first), if due."""
        c = self.config
        if step <= c.start_step or (step - c.start_step) % c.every_n_steps:
            return
        with torch.no_grad():
            if self.averages is None:
                self.averages = [t.clone() for t in self._tensors()]
            else:
                torch._foreach_lerp_(self.averages, self._tensors(), 1.0 - self.decay())
        self.updates += 1

    def weights(self) -> dict[str, torch.Tensor]:
        """A state dict of the module with the averages in place of what they average (the module's
        own tensors before the first update)."""
        state = dict(self.module.state_dict())
        if self.averages is not None:
            state.update(zip(self.names, self.averages))
        return state

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The averages in the module for the block (``trainer.ema.evaluate``), the trained
        tensors back afterwards, bit for bit."""
        if self.averages is None:
            yield
            return
        with swapped_in(self._tensors(), self.averages):
            yield

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint's ``ema`` entry: ``decay``, ``updates`` and ``weights`` (:meth:`weights`)."""
        return {"decay": self.config.decay, "updates": self.updates, "weights": self.weights()}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore :meth:`state_dict`; a checkpoint without an average starts one at the next due step."""
        if not state or not state.get("updates"):
            self.averages, self.updates = None, 0
            return
        weights = state["weights"]
        self.averages = [weights[name].detach().clone().to(t.device) for name, t in zip(self.names, self._tensors())]
        self.updates = int(state["updates"])
