"""An exact, order-independent sum of float tensors across ranks (int64 fixed point).

A float all-reduce adds in an order that depends on the world size and the algorithm (ring,
tree, recursive halving), and float addition is not associative, so the same gradients summed
over 1, 2 or 8 ranks differ in their last bits. Integer addition is associative. So:

1. every contribution (one shard's gradient, say) is a float32 vector cut into segments (one per
   parameter); each segment gets a power-of-two scale ``2**s`` that every rank agrees on, from an
   all-reduce MAX of the segments' largest magnitude over all contributions;
2. each contribution becomes ``round(x * 2**s)`` as int64 — exact to 2**-s, and a function of
   that contribution alone;
3. the int64 vectors are summed, locally and then across ranks (all-reduce SUM): exact, so the
   result is the same bits whatever the order, the world size or the backend;
4. the sum turns back into floats (``q * 2**-s``), again one fixed function of the exact sum.

Overflow: ``s`` is chosen so that ``count * max|x| * 2**s < 2**62``, where ``count`` is the
number of contributions over all ranks; the exact sum then fits in int64 with room to spare.
``s`` moves in steps of ``BAND_BITS`` (4) bits: it is the same for every maximum whose binary
exponent lies in one band of 4, so it stays put while the gradients' scale drifts. With count <=
2**c the largest value keeps at least ``58 - c`` bits (far more than float32's 24); a value
smaller than the segment's maximum by a factor of ``2**(58 - c)`` or more may round (to zero, at
worst), well below what float32 itself can add to that maximum.

A segment holding inf or NaN in any contribution comes back all NaN (the sum is not finite).

One all-reduce instead of two (:class:`ExactAllReducer`): the MAX that fixes the scales costs a
second round trip per sum. The reducer instead tries the previous sum's exponents, and learns in
the same SUM, per segment, whether any contribution *overflowed* (``|x| * 2**s >= 2**(62 - c)``,
or not finite), whether one *reached the band* (``|x| * 2**s >= 2**(62 - c - 4)``) and whether
any was *lossy* (``x * 2**s`` not an integer). The guess is kept for a segment that did not
overflow and either reached the band or was lossless everywhere; otherwise the sum is redone the
two-collective way. The bits never depend on the guess. No overflow and a value in the band means
that the global maximum lies in the guess's band: the guess *is* the canonical exponent (when it
is one for this count: its band's top a multiple of 4), and the sums are the same computation. No
overflow but nothing in the band: the guess is at most the canonical exponent (a coarser grid),
and lossless there means lossless on the canonical grid too, so both give the exact sum. A resumed
run without the previous exponents, or another world size, only pays one more round trip.

Why bands: as training converges, some gradient elements are tiny next to their parameter's
largest and round on any grid, so a guess that had to be lossless (the previous design: one bit
below the last canonical exponent) failed on almost every step after a few hundred MNIST steps
(every step from 500 to 1500 of a 2-rank run), each costing two more collectives.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..comm.process_group import ProcessGroup
from ..comm.types import ReduceOp

__all__ = [
    "segment_max_abs",
    "local_max_abs",
    "scale_exponents",
    "to_fixed",
    "exact_sum",
    "from_fixed",
    "exact_all_reduce",
    "ExactAllReducer",
]

_HEADROOM_BITS = 62
"""The exact sum stays below 2**62 (int64 holds up to 2**63 - 1)."""

BAND_BITS = 4
"""Scale exponents move in steps of this many bits (see the module docstring)."""


def segment_max_abs(contribution: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """The largest magnitude of each segment of a flat ``contribution`` (float64, one per segment).

    NaN or inf anywhere in a segment gives inf (which every backend's MAX keeps; NaN it may drop).
    """
    parts = torch.split(contribution.detach(), list(sizes))
    out = torch.stack([p.abs().amax() if p.numel() else p.new_zeros(()) for p in parts]).to("cpu", torch.float64)
    return torch.nan_to_num(out, nan=float("inf"))


def local_max_abs(contributions: Sequence[torch.Tensor], sizes: Sequence[int]) -> torch.Tensor:
    """Each segment's largest magnitude over this rank's ``contributions`` (zeros if none): what the
    ranks reduce with MAX before :func:`exact_sum`."""
    out = torch.zeros(len(sizes), dtype=torch.float64)
    for contribution in contributions:
        out = torch.maximum(out, segment_max_abs(contribution, sizes))
    return out


def scale_exponents(max_abs: torch.Tensor, count: int) -> torch.Tensor:
    """The exponent ``s`` of each segment's scale ``2**s`` (int64), given the largest magnitude
    over every contribution of the sum (``max_abs``, the same on every rank) and their number.

    ``count * max_abs * 2**s < 2**62``, within ``BAND_BITS`` of that bound: ``s`` is the same for
    every ``max_abs`` in ``[2**(k - BAND_BITS), 2**k)``, ``k`` a multiple of ``BAND_BITS``. A zero
    or non-finite segment gets ``s = 0``.
    """
    if count < 1:
        raise ValueError(f"an exact sum needs at least 1 contribution, got count={count}")
    count_bits = _count_bits(count)
    exponents = []
    for m in max_abs.tolist():
        if m == 0.0 or not math.isfinite(m):
            exponents.append(0)
        else:
            _, e = math.frexp(m)  # m < 2**e
            band_top = -(-e // BAND_BITS) * BAND_BITS  # e rounded up to the band's top: m < 2**band_top
            exponents.append(_HEADROOM_BITS - count_bits - band_top)
    return torch.tensor(exponents, dtype=torch.int64)


def _count_bits(count: int) -> int:
    return math.ceil(math.log2(count)) if count > 1 else 0


def _expand(per_segment: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    return torch.repeat_interleave(per_segment, torch.tensor(list(sizes), dtype=torch.int64))


def to_fixed(contribution: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``round(x * scale)`` as int64; ``scales``: float64, one per element (powers of two).

    float32 -> float64 and the multiplication by a power of two are exact; the rounding (half
    to even) is the one deterministic step. Non-finite values become 0 (their segment is marked
    NaN by :func:`from_fixed`).
    """
    scaled = contribution.detach().to(torch.float64) * scales
    scaled = torch.nan_to_num(scaled, nan=0.0, posinf=0.0, neginf=0.0)
    return torch.round(scaled).to(torch.int64)


def exact_sum(contributions: Sequence[torch.Tensor], sizes: Sequence[int], max_abs: torch.Tensor, count: int):
    """This rank's part of an exact sum: ``(int64 partial sum, per-element float64 scales)``, for an
    all-reduce SUM and then :func:`from_fixed`.

    ``max_abs``: each segment's largest magnitude over every contribution on every rank (the MAX
    of :func:`local_max_abs`); ``count``: the number of contributions over every rank.
    """
    exponents = scale_exponents(max_abs, count)
    scales = _expand(torch.pow(2.0, exponents.to(torch.float64)), sizes)
    total = torch.zeros(sum(sizes), dtype=torch.int64)
    for contribution in contributions:
        total += to_fixed(contribution.cpu(), scales)
    return total, scales


def from_fixed(
    total: torch.Tensor, scales: torch.Tensor, max_abs: torch.Tensor, sizes: Sequence[int], dtype=torch.float32
) -> torch.Tensor:
    """The exact integer sum back as floats: ``total / scale`` (a fixed function of ``total``); the
    segments whose ``max_abs`` is not finite (a contribution held inf or NaN) are NaN."""
    result = _unscaled(total, scales).to(dtype)
    bad = ~torch.isfinite(max_abs)
    if bad.any():
        result[_expand(bad, sizes)] = float("nan")
    return result


def _unscaled(total: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``total / scale`` in float64: exact for ``|total| < 2**53``, else one rounding (to nearest)."""
    return total.cpu().to(torch.float64) / scales


def exact_all_reduce(
    process_group: ProcessGroup,
    contributions: Sequence[torch.Tensor],
    sizes: Sequence[int],
    count: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The exact sum over every rank's ``contributions`` (flat tensors cut into ``sizes``), the same
    bits on every rank and for every world size (collective: two all-reduces, MAX then SUM).

    Args:
        contributions: this rank's flat vectors (may be empty: the rank adds nothing).
        sizes: the segment lengths (one scale per segment); the same on every rank.
        count: the number of contributions over all ranks (bounds the sum, so fixes the scales).
    """
    max_abs = local_max_abs(contributions, sizes).to(process_group.device)
    process_group.all_reduce(max_abs, ReduceOp.MAX).wait()
    max_abs = max_abs.cpu()
    total, scales = exact_sum(contributions, sizes, max_abs, count)
    total = total.to(process_group.device)
    process_group.all_reduce(total, ReduceOp.SUM).wait()
    return from_fixed(total, scales, max_abs, sizes, dtype)


_SCRATCH_BYTES = 256 * 2**20
"""The most scratch memory an :class:`ExactAllReducer` keeps between sums (:meth:`ExactAllReducer._scratch`)."""


class ExactAllReducer:
    """Exact sums over ranks, one int64 all-reduce SUM in the common case (see the module docstring).

    Args:
        sizes: the segment lengths (one scale per segment), the same on every rank.

    Attributes:
        fallbacks: sums that needed the second round trip (the first one always does).
    """

    def __init__(self, sizes: Sequence[int]):
        self.sizes = list(sizes)
        self.exponents: torch.Tensor | None = None
        self.fallbacks = 0
        self._scales: tuple | None = None  # the guessed exponents' scales, cached: _guessed_scales
        self._kept_scratch: tuple[torch.Tensor, ...] | None = None  # _scratch

    def all_reduce(
        self, process_group: ProcessGroup, contributions: Sequence[torch.Tensor], count: int, extra: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(exact sum of the contributions as float64, the int64 ``extra`` summed over ranks)``
        (collective: one all-reduce, or three when the guessed scales do not fit).

        ``contributions``: this rank's flat vectors, or one 2-D tensor with a row each (no copy)."""
        if self.exponents is not None:
            scales, _, _, _ = self._guessed_scales()
            total, checks = self._fixed_checked(contributions, count)
            packed = torch.cat([total, checks.reshape(-1), extra]).to(process_group.device)
            process_group.all_reduce(packed, ReduceOp.SUM).wait()
            packed, n, k = packed.cpu(), len(total), len(self.sizes)
            overflowed, in_band, lossy = packed[n : n + 3 * k].view(3, k).tolist()
            extra = packed[n + 3 * k :]
            if not any(overflowed) and all(band or not off for band, off in zip(in_band, lossy)):
                return _unscaled(packed[:n], scales), extra  # from_fixed's, all finite (none overflowed)
            extra_summed = True
        else:
            extra_summed = False
        self.fallbacks += 1
        max_abs = local_max_abs(contributions, self.sizes).to(process_group.device)
        process_group.all_reduce(max_abs, ReduceOp.MAX).wait()
        max_abs = max_abs.cpu()
        total, scales = exact_sum(contributions, self.sizes, max_abs, count)
        packed = total if extra_summed else torch.cat([total, extra])
        packed = packed.to(process_group.device)
        process_group.all_reduce(packed, ReduceOp.SUM).wait()
        packed, n = packed.cpu(), len(total)
        self.exponents = scale_exponents(max_abs, count)
        return from_fixed(packed[:n], scales, max_abs, self.sizes, torch.float64), (
            extra if extra_summed else packed[n:]
        )

    def _fixed_checked(self, contributions: Sequence[torch.Tensor], count: int):
        """This rank's int64 sum at the guessed exponents' scales, and per segment (rows, 1 or 0) whether any element
        overflowed (or is not finite), whether its largest reached the scale's band, and whether any
        is lossy (off the grid)."""
        room = _HEADROOM_BITS - _count_bits(count)
        limit = 2.0**room
        if len(contributions) == 0:
            return torch.zeros(sum(self.sizes), dtype=torch.int64), torch.zeros(3, len(self.sizes), dtype=torch.int64)
        if isinstance(contributions, torch.Tensor):  # already one row per contribution
            stacked = contributions.detach().cpu()
        else:
            stacked = torch.stack([c.detach().cpu() for c in contributions])
        scales, scales32, lowest, highest = self._guessed_scales()
        # float32 values times 2**s, s in [0, 100], stay exact in float32 (no overflow, no underflow:
        # the exponent only grows), so the tests and the rounding give float64's bits at half the
        # traffic. A negative exponent could push a tiny value below float32's range unnoticed.
        narrow = stacked.dtype == torch.float32 and 0 <= lowest and highest <= 100
        scaled, rounded, ints = self._scratch(stacked.shape, torch.float32 if narrow else torch.float64)
        torch.mul(stacked, scales32 if narrow else scales, out=scaled)  # float64: as stacked.to(float64) * scales
        # per element, over the contributions: the largest magnitude (NaN stays NaN: it fails
        # ``< limit``) and the largest distance to the grid; then per segment
        largest = torch.abs(scaled, out=rounded).amax(dim=0)
        torch.round(scaled, out=rounded)
        off_grid = scaled.sub_(rounded).abs_().amax(dim=0)  # scaled is spent
        largest, off_grid = self._segment_max(torch.stack([largest, off_grid]))
        # "in the band" proves the guess canonical only for an exponent canonical for some maximum
        # and this count (the previous sum's, normally): a band's top a multiple of BAND_BITS
        canonical = (room - self.exponents) % BAND_BITS == 0
        checks = torch.stack([~(largest < limit), (largest >= limit / 2.0**BAND_BITS) & canonical, off_grid != 0])
        if checks[0].any():  # the sum is discarded; keep the conversion defined
            rounded.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0).clamp_(-limit, limit)
        # rows: overflowed (or not finite), reached the band, lossy (off the grid; NaN too)
        return ints.copy_(rounded).sum(dim=0), checks.to(torch.int64)

    def _scratch(self, shape: torch.Size, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Scratch tensors of ``shape`` for :meth:`_fixed_checked`: scaled and rounded (``dtype``),
        and int64. Kept between sums while they take at most ``_SCRATCH_BYTES`` (fresh ones each
        step cost as much as the arithmetic: new pages); larger ones are made per call."""
        rows, numel = shape
        kept = self._kept_scratch
        if kept is not None and kept[0].dtype == dtype and kept[0].shape[1] == numel and len(kept[0]) >= rows:
            return tuple(t[:rows] for t in kept)
        made = (torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=torch.int64))
        if sum(t.numel() * t.element_size() for t in made) <= _SCRATCH_BYTES:
            self._kept_scratch = made
        return made

    def _guessed_scales(self) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """The per-element scales of ``self.exponents`` as float64 and float32, and the exponents'
        lowest and highest (cached while the exponents stay put)."""
        key = tuple(self.exponents.tolist())
        if self._scales is None or self._scales[0] != key:
            scales = _expand(torch.pow(2.0, self.exponents.to(torch.float64)), self.sizes)
            self._scales = (key, (scales, scales.to(torch.float32), min(key, default=0), max(key, default=0)))
        return self._scales[1]

    def _segment_max(self, rows: torch.Tensor) -> torch.Tensor:
        """The largest value of each row within each segment (NaN if any is NaN): ``[rows, segments]``."""
        parts = [part.amax(dim=1) if part.shape[1] else part.new_zeros(len(rows)) for part in rows.split(self.sizes, 1)]
        return torch.stack(parts, dim=1)
