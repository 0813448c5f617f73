"""DataPartitioner: the tutorial's behaviour, disjoint partitions, clear validation."""

from random import Random

import pytest

from ddptrain.data import DataPartitioner, Partition, partition_dataset


def tutorial_partitions(data_len, sizes, seed):
    """The tutorial's algorithm, written out independently."""
    rng = Random()
    rng.seed(seed)
    indexes = list(range(data_len))
    rng.shuffle(indexes)
    parts = []
    for frac in sizes:
        part_len = int(frac * data_len)
        parts.append(indexes[:part_len])
        indexes = indexes[part_len:]
    return parts


def test_matches_tutorial_algorithm():
    data = list(range(1000))
    partitioner = DataPartitioner(data)  # default sizes (0.7, 0.2, 0.1), seed 1234
    assert partitioner.partitions == tutorial_partitions(1000, [0.7, 0.2, 0.1], 1234)
    assert [len(p) for p in partitioner.partitions] == [700, 200, 100]


def test_partitions_are_disjoint_and_map_to_data():
    data = [f"item{i}" for i in range(103)]
    world_size = 4
    partitioner = DataPartitioner(data, [1 / world_size] * world_size, seed=7)
    seen = []
    for rank in range(world_size):
        part = partitioner.use(rank)
        assert isinstance(part, Partition)
        assert len(part) == int(103 / 4)
        seen += [part[i] for i in range(len(part))]
    assert len(seen) == len(set(seen)) == 4 * 25
    assert set(seen) <= set(data)


def test_deterministic_across_instances_and_seed_dependent():
    data = list(range(500))
    a = DataPartitioner(data, [0.5, 0.5], seed=3)
    b = DataPartitioner(data, [0.5, 0.5], seed=3)
    c = DataPartitioner(data, [0.5, 0.5], seed=4)
    assert a.partitions == b.partitions
    assert a.partitions != c.partitions


def test_thirds_sum_to_one_within_tolerance():
    partitioner = DataPartitioner(list(range(30)), [1 / 3] * 3)
    assert [len(p) for p in partitioner.partitions] == [10, 10, 10]


@pytest.mark.parametrize("sizes", [[0.5, 0.0], [0.5, -0.1], [float("nan")], []])
def test_rejects_non_positive_sizes(sizes):
    with pytest.raises(ValueError, match="sizes"):
        DataPartitioner(list(range(10)), sizes)


def test_rejects_sizes_summing_above_one_and_names_them():
    with pytest.raises(ValueError, match=r"\[0\.6, 0\.5\].*1\.1"):
        DataPartitioner(list(range(10)), [0.6, 0.5])


def test_use_out_of_range_is_clear():
    partitioner = DataPartitioner(list(range(10)), [0.5, 0.5])
    with pytest.raises(IndexError, match="2 partitions"):
        partitioner.use(2)


def test_partition_dataset_gives_equal_disjoint_shares():
    data = list(range(60))
    shares = [partition_dataset(data, rank, 3) for rank in range(3)]
    assert [len(s) for s in shares] == [20, 20, 20]
    union = [s[i] for s in shares for i in range(len(s))]
    assert sorted(union) == data
    with pytest.raises(ValueError, match="rank"):
        partition_dataset(data, 3, 3)
