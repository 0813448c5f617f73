"""Gradient buckets: which parameters share a flat buffer, what travels how, and the buffers.

Two pure functions (no communication, no state) decide the layout, so the same parameters and
settings give the same layout on every rank:

* ``assign_buckets`` groups parameters into buckets. It follows torch DDP: parameters that
  require a gradient, in the given order, grouped per (dtype, device), each group filled up to a
  byte cap; buckets are then listed in reverse, because backward produces the gradients of the
  last layers first. After the first iteration the reducer calls it again with the order in which
  gradients actually became ready (``reverse=False``) and a small first bucket, so that
  communication starts sooner.
* ``plan_buckets`` turns that grouping into a :class:`BucketPlan`: per bucket, where each
  gradient sits in the flat buffer and which all-reduces carry the bucket — a :class:`FlatRun`
  (consecutive gradients sent as one slice of the buffer) or an :class:`InPlace` (one large
  gradient reduced where autograd left it, skipping two copies).

``allocate`` then makes one zeroed flat buffer per bucket and a view of it shaped like each
parameter. :class:`GradBucket` is what a communication hook sees of one bucket.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

MB = 1024 * 1024
FIRST_BUCKET_CAP_MB = 1.0


def assign_buckets(
    sizes_bytes: Sequence[int],
    keys: Sequence[tuple],
    cap_bytes: int,
    first_cap_bytes: int | None = None,
    order: Sequence[int] | None = None,
    reverse: bool = True,
) -> list[list[int]]:
    """Group parameter indices into buckets.

    Args:
        sizes_bytes: size in bytes of each parameter (index = parameter index).
        keys: per parameter, what must be equal inside a bucket, e.g. ``(dtype, device)``.
        cap_bytes: a bucket is closed once it holds at least this many bytes (a single larger
            parameter gets a bucket of its own). ``0`` puts every parameter in its own bucket.
        first_cap_bytes: cap of the first bucket of each key, if different.
        order: the order in which to visit parameters (default: index order).
        reverse: list the buckets last-to-first (the default, for registration order).

    Returns:
        Buckets as lists of parameter indices, in the order they are expected to become ready.
    """
    if cap_bytes < 0:
        raise ValueError(f"bucket cap must be >= 0 bytes, got {cap_bytes}")
    order = list(range(len(sizes_bytes))) if order is None else list(order)
    open_buckets: dict[tuple, list[int]] = {}
    open_bytes: dict[tuple, int] = {}
    closed_per_key: dict[tuple, int] = {}
    buckets: list[list[int]] = []
    for idx in order:
        key = keys[idx]
        bucket = open_buckets.setdefault(key, [])
        bucket.append(idx)
        open_bytes[key] = open_bytes.get(key, 0) + sizes_bytes[idx]
        cap = first_cap_bytes if (first_cap_bytes is not None and closed_per_key.get(key, 0) == 0) else cap_bytes
        if open_bytes[key] >= cap:
            buckets.append(bucket)
            closed_per_key[key] = closed_per_key.get(key, 0) + 1
            del open_buckets[key]
            open_bytes[key] = 0
    buckets.extend(b for b in open_buckets.values() if b)
    # A bucket is "expected ready" by the position of its first member in the visiting order.
    position = {idx: i for i, idx in enumerate(order)}
    buckets.sort(key=lambda b: position[b[0]])
    return buckets[::-1] if reverse else buckets


# -- the plan -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ParamSpec:
    """What the layout needs to know of one parameter (not the tensor itself)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, param: torch.Tensor) -> ParamSpec:
        return cls(tuple(param.shape), param.dtype, param.device)

    @property
    def numel(self) -> int:
        return _numel(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class FlatRun:
    """Consecutive gradients of a bucket that travel as one slice ``[start, stop)`` of its flat buffer."""

    start: int
    stop: int


@dataclass(frozen=True)
class InPlace:
    """One large gradient, all-reduced as its own tensor where autograd left it.

    ``position`` is its place in the bucket. When the gradient cannot be changed in place (it
    shares storage with another one, is missing, or is not a plain dense tensor) its slot in
    the flat buffer stands in for it; the collectives stay the same either way.
    """

    position: int


Transfer = FlatRun | InPlace


@dataclass(frozen=True)
class Bucket:
    """One bucket of the plan: its parameters, their place in the flat buffer, its all-reduces."""

    index: int
    params: tuple[int, ...]  # parameter indices, in buffer order
    offsets: tuple[int, ...]  # element offset of each in the flat buffer
    shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype
    device: torch.device
    transfers: tuple[Transfer, ...]  # without a comm hook: the all-reduces that carry the bucket, in order

    @property
    def numel(self) -> int:
        return self.offsets[-1] + _numel(self.shapes[-1])

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class Slot:
    """Where one parameter's gradient goes: bucket, position in it, and whether it is reduced in place."""

    bucket: int
    position: int
    in_place: bool


@dataclass(frozen=True)
class BucketPlan:
    """The whole layout: buckets in launch order, and each parameter's slot (by parameter index)."""

    buckets: tuple[Bucket, ...]
    slots: tuple[Slot | None, ...]  # None: a parameter outside the buckets (a sparse gradient's)

    @property
    def assignment(self) -> list[list[int]]:
        return [list(b.params) for b in self.buckets]


def plan_buckets(
    specs: Sequence[ParamSpec],
    assignment: Sequence[Sequence[int]],
    in_place_min_bytes: int | None,
    unbucketed: frozenset[int] = frozenset(),
) -> BucketPlan:
    """Lay out buckets and decide how each gradient travels.

    Args:
        specs: one per parameter (index = parameter index).
        assignment: parameter indices per bucket, in launch order (from :func:`assign_buckets`).
        in_place_min_bytes: gradients at least this big are reduced in place; ``None`` sends
            every gradient through the flat buffer (what a comm hook or
            ``gradient_as_bucket_view`` needs).
        unbucketed: parameters that belong in no bucket (their slot is ``None``): those with
            sparse gradients, which the reducer all-reduces one by one.

    Consecutive gradients below the threshold form one :class:`FlatRun` each, so a bucket costs
    one all-reduce per run of small gradients plus one per large gradient.
    """
    buckets, slots = [], {}
    for b_idx, members in enumerate(assignment):
        if not members:
            raise ValueError(f"bucket {b_idx} of assignment {assignment} is empty")
        offsets, offset = [], 0
        for i in members:
            offsets.append(offset)
            offset += specs[i].numel
        large = [in_place_min_bytes is not None and specs[i].nbytes >= in_place_min_bytes for i in members]
        for pos, i in enumerate(members):
            slots[i] = Slot(b_idx, pos, large[pos])
        first = specs[members[0]]
        buckets.append(
            Bucket(
                index=b_idx,
                params=tuple(members),
                offsets=tuple(offsets),
                shapes=tuple(specs[i].shape for i in members),
                dtype=first.dtype,
                device=first.device,
                transfers=_transfers(offsets, offset, large),
            )
        )
    missing = sorted(set(range(len(specs))) - set(slots) - unbucketed)
    if missing:
        raise ValueError(f"parameters {missing} are in no bucket of assignment {assignment}")
    return BucketPlan(tuple(buckets), tuple(slots.get(i) for i in range(len(specs))))


def _transfers(offsets: Sequence[int], total: int, large: Sequence[bool]) -> tuple[Transfer, ...]:
    """Large gradients on their own, each run of consecutive small ones as one slice."""
    out: list[Transfer] = []
    run_start: int | None = None
    for pos, is_large in enumerate(large):
        if is_large:
            if run_start is not None:
                out.append(FlatRun(run_start, offsets[pos]))
                run_start = None
            out.append(InPlace(pos))
        elif run_start is None:
            run_start = offsets[pos]
    if run_start is not None:
        out.append(FlatRun(run_start, total))
    return tuple(out)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# -- the buffers ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class FlatBuffer:
    """A bucket's flat gradient buffer and one view of it per parameter, shaped like it."""

    buffer: torch.Tensor
    views: tuple[torch.Tensor, ...]

    def run(self, run: FlatRun) -> torch.Tensor:
        return self.buffer[run.start : run.stop]


def allocate(plan: BucketPlan, tail: dict[int, int] | None = None) -> list[FlatBuffer]:
    """One zeroed flat buffer per bucket of ``plan``; bucket ``b`` gets ``tail[b]`` more elements
    after its gradients (the reducer's sideband rides there), which no view covers."""
    return [allocate_bucket(b, (tail or {}).get(b.index, 0)) for b in plan.buckets]


def allocate_bucket(bucket: Bucket, tail: int = 0) -> FlatBuffer:
    """One zeroed flat buffer for ``bucket``, ``tail`` elements longer than its gradients."""
    return bucket_in(bucket, torch.zeros(bucket.numel + tail, dtype=bucket.dtype, device=bucket.device))


def bucket_in(bucket: Bucket, buffer: torch.Tensor) -> FlatBuffer:
    """``bucket``'s flat buffer laid over ``buffer`` (at least ``bucket.numel`` elements of its dtype)."""
    views = tuple(buffer[off : off + _numel(shape)].view(shape) for off, shape in zip(bucket.offsets, bucket.shapes))
    return FlatBuffer(buffer, views)


class GradBucket:
    """What a communication hook receives: one bucket's flat gradient buffer and its parameters.

    Mirrors ``torch.distributed.GradBucket``: ``buffer()``, ``index()``, ``is_last()``,
    ``parameters()``, ``gradients()`` (views into the buffer) and ``set_buffer()``. The buffer
    holds this rank's gradients, not yet divided by the world size.
    """

    def __init__(self, index: int, flat: FlatBuffer, params: Sequence[torch.Tensor], is_last: bool, process_group):
        self._index = index
        self._flat = flat
        self._params = list(params)
        self._is_last = is_last
        self.process_group = process_group

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._flat.buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._flat.buffer.copy_(tensor)

    def is_last(self) -> bool:
        return self._is_last

    def parameters(self) -> list[torch.Tensor]:
        return list(self._params)

    def gradients(self) -> list[torch.Tensor]:
        return list(self._flat.views)
