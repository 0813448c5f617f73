"""Gradient buckets: which parameters share one flat buffer, and the buffers themselves.

``assign_buckets`` is a pure function (no communication, no state): the same parameters and caps
give the same buckets on every rank. It follows torch DDP: parameters that require a gradient,
in the given order, grouped per (dtype, device), each group filled up to a byte cap; buckets are
then listed in reverse, because backward produces the gradients of the last layers first. After
the first iteration the reducer calls it again with the order in which gradients actually became
ready (``reverse=False``) and a small first bucket, so that communication starts sooner.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

MB = 1024 * 1024
DEFAULT_BUCKET_CAP_MB = 25.0
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


@dataclass
class Bucket:
    """One flat gradient buffer and the parameters whose gradients live in it."""

    index: int
    param_indices: list[int]
    buffer: torch.Tensor
    offsets: list[int]
    views: list[torch.Tensor] = field(default_factory=list)
    pending: int = 0
    work: object = None  # Work or torch Future (or a list of them) while reductions are in flight
    launched_at: float | None = None
    segments: list = field(default_factory=list)  # how the reducer splits it (reducer._segments)
    direct: dict = field(default_factory=dict)  # position -> tensor reduced on its own this iteration

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


def make_buckets(params: Sequence[torch.Tensor], assignment: Sequence[Sequence[int]]) -> list[Bucket]:
    """Allocate one zeroed flat buffer per bucket and a view of it shaped like each parameter."""
    buckets = []
    for b_idx, members in enumerate(assignment):
        first = params[members[0]]
        total = sum(params[i].numel() for i in members)
        buffer = torch.zeros(total, dtype=first.dtype, device=first.device)
        offsets, views, offset = [], [], 0
        for i in members:
            n = params[i].numel()
            offsets.append(offset)
            views.append(buffer[offset : offset + n].view(params[i].shape))
            offset += n
        buckets.append(Bucket(b_idx, list(members), buffer, offsets, views))
    return buckets
