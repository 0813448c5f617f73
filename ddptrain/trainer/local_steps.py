"""Local SGD and DiLoCo as a step strategy (``dist.sync=local_sgd|diloco``): talk every H steps.

Each step is plain DDP's micro-batches with no reduction: every rank's ``.grad`` is the gradient
of its own samples, and the configured optimizer (the *inner* optimizer) steps this rank's copy
of the model. After every step whose number is a multiple of ``dist.sync_every`` (H), and after
the fit's last planned step, an outer step (:class:`ddptrain.ddp.outer.OuterSync`) brings the
copies back to one consensus in one all-reduce. The sampler still gives each rank distinct
samples, so a round of H steps covers H global batches.

What the rest of the trainer sees:

- **stop votes** ride in the outer step's all-reduce, so a signal, ``should_stop`` or
  ``trainer.max_time`` takes effect at the next outer step (between them the loop hears none);
- **evaluation, test, predict and the final checksum** use the consensus
  (:meth:`synchronized_weights`), the model every rank agrees on; mid-round it is up to H-1 steps
  old;
- **checkpoints**: the ``model`` entry is the consensus (what ``load_model`` and ``export``
  return); the ``strategy`` entry holds every rank's local weights and inner-optimizer state, and
  DiLoCo's outer momentum, so a resume in the middle of a round continues bit for bit. It is
  written for the same world size only;
- a fit that ends early for ``should_stop`` ends with an outer step over the steps since the last
  one (:meth:`end_fit`); a stop for a signal, ``max_time`` or ``stop_after_steps`` does not, so
  that its resume continues the round exactly.

What cannot be combined with it is refused before any process starts, by its mode's rules
(``LOCAL_STEPS`` in :mod:`ddptrain.modes.builtin`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_map

from ..comm.objects import all_gather_object
from ..config import ConfigError
from ..ddp.comm_hooks import COMPRESSIONS
from ..ddp.outer import OuterSync
from .steps import MicroBatchSteps, accumulate_micro_batches
from .stopping import NUM_VOTES
from .view import LoopView

__all__ = ["LocalSteps"]


class LocalSteps(MicroBatchSteps):
    """Local steps and an outer step every ``dist.sync_every`` steps (see the module docstring)."""

    def __init__(self, trainer: LoopView, votes: Callable[[], list[float]]):
        super().__init__(trainer, votes)
        dist = trainer.config.dist
        comm_dtype = COMPRESSIONS[dist.grad_compression][0] if dist.grad_compression != "none" else None
        self.outer = OuterSync(
            trainer.model.module,
            trainer.process_group,
            dist.sync,
            dist.outer_lr,
            dist.outer_momentum,
            comm_dtype,
            dist.algorithm,
        )
        self.every = dist.sync_every
        self.synced_step = trainer.state.step  # the step of the last outer step (checkpointed)
        self._votes: list[float] | None = None

    def forward_backward(self, micro_batches: Sequence[Any]) -> float:
        return accumulate_micro_batches(self.trainer, micro_batches, reduce=False)

    def optimizer_step(self) -> None:
        """The inner step on this rank's own gradient, then the outer step when one is due."""
        super().optimizer_step()
        step = self.trainer.state.step + 1  # the step being completed
        if step % self.every == 0 or step == self.trainer.total_steps:
            self._votes = self.outer.step(self.votes())
            self.synced_step = step
        else:
            self._votes = [0.0] * NUM_VOTES  # nobody is heard between outer steps

    def take_votes(self) -> list[float] | None:
        votes, self._votes = self._votes, None
        return votes

    def end_fit(self) -> bool:
        """An outer step over the steps since the last one, if any (collective). True if it ran."""
        if self.trainer.state.step == self.synced_step:
            return False  # the last step had its outer step: another would move the model (momentum)
        self.outer.step()
        self.synced_step = self.trainer.state.step
        return True

    @contextlib.contextmanager
    def synchronized_weights(self) -> Iterator[None]:
        with self.outer.consensus_in():
            yield

    def model_state_dict(self, model: Any) -> dict[str, Any]:
        with self.outer.consensus_in():
            return {name: tensor.clone() for name, tensor in model.state_dict().items()}

    def state_dict(self) -> dict[str, Any]:
        """Every rank's local weights and inner-optimizer state, and the outer optimizer's (collective)."""
        mine = {"weights": self.outer.local_weights(), "optimizer": self.trainer.optimizer_set.state_dict()}
        ranks = all_gather_object(self.trainer.process_group, tree_map(_to_cpu, mine))
        return {
            "sync": self.trainer.config.dist.sync,
            "synced_step": self.synced_step,
            "ranks": ranks,
            **self.outer.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        dist, rank = self.trainer.config.dist, self.trainer.rank
        world_size = self.trainer.world_size
        if not state:  # a checkpoint of dist.sync=every_step: its model starts the first round
            self.outer.resume()
            return
        if state.get("sync") != dist.sync:
            written = state.get("sync")
            raise ConfigError(
                f"the checkpoint was written with dist.sync={written} and this run has dist.sync={dist.sync}: "
                f"an outer round's state cannot change its rule; resume with dist.sync={written}"
            )
        ranks = state["ranks"]
        if len(ranks) != world_size:
            raise ConfigError(
                f"the checkpoint holds the local models of {len(ranks)} rank(s) (dist.sync={dist.sync} keeps one "
                f"per rank between outer steps) and this job has {world_size}: resume with dist.world_size={len(ranks)}"
            )
        self.outer.resume(ranks[rank]["weights"])  # the model entry (the consensus) is already loaded
        self.trainer.optimizer_set.load_state_dict(ranks[rank]["optimizer"])
        self.outer.load_state_dict(state)
        self.synced_step = state["synced_step"]


def _to_cpu(value: Any) -> Any:
    return value.detach().cpu() if isinstance(value, torch.Tensor) else value
