"""The exact all-reduce (int64 fixed point): the same bits for every world size and order, on
values chosen so that a float sum depends on the order."""

from fractions import Fraction

import pytest
import torch

from ddptrain.comm.api import get_process_group
from ddptrain.ddp.exact import ExactAllReducer, exact_all_reduce, scale_exponents
from ddptrain.testing import run_threaded

V = 8  # contributions (shards) in all, split over the ranks as the trainer splits them


def _adversarial() -> list[torch.Tensor]:
    """8 contributions of 5 elements in 3 segments ([0:3], [3], [4]) whose float32 sum depends on the order."""
    big = 2.0**24  # float32 spacing is 2 here: big + 1 == big
    rows = [
        [big, 1.0, 1e-3, 3.0e38, -7.5],
        [1.0, -big, 1e-3, 3.0e38, 2.5],
        [-big, 1.0, 3e-8, -3.0e38, 0.1],
        [1.0, big, -1e-3, -3.0e38, 1e-6],
        [1.0, 1.0, 5e-4, 3.0e38, -0.3],
        [big, -1.0, 7e-9, -3.0e38, 1e5],
        [1.0, -big, 1e-3, 1.0, -1e5],
        [-big, 1.0, -2e-3, 2.0, 3.3],
    ]
    return [torch.tensor(r, dtype=torch.float32) for r in rows]


SIZES = [3, 1, 1]


def _reduce(rank, world_size, contributions):
    per_rank = V // world_size
    mine = contributions[rank * per_rank : (rank + 1) * per_rank]
    return exact_all_reduce(get_process_group(), mine, SIZES, V)


def _float_sums_in_orders(contributions):
    """float32 sums of the same contributions in a few orders (what a float all-reduce may do)."""
    orders = [range(V), reversed(range(V)), [0, 2, 4, 6, 1, 3, 5, 7], [7, 0, 6, 1, 5, 2, 4, 3]]
    sums = []
    for order in orders:
        total = torch.zeros(5, dtype=torch.float32)
        for i in order:
            total = total + contributions[i]
        sums.append(total)
    return sums


def test_the_values_are_adversarial_a_float_sum_depends_on_the_order():
    sums = _float_sums_in_orders(_adversarial())
    assert any(not torch.equal(sums[0], s) for s in sums[1:])


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_the_sum_has_the_same_bits_on_every_rank_and_world_size(world_size):
    contributions = _adversarial()
    reference = run_threaded(_reduce, 1, contributions, timeout_s=30)[0]
    results = run_threaded(_reduce, world_size, contributions, timeout_s=30)
    for r in results:
        assert r.dtype == torch.float32
        assert torch.equal(r.view(torch.int32), reference.view(torch.int32))


def test_the_sum_is_the_exact_sum_rounded_and_nothing_overflows():
    contributions = _adversarial()
    result = run_threaded(_reduce, 4, contributions, timeout_s=30)[0]
    exact = [sum(Fraction(float(c[i])) for c in contributions) for i in range(5)]
    # Element 0 and 1 are exact small integers; element 3 sums +-3e38 (near float32's max) to 3.
    assert result[0].item() == float(exact[0]) and result[1].item() == float(exact[1])
    assert result[3].item() == pytest.approx(float(exact[3]), rel=0, abs=2.0**-20 * 3.0e38 * 2**-30)
    # The rest: the exact sum of the contributions rounded to the segment's grid (2**-s: half a
    # step each), then rounded to float32.
    exponents = _canonical_exponents(contributions).tolist()
    for i, s in ((2, exponents[0]), (4, exponents[2])):
        on_grid = V * Fraction(2) ** (-s - 1)
        assert abs(Fraction(result[i].item()) - exact[i]) <= on_grid + abs(exact[i]) * Fraction(2) ** -23


def test_scales_leave_room_for_every_contribution():
    exps = scale_exponents(torch.tensor([3.0e38, 1.0, 0.0, 1e-40], dtype=torch.float64), count=8)
    for m, s in zip([3.0e38, 1.0, 1e-40], [exps[0], exps[1], exps[3]]):
        assert 8 * m * 2.0 ** int(s) < 2.0**62
        assert 8 * m * 2.0 ** int(s) >= 2.0**58  # and use the room, but for a band of 4 bits
    assert int(exps[2]) == 0  # a zero segment


def test_scales_stay_put_within_a_band_of_16x():
    """The exponent changes only when the maximum crosses a power of 16: so the last step's
    exponents are this step's while the gradients' scale drifts (one collective per sum)."""
    maxima = torch.tensor([2.0**-4, 0.07, 0.5, 0.99, 1.0, 1.5, 15.9], dtype=torch.float64)
    exps = scale_exponents(maxima, count=8).tolist()
    assert exps[:4] == [exps[0]] * 4 and exps[4:] == [exps[4]] * 3 and exps[4] == exps[0] - 4


def _reduce_with_nan(rank, world_size):
    mine = [torch.tensor([1.0, 2.0, float("nan") if rank == 1 else 3.0])]
    return exact_all_reduce(get_process_group(), mine, [1, 2], world_size)


def test_a_non_finite_segment_comes_back_nan_and_the_others_exact():
    for r in run_threaded(_reduce_with_nan, 2, timeout_s=30):
        assert r[0].item() == 2.0 and torch.isnan(r[1:]).all()


def _reduce_with_guess(rank, world_size, contributions, guess):
    """ExactAllReducer's one-collective path with ``guess`` as the previous exponents."""
    per_rank = V // world_size
    mine = contributions[rank * per_rank : (rank + 1) * per_rank]
    reducer = ExactAllReducer(SIZES)
    if guess is not None:
        reducer.exponents = torch.tensor(guess, dtype=torch.int64)
    extra = torch.tensor([rank + 1], dtype=torch.int64)
    values, extra = reducer.all_reduce(get_process_group(), mine, V, extra)
    return values.to(torch.float32), int(extra[0]), reducer.fallbacks


def _random_contributions(seed):
    g = torch.Generator().manual_seed(seed)
    scales = torch.tensor([1e-3, 1.0, 1e4, 1e-30, 1.0])
    return [torch.randn(5, generator=g) * scales for _ in range(V)]


def _lossy_contributions(seed):
    """Segment 0 holds values 1e-14 of its largest: off the canonical grid (they round)."""
    g = torch.Generator().manual_seed(seed)
    scales = torch.tensor([1e3, 1e-11, 3.0, 1.0, 1e-20])
    return [torch.randn(5, generator=g) * scales for _ in range(V)]


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_a_guessed_scale_gives_the_canonical_bits_or_falls_back(world_size):
    """Whatever exponents the reducer guesses (too fine: overflow; too coarse: lossy; right), the
    result has the bits of the two-collective sum; a right guess takes one collective."""
    for contributions in (_adversarial(), _random_contributions(0), _random_contributions(1), _lossy_contributions(0)):
        canonical = run_threaded(_reduce, 1, contributions, timeout_s=30)[0]
        right = _canonical_exponents(contributions)
        near = [(right + d).tolist() for d in (-4, -2, -1, 1, 2)]  # coarser, misaligned, finer
        for guess in (None, [0, 0, 0], [200, 200, 200], [-50, 30, 100], [10, 10, 10], *near):
            for values, extra, _ in run_threaded(_reduce_with_guess, world_size, contributions, guess, timeout_s=30):
                assert torch.equal(values.view(torch.int32), canonical.view(torch.int32)), guess
                assert extra == world_size * (world_size + 1) // 2  # the extra ints summed once


def _canonical_exponents(contributions):
    max_abs = torch.stack([c.abs() for c in contributions]).amax(0).to(torch.float64)
    return scale_exponents(torch.stack([max_abs[:3].max(), max_abs[3], max_abs[4]]), V)


@pytest.mark.parametrize("make", [_random_contributions, _lossy_contributions])
def test_the_last_sums_exponents_take_one_collective_even_off_the_grid(make):
    """The reducer keeps the canonical exponents; the next sum's values (same scale, other
    values) fit them in one collective, also when tiny values round on the grid."""
    guess = _canonical_exponents(make(2)).tolist()
    contributions = make(3)
    assert _canonical_exponents(contributions).tolist() == guess  # the same bands
    canonical = run_threaded(_reduce, 1, contributions, timeout_s=30)[0]
    for values, _, fallbacks in run_threaded(_reduce_with_guess, 2, contributions, guess, timeout_s=30):
        assert fallbacks == 0
        assert torch.equal(values.view(torch.int32), canonical.view(torch.int32))


@pytest.mark.parametrize("exponents", [[0, 0, 0], [20, 20, 20], [20, 40, 100], [60, 3, 90]])
def test_the_float32_grid_check_gives_the_float64_checks_sums_and_misfits(exponents):
    """``_fixed_checked`` works in float32 when it can (exponents 0..100); its misfit counts must be
    the float64 path's (fed the same values as float64), and so must its sum where nothing misfits
    (with a misfit anywhere every rank discards the sums and takes the two-collective path)."""
    g = torch.Generator().manual_seed(sum(exponents))
    reducer = ExactAllReducer([3, 1, 2])
    reducer.exponents = torch.tensor(exponents, dtype=torch.int64)
    compared = 0
    for values in (
        [torch.randn(6, generator=g) * 1e-3 for _ in range(4)],  # mostly off the grid
        [torch.round(torch.randn(6, generator=g) * 2.0**10) / 2.0**10 for _ in range(4)],  # on the grid
        [torch.tensor([1.0, float("nan"), 2.0, 3.0, float("inf"), 2.0**70]) for _ in range(2)],
    ):
        narrow = reducer._fixed_checked(values, 8)
        wide = reducer._fixed_checked([v.to(torch.float64) for v in values], 8)
        assert torch.equal(narrow[1], wide[1]), (narrow, wide)
        assert narrow[1].any() or torch.equal(narrow[0], wide[0]), (narrow, wide)
        compared += not narrow[1].any()
    assert compared == (exponents == [20, 20, 20])  # the on-grid values fit that grid


def test_scratch_kept_between_sums_never_leaks_into_the_next():
    """A reducer keeps its conversion's scratch tensors between sums: a later sum (fewer rows, the
    other dtype, rows that overflow) must come out as a fresh reducer's."""
    g = torch.Generator().manual_seed(3)
    kept = ExactAllReducer([5, 3])
    kept.exponents = torch.tensor([30, 40], dtype=torch.int64)
    sums = [
        torch.randn(4, 8, generator=g),
        torch.randn(2, 8, generator=g),  # fewer rows than the scratch holds
        torch.randn(3, 8, generator=g, dtype=torch.float64),
        torch.tensor([[float("nan"), 1.0, 2.0, 3.0, 4.0, 2.0**70, 1.0, 1.0]]),  # overflows
        torch.randn(4, 8, generator=g),
    ]
    for rows in sums:
        fresh = ExactAllReducer([5, 3])
        fresh.exponents = kept.exponents
        got, expected = kept._fixed_checked(rows, 8), fresh._fixed_checked(rows.clone(), 8)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
        if not got[1][0].any():  # without overflow: the exact sum of each row's rounding
            wide = torch.round(rows.to(torch.float64) * 2.0 ** torch.tensor([30.0] * 5 + [40.0] * 3))
            assert torch.equal(got[0], wide.to(torch.int64).sum(dim=0))
