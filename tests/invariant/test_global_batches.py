"""Shards by sample position (world-size-invariant mode): the same shards for every world size, each
sample of an epoch exactly once, rank r of W on virtual ranks r*V/W .. (r+1)*V/W - 1."""

import pytest
import torch

from ddptrain.data import DistributedSampler
from ddptrain.data.global_batches import (
    epoch_order,
    shard_bounds,
    shards_of_step,
    valid_world_sizes,
    virtual_ranks_of,
)


def test_rank_r_of_w_takes_a_contiguous_block_of_virtual_ranks():
    assert [list(virtual_ranks_of(r, 2, 8)) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [list(virtual_ranks_of(r, 4, 8)) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert list(virtual_ranks_of(0, 1, 8)) == list(range(8))


def test_a_world_size_that_does_not_divide_v_is_refused_naming_both_and_the_valid_sizes():
    with pytest.raises(ValueError) as err:
        virtual_ranks_of(0, 3, 8)
    assert "W=3" in str(err.value) and "V=8" in str(err.value) and "[1, 2, 4, 8]" in str(err.value)
    assert valid_world_sizes(12) == [1, 2, 3, 4, 6, 12]


def test_spread_shares_any_v_over_any_w_covering_each_virtual_rank_once():
    """Elastic jobs: whoever is present computes the virtual ranks, shares differing by at most one."""
    assert [list(virtual_ranks_of(r, 3, 8, spread=True)) for r in range(3)] == [[0, 1], [2, 3, 4], [5, 6, 7]]
    for v in (1, 5, 8, 12):
        for w in range(1, 2 * v + 1):
            shares = [virtual_ranks_of(r, w, v, spread=True) for r in range(w)]
            assert [i for share in shares for i in share] == list(range(v)), (v, w)
            assert max(map(len, shares)) - min(map(len, shares)) <= 1, (v, w)
    assert list(virtual_ranks_of(1, 2, 8, spread=True)) == list(virtual_ranks_of(1, 2, 8))  # W | V: the same


def test_shard_bounds_cover_the_batch_in_order_with_near_equal_sizes():
    assert shard_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert shard_bounds(3, 5) == [(0, 1), (1, 2), (2, 3), (3, 3), (3, 3)]  # fewer samples than shards
    sizes = [end - start for start, end in shard_bounds(128, 8)]
    assert sizes == [16] * 8


def _epoch(world_size, dataset_len=100, batch=24, accum=2, v=4, start=0):
    """{step start: {shard index: (start, end)}} over all ranks of ``world_size``."""
    steps: dict = {}
    for rank in range(world_size):
        position, walked = start, []
        while position < dataset_len:  # the epoch, step by step, as GlobalBatchSteps.batches walks it
            n = min(batch, dataset_len - position)
            walked.append(shards_of_step(position, n, accum, v, virtual_ranks_of(rank, world_size, v)))
            position += n
        for s in walked:
            shards = steps.setdefault((s.start, s.num_samples, s.num_shards), {})
            for shard in s.shards:
                assert shard.index not in shards  # each shard on one rank only
                shards[shard.index] = (shard.start, shard.end)
    return steps


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_shards_are_the_same_whatever_the_world_size(world_size):
    assert _epoch(world_size) == _epoch(1)


def test_every_sample_of_the_epoch_once_and_the_last_step_short():
    steps = _epoch(2)
    positions = sorted(p for shards in steps.values() for start, end in shards.values() for p in range(start, end))
    assert positions == list(range(100))
    assert sorted((start, n) for start, n, _ in steps) == [(0, 24), (24, 24), (48, 24), (72, 24), (96, 4)]
    assert all(len(shards) == 8 for shards in steps.values())  # accum 2 x V 4


def test_a_resumed_epoch_continues_at_the_global_position():
    assert _epoch(4, start=48) == {k: v for k, v in _epoch(1).items() if k[0] >= 48}


def test_the_epoch_order_is_the_samplers_before_its_split():
    sampler = DistributedSampler(50, num_replicas=1, rank=0, seed=7)
    sampler.set_epoch(3)
    assert epoch_order(50, 7, 3).tolist() == sampler.epoch_indices()
    assert torch.equal(epoch_order(5, 7, 3, shuffle=False), torch.arange(5))
