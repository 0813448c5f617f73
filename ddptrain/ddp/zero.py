"""ZeRO stages 1 and 2 in our DDP: each rank keeps the optimizer state of one shard of every bucket.

Usage (every rank; ``optimizer`` is built over the model's parameters as usual)::

    ddp = DistributedDataParallel(model)
    zero = ZeroOptimizer(ddp, torch.optim.AdamW(model.parameters(), lr=1e-3), stage=2)
    for batch in data:
        loss_fn(ddp(batch)).backward()   # buckets are reduce-scattered while backward runs
        zero.clip_grad_norm_(1.0)        # optional: the global norm over every rank's shard
        zero.step()                      # steps this rank's shards, then all-gathers the parameters
        zero.zero_grad()

How one step goes:

1. **Backward.** Each bucket's flat buffer is split into ``W`` contiguous chunks
   (:class:`~.shards.ShardLayout`); the bucket is divided by ``W`` and *reduce-scattered*, so this
   rank ends with the averaged gradients of its own chunk only (``ddp.reducer.shard_grads``).
   Parameters' ``.grad`` is ``None`` afterwards, at both stages. Stage 1 keeps the buckets' flat
   gradient buffers allocated between steps (one full-size gradient, as plain DDP), and its shard
   is a view of each buffer's owned chunk (no copy); stage 2 copies the chunk out and gives each
   bucket's buffer back to the two it reuses (double buffering, as DeepSpeed's reduce buckets), so
   after backward a rank holds its shard's gradient elements and two buckets' worth of scratch:
   less than one full gradient once the model spans more than a few buckets
   (``bucket_cap_mb`` sets it).
2. **Step.** The elements of a parameter that lie in this rank's chunk are one contiguous slice of
   it; a second instance of the optimizer's own class, with the same hyper-parameters
   (``foreach``/``fused`` included: the same implementation), steps those slices — views of the
   parameters, each in its parameter's group, with views of the averaged chunk as gradients — so
   its state (momentum, Adam's moments) is ``1/W`` of the full state and nothing is copied. Before
   every step the groups' hyper-parameters are copied from the wrapped optimizer, so
   learning-rate schedulers attached to it keep working; the wrapped optimizer's own ``step()``
   then runs with every ``.grad`` ``None`` (nothing to update: its step hooks and a scheduler's
   bookkeeping see the step).
3. **All-gather.** Bucket by bucket, the updated chunks travel to every rank, in place: under
   ZeRO each parameter is a view of a flat *parameter* buffer per bucket, laid out as the bucket's
   gradients are (:attr:`ZeroOptimizer.param_buffers`), so the chunk a rank stepped is already in
   the buffer it sends and what it receives lands in the parameters. Wrapping moves the
   parameters there (``param.data`` is re-pointed; the ``Parameter`` objects stay, so references to
   them, the wrapped optimizer's included, keep working). A parameter re-pointed elsewhere later
   (``param.data = t``, as ``module._apply`` does) is copied back in and re-pointed at the next
   step: the values a user set are stepped and gathered, never silently left out.

**Bitwise.** With ``algorithm="ring"`` the reduce-scatter is the first half of the ring all-reduce
that DDP's ``dist.algorithm=ring`` uses, on the same chunks, so every element gets the same
average, and an element-wise optimizer gives it the same update: the parameters equal plain DDP's
bit for bit. With ``algorithm="native"`` (the backend's ``reduce_scatter``/``all_gather``) that
holds where the backend's reduction order matches its all-reduce's (W=2: one addition).
Gradient clipping computes the norm from shards (a different summation order): within 1e-6
relative of plain DDP's (tested), not bitwise.

**Optimizers** must update each element from that element alone: SGD, Adam, AdamW, RMSprop,
Adagrad, Adamax, NAdam, RAdam, ASGD are known to; your own optimizer declares it with a class
attribute ``elementwise = True``. Others (LBFGS, or anything that reads a whole tensor, e.g.
its norm) are refused. Every trainable parameter must get a gradient in every synchronised
backward (``find_unused_parameters`` is refused).

**Checkpoints.** :meth:`ZeroOptimizer.state_dict` is *consolidated*: the wrapped optimizer's own
``state_dict`` format (per parameter, full size), loadable by plain DDP's optimizer or by a
ZeroOptimizer at any world size; gathering it materialises the full state on every rank for the
duration of the call. :meth:`ZeroOptimizer.load_state_dict` takes that format and keeps only
this rank's shards. Both are collective. :meth:`ZeroOptimizer.shard_state_dict` is the sharded
alternative: this rank's pieces only, with no collective and no full-size copy;
:func:`consolidate_shards` puts every rank's pieces back into the consolidated format.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import increment_version

from ..comm.objects import all_gather_object
from ..comm.types import ReduceOp
from .module import DistributedDataParallel
from .shards import ALGORITHMS, ShardComm

__all__ = ["ZeroOptimizer", "ELEMENTWISE_OPTIMIZERS", "check_elementwise", "consolidate_shards", "is_per_element"]

ELEMENTWISE_OPTIMIZERS = ("SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adamax", "NAdam", "RAdam", "ASGD")


def check_elementwise(optimizer_class: type) -> None:
    """Refuse an optimizer class whose update may couple elements (ZeRO steps shards of tensors).

    Raises:
        ValueError: naming the class, why, and how to proceed.
    """
    name = optimizer_class.__name__
    known = optimizer_class.__module__.startswith("torch.optim") and name in ELEMENTWISE_OPTIMIZERS
    if known or getattr(optimizer_class, "elementwise", False) is True:
        return
    raise ValueError(
        f"ZeRO cannot shard the optimizer {name}: each rank steps only a slice of every tensor, which "
        "is right only for optimizers that update each element from that element's own gradient and "
        f"state, and {name} is not known to (LBFGS, for one, uses whole-tensor dot products). Use one "
        f"of torch.optim's {', '.join(ELEMENTWISE_OPTIMIZERS)}, declare your own optimizer with the "
        "class attribute `elementwise = True` if it is, or train without ZeRO (dist.zero_stage=0)."
    )


@dataclass(frozen=True)
class _Piece:
    """Elements ``[lo, hi)`` of parameter ``param`` (flat), at ``[chunk_lo, chunk_hi)`` of its bucket's chunk."""

    param: int
    lo: int
    hi: int
    chunk_lo: int

    @property
    def size(self) -> int:
        return self.hi - self.lo


@dataclass
class _Shard:
    """One tensor the shards' optimizer steps: a view of the elements of one parameter that lie in
    this rank's chunk of their bucket (``pieces`` holds that one piece)."""

    bucket: int
    group: int
    pieces: list[_Piece]
    tensor: torch.Tensor


class ZeroOptimizer:
    """Steps ``optimizer`` on this rank's shards of ``model``'s gradient buckets (see the module doc).

    Args:
        model: our :class:`~.module.DistributedDataParallel`, before its first backward; from now on
            its buckets are reduce-scattered.
        optimizer: a torch optimizer over (some of) ``model``'s trainable parameters, not yet
            stepped. It keeps its ``param_groups`` (schedulers may change them) but never holds
            state: the shards' optimizer does.
        stage: 1 (optimizer state sharded) or 2 (gradients too; see the module doc).
        algorithm: ``"native"`` (the backend's reduce-scatter and all-gather) or ``"ring"``
            (ddptrain's ring: bitwise equal to DDP with ``dist.algorithm=ring``).
        reduce_dtype: ``torch.bfloat16`` or ``torch.float16`` to send the gradients in half
            precision (half the reduce-scatter's bytes), as DDP's ``bf16_compress_hook`` and
            ``fp16_compress_hook`` do for its all-reduce; ``None`` (default): their own dtype.
            The parameters' all-gather always travels in full precision.

    Raises:
        ValueError: an optimizer that is not element-wise, a parameter the model does not train,
            a stage or algorithm that does not exist.
    """

    def __init__(
        self,
        model: DistributedDataParallel,
        optimizer: torch.optim.Optimizer,
        stage: int = 1,
        algorithm: str = "native",
        reduce_dtype: torch.dtype | None = None,
    ):
        if stage not in (1, 2):
            raise ValueError(f"ZeRO stage must be 1 or 2, got {stage} (0 is plain DDP: don't wrap the optimizer)")
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown ZeRO algorithm {algorithm!r}; choose one of {ALGORITHMS}")
        check_elementwise(type(optimizer))
        if optimizer.state:
            raise ValueError(
                "ZeroOptimizer needs an optimizer that has not stepped yet (its state would be lost); "
                "wrap it right after building it and restore checkpoints with ZeroOptimizer.load_state_dict"
            )
        self.model, self.optimizer, self.stage = model, optimizer, stage
        self.reducer = model.reducer
        self.process_group = model.process_group
        self._index = {id(p): i for i, p in enumerate(self.reducer.params)}
        self._group_of: dict[int, int] = {}
        for g, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if id(p) not in self._index:
                    raise ValueError(
                        f"a parameter of the optimizer's group {g} (shape {tuple(p.shape)}) is not one that "
                        "the DDP model trains (frozen, or of another module): ZeRO shards only the "
                        "model's gradient buckets. Build the optimizer over model.parameters() that require grad."
                    )
                self._group_of[self._index[id(p)]] = g
        self.reducer.shard_gradients(ShardComm(self.process_group, algorithm, reduce_dtype), stage)
        self._shards: list[_Shard] = []
        self._shard_optimizer: torch.optim.Optimizer | None = None
        self._layout_version = -1
        self._buckets: tuple = ()  # the reducer's buckets and shard layouts the shards were built for
        self._layouts: list = []
        self.param_buffers: list[torch.Tensor] = []  # per bucket: the flat buffer its parameters are views of
        self._slots: list[tuple[torch.Tensor, torch.Tensor]] = []  # (parameter, its view of its buffer)
        self._grads_of_iteration = -1  # the synchronised backward whose gradients the shard tensors hold
        self._consumed_iteration = -1  # the latest one a step (or zero_grad) used up
        self._build()

    # -- layout ------------------------------------------------------------------------------
    def _build(self) -> None:
        """Shard tensors and their optimizer for the reducer's current bucket layout (no state)."""
        reducer = self.reducer
        self._buckets, self._layouts = reducer.plan.buckets, list(reducer.shard_layouts)
        self.param_buffers, self._slots = [], []
        for bucket, layout in zip(self._buckets, self._layouts):
            flat = torch.empty(layout.padded_numel, dtype=bucket.dtype, device=bucket.device)
            flat[layout.numel :].zero_()  # padding: sent by the chunk it falls in, never read
            self.param_buffers.append(flat)
            for i, offset in zip(bucket.params, bucket.offsets):  # bucket by bucket: old storage freed as it goes
                param = reducer.params[i]
                slot = flat[offset : offset + param.numel()].view_as(param)
                _adopt(param, slot)
                self._slots.append((param, slot))
        shards = []
        for b, (bucket, layout) in enumerate(zip(self._buckets, self._layouts)):
            by_group: dict[int, list[_Piece]] = {}
            for i, offset in zip(bucket.params, bucket.offsets):
                lo, hi = max(offset, layout.start), min(offset + reducer.params[i].numel(), layout.stop)
                if lo < hi and i in self._group_of:
                    piece = _Piece(i, lo - offset, hi - offset, lo - layout.start)
                    by_group.setdefault(self._group_of[i], []).append(piece)
            for g, pieces in sorted(by_group.items()):
                for piece in pieces:  # a view: the optimizer updates the parameter where it lies
                    view = reducer.params[piece.param].detach().view(-1)[piece.lo : piece.hi]
                    shards.append(_Shard(b, g, [piece], view))
        self._shards = shards
        groups = [
            {**hyper_parameters(group), "params": [s.tensor for s in shards if s.group == g]}
            for g, group in enumerate(self.optimizer.param_groups)
        ]
        groups = [g for g in groups if g["params"]]
        # A rank whose chunks hold no trained element (tiny models, many ranks) steps nothing.
        self._shard_optimizer = optimizer_like(self.optimizer, groups) if groups else None
        self._layout_version = reducer.layout_version

    def _readopt_moved_params(self) -> None:
        """Bring back into the parameter buffers any parameter re-pointed since (module doc, 3.)."""
        if self._layout_version != self.reducer.layout_version:
            return  # the next _follow_layout builds new buffers and adopts every parameter
        for param, slot in self._slots:  # every step: a pointer comparison per parameter
            if param.data_ptr() != slot.data_ptr() or param.stride() != slot.stride():
                _adopt(param, slot)

    def _follow_layout(self) -> None:
        """Re-split the state when DDP laid its buckets out again (its rebuild after the first
        iteration, ``bucket_cap_mb=auto``): every rank does, so this is collective."""
        if self._layout_version == self.reducer.layout_version:
            return
        # In the old layout, consumed after the build; each old entry is dropped once gathered.
        scalars, entries = self._gathered_state(release=True)
        self._build()
        self._place(scalars, entries)

    # -- the step ----------------------------------------------------------------------------
    def _take_grads(self) -> bool:
        """Give the shard tensors this iteration's averaged gradients; False if no synchronised
        backward happened since the last step (then nothing steps, as with every ``.grad`` None)."""
        done = self.reducer.iteration - 1  # the latest finished synchronised backward
        if done < 0 or done == self._consumed_iteration:
            return False
        self._readopt_moved_params()  # also between clip_grad_norm_ and step: the shards step the buffers
        if self._grads_of_iteration == done:
            return True
        self._follow_layout()
        for shard in self._shards:  # views of this rank's chunk of the averaged gradients
            (piece,) = shard.pieces
            shard.tensor.grad = self.reducer.shard_grads[shard.bucket][piece.chunk_lo : piece.chunk_lo + piece.size]
        self._grads_of_iteration = done
        return True

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the gradients so their global 2-norm (over every rank's shards) is at most
        ``max_norm``, as ``torch.nn.utils.clip_grad_norm_`` does for full gradients; returns the
        norm. Collective (one small all-reduce)."""
        if float(norm_type) != 2.0:
            raise ValueError(f"ZeroOptimizer.clip_grad_norm_ supports the 2-norm only, got norm_type={norm_type}")
        has_grads = self._take_grads()
        total = torch.zeros(1, dtype=torch.float64, device=self.process_group.device)
        if has_grads:
            for shard in self._shards:
                total += shard.tensor.grad.double().square().sum()
        self.process_group.all_reduce(total, ReduceOp.SUM).wait()
        norm = total.sqrt().to(self.reducer.params[0].dtype)[0]
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        if has_grads:
            for shard in self._shards:
                shard.tensor.grad.mul_(coef)
        return norm

    @torch.no_grad()
    def step(self, closure: None = None, all_gather: bool = True) -> bool:
        """Step this rank's shards with the latest averaged gradients, then all-gather the
        parameters bucket by bucket. Collective. ``all_gather=False`` leaves the all-gather to
        the caller (:meth:`all_gather_params`, before anything reads the parameters): a trainer
        times it apart. Returns whether anything stepped (False: no synchronised backward since
        the last step, so there is nothing to gather either)."""
        if closure is not None:
            raise ValueError("ZeroOptimizer.step takes no closure (closure optimizers such as LBFGS are refused)")
        if not self._take_grads():
            return False
        if self._shard_optimizer is not None:
            for shard_group, group in zip(self._shard_optimizer.param_groups, self._groups_in_use()):
                shard_group.update(hyper_parameters(group))
            self._shard_optimizer.step()
        # Every .grad of the wrapped optimizer is None, so for torch's optimizers this steps nothing;
        # its step hooks run, and a learning-rate scheduler sees that the optimizer stepped.
        self.optimizer.step()
        self._consumed_iteration = self._grads_of_iteration
        if all_gather:
            self.all_gather_params()
        return True

    def _groups_in_use(self) -> list[dict]:
        used = sorted({s.group for s in self._shards})
        return [self.optimizer.param_groups[g] for g in used]

    @torch.no_grad()
    def all_gather_params(self) -> None:
        """Every rank's updated chunk of every bucket into the parameters, bucket by bucket
        (collective; :meth:`step` does it unless told not to)."""
        self._readopt_moved_params()  # a parameter re-pointed since the step would miss the gather
        for flat, layout in zip(self.param_buffers, self._layouts):
            self.reducer.shard_comm.all_gather(flat, layout)  # the parameters are views of flat
        # Written through the buffers, the parameters' own version counters did not move: bump them,
        # as an optimizer's in-place step does, so autograd refuses a graph saved before the step
        # (on every rank alike, not only where this rank's chunk changed them).
        for param in self.reducer.params:
            increment_version(param)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the shard tensors' gradients (the parameters' ``.grad`` are already ``None``)."""
        for shard in self._shards:
            shard.tensor.grad = None
        self._consumed_iteration = self.reducer.iteration - 1
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self) -> list[dict]:
        """The wrapped optimizer's groups (what schedulers change)."""
        return self.optimizer.param_groups

    # -- what is held, for benchmarks and tests ------------------------------------------------
    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (its shards' state)."""
        if self._shard_optimizer is None:
            return 0
        return sum(
            v.numel() * v.element_size()
            for state in self._shard_optimizer.state.values()
            for v in state.values()
            if torch.is_tensor(v)
        )

    def shard_gradient_elements(self) -> dict[str, list[tuple[int, int]]]:
        """Which elements of which parameter this rank holds gradients for: ``{name: [(lo, hi)]}``
        over the flattened parameter (the layout of the latest step)."""
        out: dict[str, list[tuple[int, int]]] = {}
        for shard in self._shards:
            for piece in shard.pieces:
                out.setdefault(self.reducer.names[piece.param], []).append((piece.lo, piece.hi))
        return out

    # -- checkpoints ---------------------------------------------------------------------------
    def shard_state_dict(self) -> dict[str, Any]:
        """This rank's share of the optimizer state, without any collective or full-size copy:
        ``{"params": {k: {"lo", "hi", "shape", "state"}}}``, ``k`` a parameter's index in the wrapped
        optimizer's ``state_dict`` (its groups' order), ``[lo, hi)`` the elements of the flattened
        parameter this rank steps, ``state`` their optimizer state (element-wise entries as the
        ``hi - lo`` slice, others such as Adam's ``step`` as they are). Every rank's together make
        the consolidated state again (:func:`consolidate_shards`)."""
        order = {id(p): k for k, p in enumerate(p for group in self.optimizer.param_groups for p in group["params"])}
        states = {} if self._shard_optimizer is None else self._shard_optimizer.state
        params: dict[int, dict[str, Any]] = {}
        for shard in self._shards:
            state = states.get(shard.tensor)
            if not state:
                continue  # never stepped: nothing to save, as torch's own state_dict
            (piece,) = shard.pieces
            param = self.reducer.params[piece.param]
            params[order[id(param)]] = {
                "lo": piece.lo,
                "hi": piece.hi,
                "shape": list(param.shape),
                "state": {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in state.items()},
            }
        return {"params": params}

    def state_dict(self) -> dict[str, Any]:
        """The consolidated state, in the wrapped optimizer's own ``state_dict`` format. Collective."""
        full = self._gather_full_state()
        params = self.reducer.params
        try:
            for i, state in full.items():
                self.optimizer.state[params[i]] = state
            return self.optimizer.state_dict()
        finally:
            self.optimizer.state.clear()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a consolidated state (``torch.optim.Optimizer.state_dict`` format, from any world
        size or plain DDP), keeping only this rank's shards. Collective only if the layout changed."""
        self.optimizer.load_state_dict(state_dict)
        self.shard_loaded_state()

    def shard_loaded_state(self) -> None:
        """Move the state the wrapped optimizer holds (after its own ``load_state_dict``) into this
        rank's shards, and drop it from the wrapped optimizer."""
        if self._layout_version != self.reducer.layout_version:
            self._build()  # the shards' old state is replaced wholesale
        full = {self._index[id(p)]: state for p, state in self.optimizer.state.items()}
        self.optimizer.state.clear()
        self._split_full_state(full)
        self._grads_of_iteration = -1

    def _split_full_state(self, full: dict[int, dict[str, Any]]) -> None:
        """Give each shard tensor the slice of the per-parameter ``full`` state it covers."""
        scalars = {
            i: {k: v for k, v in st.items() if not _is_elementwise(v, self.reducer.params[i])} for i, st in full.items()
        }
        entries = (
            (i, key, value)
            for i, state in full.items()
            for key, value in state.items()
            if _is_elementwise(value, self.reducer.params[i])
        )
        self._place(scalars, entries)

    def _place(self, scalars: dict[int, dict[str, Any]], entries) -> None:
        """Set the shards' optimizer state from per-parameter state: ``scalars[i]`` (entries such
        as ``step``, the same for every piece of parameter ``i``) and ``entries``, an iterable of
        ``(i, key, tensor shaped like parameter i)`` consumed one at a time."""
        if self._shard_optimizer is None:
            for _ in entries:  # every rank takes part in the collectives behind the iterable
                pass
            return
        where: dict[int, list[tuple[_Shard, int, _Piece]]] = {}  # parameter -> (shard, offset in it, piece)
        for shard in self._shards:
            at = 0
            for piece in shard.pieces:
                where.setdefault(piece.param, []).append((shard, at, piece))
                at += piece.size
        state: dict[torch.Tensor, dict[str, Any]] = {}
        for i, key, value in entries:
            for shard, at, piece in where.get(i, ()):
                into = state.setdefault(shard.tensor, {})
                if key not in into:
                    into[key] = torch.zeros(shard.tensor.numel(), dtype=value.dtype, device=shard.tensor.device)
                into[key][at : at + piece.size].copy_(value.reshape(-1)[piece.lo : piece.hi])
        for shard in self._shards:
            first = scalars.get(shard.pieces[0].param)
            if first:  # stepped before: one tensor per shard, optimizers update them in place
                into = state.setdefault(shard.tensor, {})
                into.update((k, v.clone() if torch.is_tensor(v) else v) for k, v in first.items())
        self._shard_optimizer.state.clear()
        for shard in self._shards:
            if shard.tensor in state:  # keys in the order the optimizer made them: step first
                ordered = dict(
                    sorted(state[shard.tensor].items(), key=lambda kv: torch.is_tensor(kv[1]) and kv[1].dim() > 0)
                )
                self._shard_optimizer.state[shard.tensor] = ordered

    def _gather_full_state(self) -> dict[int, dict[str, Any]]:
        """Every trained parameter's full optimizer state (per parameter index), on every rank."""
        scalars, entries = self._gathered_state()
        full = {i: dict(state) for i, state in scalars.items()}
        for i, key, value in entries:
            full.setdefault(i, {})[key] = value.clone()
        return {i: state for i, state in full.items() if state}

    def _gathered_state(self, release: bool = False):
        """This layout's optimizer state, per parameter: ``(scalars, entries)`` as :meth:`_place` takes.

        Element-wise entries are all-gathered one (bucket, group, key) at a time, in the layout the
        shards were built for, as ``entries`` is consumed (a view of one bucket-sized buffer each:
        so re-splitting holds one bucket of full state at a time); other entries (Adam's ``step``)
        are the same for every piece of a parameter and travel as objects, now. ``release``: drop
        each shard's entry once it is in the bucket's buffer (a re-split: the old shards' state is
        not needed after). Collective: every rank must consume ``entries`` to the end.
        """
        mine: dict[tuple[int, int, str], str] = {}  # (bucket, group, key) -> dtype, of element-wise entries
        scalars: dict[int, dict[str, Any]] = {}
        states = {} if self._shard_optimizer is None else self._shard_optimizer.state
        for shard in self._shards:
            for key, value in states.get(shard.tensor, {}).items():
                if _is_elementwise(value, shard.tensor):
                    mine[(shard.bucket, shard.group, key)] = str(value.dtype).removeprefix("torch.")
                else:
                    for piece in shard.pieces:
                        scalars.setdefault(piece.param, {})[key] = value.cpu() if torch.is_tensor(value) else value
        everyone = all_gather_object(self.process_group, {"keys": mine, "scalars": scalars})
        keys: dict[tuple[int, int, str], str] = {}
        merged: dict[int, dict[str, Any]] = {}
        for other in everyone:
            keys.update(other["keys"])
            for i, entries in other["scalars"].items():  # one tensor per parameter: optimizers update them in place
                merged.setdefault(i, {}).update((k, v.clone() if torch.is_tensor(v) else v) for k, v in entries.items())
        return merged, self._all_gathered(keys, list(self._shards), self._buckets, list(self._layouts), states, release)

    def _all_gathered(self, keys, shards, buckets, layouts, states, release: bool):
        for b, g, key in sorted(keys):  # the same order on every rank
            bucket, layout = buckets[b], layouts[b]
            flat = torch.zeros(layout.padded_numel, dtype=getattr(torch, keys[(b, g, key)]), device=bucket.device)
            for shard in shards:
                value = states.get(shard.tensor, {}).get(key)
                if (shard.bucket, shard.group) != (b, g) or value is None:
                    continue
                at = 0
                for piece in shard.pieces:
                    start = layout.start + piece.chunk_lo
                    flat[start : start + piece.size].copy_(value[at : at + piece.size])
                    at += piece.size
                if release:  # re-splitting: the old shard's entry is in flat now, and no longer needed
                    del states[shard.tensor][key]
            self.reducer.shard_comm.all_gather(flat, layout)
            for i, offset in zip(bucket.params, bucket.offsets):
                if self._group_of.get(i) == g:
                    param = self.reducer.params[i]
                    yield i, key, flat[offset : offset + param.numel()].view_as(param)


def consolidate_shards(groups_entry: dict[str, Any], shards: list[dict[str, Any]]) -> dict[str, Any]:
    """The consolidated optimizer ``state_dict`` (torch's per-parameter format) from every rank's
    :meth:`ZeroOptimizer.shard_state_dict`; ``groups_entry`` supplies the ``param_groups``.

    Raises:
        ValueError: when the shards do not cover each parameter's elements exactly once (a shard
            missing, or shards of different checkpoints), naming the parameter.
    """
    pieces: dict[int, list[dict[str, Any]]] = {}
    for shard in shards:
        for k, piece in shard["params"].items():
            pieces.setdefault(int(k), []).append(piece)
    state: dict[int, dict[str, Any]] = {}
    for k, parts in sorted(pieces.items()):
        shape = parts[0]["shape"]
        numel = math.prod(shape)
        covered = sorted((p["lo"], p["hi"]) for p in parts)
        if covered[0][0] != 0 or covered[-1][1] != numel or any(a[1] != b[0] for a, b in zip(covered, covered[1:])):
            raise ValueError(
                f"the optimizer shards of parameter {k} (shape {tuple(shape)}) cover elements {covered} of "
                f"{numel}: each element must be in exactly one shard (a shard file is missing, or the shards "
                "come from different checkpoints)"
            )
        full: dict[str, Any] = {}
        for part in parts:
            for key, value in part["state"].items():
                if is_per_element(value):  # this piece's slice
                    if key not in full:
                        full[key] = torch.empty(numel, dtype=value.dtype)
                    full[key][part["lo"] : part["hi"]] = value
                else:
                    full.setdefault(key, value)  # the same on every piece of the parameter
        state[k] = {key: v.view(shape) if is_per_element(v) else v for key, v in full.items()}
    return {"state": state, "param_groups": groups_entry["param_groups"]}


def optimizer_like(optimizer: torch.optim.Optimizer, groups: list[dict]) -> torch.optim.Optimizer:
    """A new optimizer of ``optimizer``'s class over ``groups`` (which carry every hyper-parameter),
    given the constructor arguments its defaults name (AdamW's defaults hold a key its
    constructor does not take)."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    return type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})


@torch.no_grad()
def _adopt(param: torch.Tensor, slot: torch.Tensor) -> None:
    """Make ``param`` the view ``slot`` of a parameter buffer, its values copied in."""
    slot.copy_(param)
    param.data = slot


def hyper_parameters(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}


def is_per_element(value: Any) -> bool:
    """Whether an optimizer state entry holds one value per element of its parameter (Adam's
    moments: a shard keeps its slice of it), rather than one for the whole parameter (``step``)."""
    return torch.is_tensor(value) and value.dim() > 0


def _is_elementwise(value: Any, param: torch.Tensor) -> bool:
    return is_per_element(value) and value.shape == param.shape
