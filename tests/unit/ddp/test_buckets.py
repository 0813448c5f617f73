"""Bucket assignment and planning are pure functions: check them against hand-computed layouts."""

import dataclasses

import pytest
import torch

from ddptrain.ddp.buckets import (
    FlatRun,
    GradBucket,
    InPlace,
    ParamSpec,
    Slot,
    allocate,
    assign_buckets,
    plan_buckets,
)

F32 = (torch.float32, "cpu")
F64 = (torch.float64, "cpu")
CPU = torch.device("cpu")


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


# -- plan_buckets -------------------------------------------------------------------------------
def _specs(*numels, dtype=torch.float32):
    return [ParamSpec((n,), dtype, CPU) for n in numels]


def test_plan_places_parameters_at_consecutive_offsets():
    specs = [ParamSpec((2, 3), torch.float32, CPU), ParamSpec((4,), torch.float32, CPU)]
    plan = plan_buckets(specs, [[1, 0]], in_place_min_bytes=None)
    (bucket,) = plan.buckets
    assert bucket.params == (1, 0) and bucket.offsets == (0, 4) and bucket.shapes == ((4,), (2, 3))
    assert bucket.numel == 10 and bucket.nbytes == 40
    assert plan.slots == (Slot(0, 1, False), Slot(0, 0, False))
    assert plan.assignment == [[1, 0]]


def test_without_in_place_each_bucket_travels_as_one_flat_run():
    plan = plan_buckets(_specs(1000, 3, 5000), [[2, 1], [0]], in_place_min_bytes=None)
    assert [b.transfers for b in plan.buckets] == [(FlatRun(0, 5003),), (FlatRun(0, 1000),)]
    assert not any(s.in_place for s in plan.slots)


def test_large_gradients_go_in_place_and_small_runs_stay_contiguous():
    # bytes: 40, 400, 4, 8, 800, 4 with the threshold at 400 bytes
    plan = plan_buckets(_specs(10, 100, 1, 2, 200, 1), [[0, 1, 2, 3, 4, 5]], in_place_min_bytes=400)
    (bucket,) = plan.buckets
    assert bucket.offsets == (0, 10, 110, 111, 113, 313)
    assert bucket.transfers == (FlatRun(0, 10), InPlace(1), FlatRun(110, 113), InPlace(4), FlatRun(313, 314))
    assert [s.in_place for s in plan.slots] == [False, True, False, False, True, False]


def test_threshold_counts_bytes_not_elements():
    # 100 float64 elements = 800 bytes; 100 float32 = 400 bytes
    specs = [ParamSpec((100,), torch.float64, CPU), ParamSpec((100,), torch.float32, CPU)]
    plan = plan_buckets(specs, [[0], [1]], in_place_min_bytes=800)
    assert plan.buckets[0].transfers == (InPlace(0),)
    assert plan.buckets[1].transfers == (FlatRun(0, 100),)


def test_every_gradient_in_place_and_edge_runs():
    plan = plan_buckets(_specs(4, 4), [[0, 1]], in_place_min_bytes=0)
    assert plan.buckets[0].transfers == (InPlace(0), InPlace(1))
    plan = plan_buckets(_specs(1, 400, 1), [[0, 1, 2]], in_place_min_bytes=1600)
    assert plan.buckets[0].transfers == (FlatRun(0, 1), InPlace(1), FlatRun(401, 402))


def test_transfers_cover_each_bucket_exactly_once():
    specs = _specs(*[(7 * i) % 300 + 1 for i in range(40)])
    assignment = assign_buckets([s.nbytes for s in specs], [F32] * 40, cap_bytes=2000)
    plan = plan_buckets(specs, assignment, in_place_min_bytes=600)
    for b in plan.buckets:
        covered = []
        for t in b.transfers:
            if isinstance(t, FlatRun):
                covered += range(t.start, t.stop)
            else:
                off = b.offsets[t.position]
                covered += range(off, off + specs[b.params[t.position]].numel)
        assert covered == list(range(b.numel))


def test_plan_is_immutable_and_checks_the_assignment():
    plan = plan_buckets(_specs(4, 4), [[1, 0]], in_place_min_bytes=None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.buckets[0].index = 3
    with pytest.raises(ValueError, match=r"parameters \[1\] are in no bucket"):
        plan_buckets(_specs(4, 4), [[0]], in_place_min_bytes=None)
    with pytest.raises(ValueError, match="is empty"):
        plan_buckets(_specs(4), [[0], []], in_place_min_bytes=None)


# -- buffers -----------------------------------------------------------------------------------
def test_allocate_views_alias_the_flat_buffer():
    params = [torch.nn.Parameter(torch.randn(2, 3)), torch.nn.Parameter(torch.randn(4))]
    plan = plan_buckets([ParamSpec.of(p) for p in params], [[1, 0]], in_place_min_bytes=None)
    (flat,) = allocate(plan)
    assert flat.buffer.numel() == 10 and torch.all(flat.buffer == 0)
    flat.views[1].fill_(7.0)  # parameter 0 sits after parameter 1
    assert torch.all(flat.buffer[4:] == 7.0) and flat.views[1].shape == (2, 3)
    assert flat.run(FlatRun(4, 10)).data_ptr() == flat.views[1].data_ptr()


def test_grad_bucket_shows_the_flat_buffer_to_hooks():
    params = [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2))]
    plan = plan_buckets([ParamSpec.of(p) for p in params], [[0, 1]], in_place_min_bytes=None)
    (flat,) = allocate(plan)
    gb = GradBucket(0, flat, params, is_last=True, process_group=None)
    assert gb.index() == 0 and gb.is_last() and gb.parameters() == params
    gb.set_buffer(torch.arange(5.0))
    assert gb.buffer().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert [g.tolist() for g in gb.gradients()] == [[0.0, 1.0, 2.0], [3.0, 4.0]]
