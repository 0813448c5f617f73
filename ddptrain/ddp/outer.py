"""Outer steps: where the ranks' copies of a model meet under local SGD and DiLoCo.

Between outer steps every rank trains its own copy of the model on its own samples, with no
communication. An outer step then brings the copies back to one model, the *consensus*:

- every rank computes its pseudo-gradient ``delta = consensus - local`` for each parameter and each
  floating-point buffer (BatchNorm's running statistics), and the ranks average it in one
  all-reduce (summed, then divided by the world size);
- ``local_sgd``: ``consensus -= mean(delta)``, i.e. the average of the local copies;
- ``diloco`` (Douillard et al., 2023, "DiLoCo: Distributed Low-Communication Training of Language
  Models"): the parameters' mean pseudo-gradient is the gradient of an outer SGD with Nesterov
  momentum, ``torch.optim.SGD(lr=outer_lr, momentum=outer_momentum, nesterov=True)`` over the
  consensus; buffers are averaged as in ``local_sgd``;
- every rank's copy is set to the new consensus.

Invariant: after an outer step every rank holds the same consensus, bit for bit (an all-reduce
leaves the same sum on every rank and the rest is the same arithmetic everywhere), and its model
equals it. Integer buffers (BatchNorm's ``num_batches_tracked``) are not exchanged: every rank
counts the same batches.

Sending ``delta`` rather than the weights keeps compression harmless: ``comm_dtype`` (bf16, fp16)
rounds the change of one round, not the weights themselves.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..comm.process_group import ProcessGroup
from ..comm.ring import ring_all_reduce
from ..comm.types import ReduceOp
from .swap import swapped_in

__all__ = ["OuterSync", "SYNC_MODES"]

SYNC_MODES = ("local_sgd", "diloco")


class OuterSync:
    """The consensus of ``module`` over ``process_group``'s ranks and the outer step that moves it.

    Args:
        module: the model every rank trains (the bare module, not a DDP wrapper). Its current
            weights become the first consensus: they must be the same on every rank (DDP's
            construction broadcasts rank 0's).
        process_group: the ranks whose copies meet.
        mode: ``local_sgd`` (average the copies) or ``diloco`` (an outer Nesterov step).
        outer_lr, outer_momentum: ``diloco``'s outer SGD.
        comm_dtype: the dtype the pseudo-gradients travel in (``None``: float32).
        algorithm: the all-reduce: ``native`` (the backend's) or ``ring`` (:mod:`ddptrain.comm.ring`).
    """

    def __init__(
        self,
        module: nn.Module,
        process_group: ProcessGroup,
        mode: str,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        comm_dtype: torch.dtype | None = None,
        algorithm: str = "native",
    ):
        if mode not in SYNC_MODES:
            raise ValueError(f"outer step mode {mode!r} is not one of {SYNC_MODES}")
        self.process_group, self.mode, self.comm_dtype, self.algorithm = process_group, mode, comm_dtype, algorithm
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.buffers = [b for b in module.buffers() if b.is_floating_point()]
        with torch.no_grad():
            self.consensus = [t.detach().clone() for t in self.live]
        self.outer_optimizer: torch.optim.SGD | None = None
        if mode == "diloco":
            outer_params = self.consensus[: len(self.params)]
            self.outer_optimizer = torch.optim.SGD(outer_params, lr=outer_lr, momentum=outer_momentum, nesterov=True)

    @property
    def live(self) -> list[torch.Tensor]:
        """The tensors this rank trains, parameters then floating-point buffers (the consensus's order)."""
        return [*self.params, *self.buffers]

    def step(self, extra: Sequence[float] = ()) -> list[float]:
        """The outer step (collective: one all-reduce of every parameter and floating buffer, plus
        ``extra``). Returns ``extra`` summed over the ranks (the trainer's stop votes ride here)."""
        live, world = self.live, self.process_group.size()
        with torch.no_grad():
            deltas = torch._foreach_sub(self.consensus, live)
            flat = torch.cat([d.reshape(-1).float() for d in deltas] + [torch.tensor(list(extra), dtype=torch.float32)])
            wire = flat if self.comm_dtype is None else flat.to(self.comm_dtype)
            self.process_group.label_next_collective(f"{self.mode} outer step")
            if self.algorithm == "ring":
                ring_all_reduce(self.process_group, wire, ReduceOp.SUM)
            else:
                self.process_group.all_reduce(wire, ReduceOp.SUM).wait()
            summed = wire.float()
            sizes = [d.numel() for d in deltas]
            chunks = summed[: sum(sizes)].split(sizes)
            means = [chunk.view_as(d).to(d.dtype) / world for chunk, d in zip(chunks, deltas)]
            n = len(self.params)
            if self.outer_optimizer is not None:
                for outer, grad in zip(self.consensus[:n], means[:n]):
                    outer.grad = grad
                self.outer_optimizer.step()
                for outer in self.consensus[:n]:
                    outer.grad = None
            else:
                torch._foreach_sub_(self.consensus[:n], means[:n])
            if self.buffers:
                torch._foreach_sub_(self.consensus[n:], means[n:])
            torch._foreach_copy_(live, self.consensus)
            return summed[sum(sizes) :].tolist()

    def consensus_in(self) -> contextlib.AbstractContextManager:
        """The consensus in the module for the block (identical on every rank), this rank's local
        copy back afterwards, bit for bit."""
        return swapped_in(self.live, self.consensus)

    def local_weights(self) -> list[torch.Tensor]:
        """Copies of this rank's local tensors (the :attr:`live` order), for a checkpoint."""
        return [t.detach().clone() for t in self.live]

    def resume(self, local: Sequence[torch.Tensor] | None = None) -> None:
        """After a checkpoint's ``model`` entry (the consensus) was loaded into the module: take the
        consensus from it, then put this rank's ``local`` tensors (:meth:`local_weights`) in
        (``None``: the copy starts at the consensus, a new round)."""
        live = self.live
        if local is not None and (len(local) != len(live) or any(a.shape != b.shape for a, b in zip(local, live))):
            raise ValueError(
                "the checkpoint's local weights do not fit this model: resume with the model that wrote it"
            )
        with torch.no_grad():
            torch._foreach_copy_(self.consensus, live)
            if local is not None:
                torch._foreach_copy_(live, [t.to(b.device, b.dtype) for t, b in zip(local, live)])

    def state_dict(self) -> dict[str, Any]:
        """The outer optimizer's state (``diloco``; the same on every rank), or nothing."""
        return {} if self.outer_optimizer is None else {"outer_optimizer": self.outer_optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.outer_optimizer is not None and state.get("outer_optimizer"):
            self.outer_optimizer.load_state_dict(state["outer_optimizer"])
