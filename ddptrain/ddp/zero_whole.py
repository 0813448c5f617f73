"""ZeRO stage 1 where every rank already holds the whole gradient: world-size-invariant mode's.

Invariant mode (``ddptrain.trainer.invariant``) sums each step's gradients exactly, outside DDP's
buckets, and every rank ends with the whole sum in ``.grad``. :class:`WholeGradientZero` then
shards only the optimizer: the trained parameters, concatenated in the optimizer's group order, are
cut into ``W`` contiguous ranges (``torch.tensor_split``'s sizes); rank ``r`` steps range ``r``
with a second optimizer of the wrapped one's class, over views of the parameters, and every rank's
range is all-gathered into the parameters. Each rank holds ``1/W`` of the optimizer state.

**Bitwise.** An element-wise optimizer (:func:`.zero.check_elementwise`) updates each element from
its own gradient and state, so the parameters are those of the unsharded step bit for bit, at any
``W``: invariant mode's promise holds with the state sharded, and a checkpoint resumes at any
world size, sharded or not.

**Checkpoints** take the formats of :class:`.zero.ZeroOptimizer`: :meth:`shard_state_dict` (this
rank's pieces, ``{"params": {k: {"lo", "hi", "shape", "state"}}}``) and :meth:`state_dict` (the
consolidated torch format, collective). To load the consolidated format of any world size, ZeRO or
not: the wrapped optimizer's own ``load_state_dict``, then :meth:`shard_loaded_state`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import increment_version

from ..comm.objects import all_gather_object
from ..comm.process_group import ProcessGroup
from .zero import check_elementwise, consolidate_shards, hyper_parameters, is_per_element, optimizer_like

__all__ = ["WholeGradientZero"]


@dataclass(frozen=True)
class _Piece:
    """Elements ``[lo, hi)`` of parameter ``index`` (flat), stepped through ``view``."""

    index: int
    group: int
    lo: int
    hi: int
    view: torch.Tensor


class WholeGradientZero:
    """See the module docstring.

    Args:
        optimizer: built over the parameters to train, not stepped yet; it keeps the groups (what
            schedulers change) and no state.
        group: the ranks that share the optimizer state.

    Raises:
        ValueError: an optimizer that couples elements, one that has stepped, or parameters of
            more than one dtype or device.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, group: ProcessGroup):
        check_elementwise(type(optimizer))
        if optimizer.state:
            raise ValueError("WholeGradientZero needs an optimizer that has not stepped yet (its state would be lost)")
        self.optimizer, self.group = optimizer, group
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        kinds = {(p.dtype, p.device) for p in self.params}
        if len(kinds) > 1:
            raise ValueError(
                f"ZeRO in world-size-invariant mode gathers the parameters in one buffer, and they come in "
                f"{len(kinds)} dtypes or devices ({sorted(str(k) for k in kinds)}): give them one, or train "
                "with dist.zero_stage=0"
            )
        rank, world_size = group.rank(), group.size()
        total = sum(p.numel() for p in self.params)
        base, extra = divmod(total, world_size)
        self.ranges = [(r * base + min(r, extra), (r + 1) * base + min(r + 1, extra)) for r in range(world_size)]
        """``[start, stop)`` of the concatenated parameters each rank steps."""
        start, stop = self.ranges[rank]
        self._offsets: list[int] = []  # of each parameter in the concatenation
        self.pieces: list[_Piece] = []
        offset = 0
        for g, param_group in enumerate(optimizer.param_groups):
            for p in param_group["params"]:
                lo, hi = max(offset, start) - offset, min(offset + p.numel(), stop) - offset
                if lo < hi:  # a view: the optimizer updates the parameter where it lies
                    self.pieces.append(_Piece(len(self._offsets), g, lo, hi, p.detach().view(-1)[lo:hi]))
                self._offsets.append(offset)
                offset += p.numel()
        groups = [
            {**hyper_parameters(param_group), "params": [piece.view for piece in self.pieces if piece.group == g]}
            for g, param_group in enumerate(optimizer.param_groups)
        ]
        self._groups_used = [g for g, entry in enumerate(groups) if entry["params"]]
        self._shard_optimizer = (
            optimizer_like(optimizer, [groups[g] for g in self._groups_used]) if self.pieces else None
        )
        longest = max(stop - start for start, stop in self.ranges)
        dtype, device = next(iter(kinds)) if kinds else (torch.float32, torch.device("cpu"))
        self._chunks = [torch.empty(longest, dtype=dtype, device=device) for _ in range(world_size)]

    # -- the step --------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> None:
        """Step this rank's range with the parameters' ``.grad`` (a parameter without one is
        skipped, as the unsharded optimizer skips it), then all-gather every range into the
        parameters. Collective. The wrapped optimizer steps with no gradient: its hooks and a
        scheduler's bookkeeping see the step."""
        if self._shard_optimizer is not None:
            for piece in self.pieces:
                grad = self.params[piece.index].grad
                piece.view.grad = None if grad is None else grad.view(-1)[piece.lo : piece.hi]
            for shard_group, g in zip(self._shard_optimizer.param_groups, self._groups_used):
                shard_group.update(hyper_parameters(self.optimizer.param_groups[g]))
            self._shard_optimizer.step()
            for piece in self.pieces:
                piece.view.grad = None
        for p in self.params:
            p.grad = None
        self.optimizer.step()
        self._all_gather()

    def _all_gather(self) -> None:
        rank = self.group.rank()
        start = self.ranges[rank][0]
        mine = self._chunks[rank]
        for piece in self.pieces:
            at = self._offsets[piece.index] + piece.lo - start
            mine[at : at + piece.hi - piece.lo].copy_(piece.view)
        self.group.all_gather(self._chunks, mine.clone()).wait()
        for p, offset in zip(self.params, self._offsets):
            flat = p.detach().view(-1)
            for r, (lo, hi) in enumerate(self.ranges):
                a, b = max(offset, lo), min(offset + p.numel(), hi)
                if a < b and r != rank:
                    flat[a - offset : b - offset].copy_(self._chunks[r][a - lo : b - lo])
            increment_version(p)  # written through views: as an in-place step would, on every rank

    # -- checkpoints -----------------------------------------------------------------------------
    def shard_state_dict(self) -> dict[str, Any]:
        """This rank's share of the optimizer state, in :meth:`.zero.ZeroOptimizer.shard_state_dict`'s format."""
        states = {} if self._shard_optimizer is None else self._shard_optimizer.state
        params = {}
        for piece in self.pieces:
            state = states.get(piece.view)
            if state:  # never stepped: nothing to save, as torch's own state_dict
                params[piece.index] = {
                    "lo": piece.lo,
                    "hi": piece.hi,
                    "shape": list(self.params[piece.index].shape),
                    "state": {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in state.items()},
                }
        return {"params": params}

    def state_dict(self) -> dict[str, Any]:
        """The consolidated state, in the wrapped optimizer's ``state_dict`` format. Collective."""
        shards = all_gather_object(self.group, self.shard_state_dict())
        return consolidate_shards({"param_groups": self.optimizer.state_dict()["param_groups"]}, shards)

    def shard_loaded_state(self) -> None:
        """Move the state the wrapped optimizer holds (after its own ``load_state_dict``) into this
        rank's pieces, and drop it from the wrapped optimizer."""
        full = {id(p): state for p, state in self.optimizer.state.items()}
        self.optimizer.state.clear()
        if self._shard_optimizer is None:
            return
        self._shard_optimizer.state.clear()
        for piece in self.pieces:
            state = full.get(id(self.params[piece.index]))
            if not state:
                continue
            sliced = {
                k: v.reshape(-1)[piece.lo : piece.hi].clone() if is_per_element(v) else _copy(v)
                for k, v in state.items()
            }
            self._shard_optimizer.state[piece.view] = sliced

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds."""
        states = {} if self._shard_optimizer is None else self._shard_optimizer.state
        return sum(v.numel() * v.element_size() for s in states.values() for v in s.values() if torch.is_tensor(v))


def _copy(value: Any) -> Any:
    return value.clone() if torch.is_tensor(value) else value
