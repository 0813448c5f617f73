"""Bucket assignment is a pure function: check it against hand-computed layouts."""

import pytest
import torch

from ddptrain.ddp.buckets import assign_buckets, make_buckets

F32 = (torch.float32, "cpu")
F64 = (torch.float64, "cpu")


def test_fills_to_cap_then_reverses():
    sizes = [4, 4, 4, 4, 4]
    assert assign_buckets(sizes, [F32] * 5, cap_bytes=8) == [[4], [2, 3], [0, 1]]


def test_zero_cap_gives_one_bucket_per_parameter():
    assert assign_buckets([4, 8, 4], [F32] * 3, cap_bytes=0) == [[2], [1], [0]]


def test_large_parameter_gets_its_own_bucket():
    assert assign_buckets([4, 100, 4], [F32] * 3, cap_bytes=8) == [[2], [0, 1]]


def test_dtypes_never_share_a_bucket():
    buckets = assign_buckets([4, 8, 4, 8], [F32, F64, F32, F64], cap_bytes=1000)
    assert sorted(map(sorted, buckets)) == [[0, 2], [1, 3]]
    for b in buckets:
        assert len({[F32, F64, F32, F64][i] for i in b}) == 1


def test_rebuild_order_and_small_first_bucket():
    order = [3, 2, 1, 0]
    got = assign_buckets([4] * 4, [F32] * 4, cap_bytes=100, first_cap_bytes=4, order=order, reverse=False)
    assert got == [[3], [2, 1, 0]]


def test_negative_cap_is_refused():
    with pytest.raises(ValueError, match="bucket cap must be >= 0"):
        assign_buckets([4], [F32], cap_bytes=-1)


def test_make_buckets_views_alias_the_flat_buffer():
    params = [torch.nn.Parameter(torch.randn(2, 3)), torch.nn.Parameter(torch.randn(4))]
    (bucket,) = make_buckets(params, [[1, 0]])
    assert bucket.buffer.numel() == 10 and bucket.offsets == [0, 4]
    bucket.views[1].fill_(7.0)  # parameter 0 sits after parameter 1
    assert torch.all(bucket.buffer[4:] == 7.0) and bucket.views[1].shape == (2, 3)


def test_segments_split_a_bucket_into_direct_tensors_and_runs_of_small_ones():
    from ddptrain.ddp.reducer import _segments

    assert _segments([]) == []
    assert _segments([True]) == [None]
    assert _segments([False]) == [0]
    # a run of small gradients starts with the position of its last member; the rest are "in-run"
    assert _segments([False, False, True, False]) == [1, "in-run", None, 3]
    assert _segments([True, False, False, False, True]) == [None, 3, "in-run", "in-run", None]
    assert _segments([False, True, True, False, False]) == [0, None, None, 4, "in-run"]
