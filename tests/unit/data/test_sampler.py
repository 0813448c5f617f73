"""DistributedSampler: torch's arithmetic, padding, set_epoch warning, exact resume."""

import itertools
import warnings

import pytest
import torch
import torch.utils.data.distributed as torch_dist_sampler
from torch.utils.data import DataLoader, TensorDataset

from ddptrain.data import DistributedSampler


def samplers(n, world_size, **kw):
    return [DistributedSampler(n, num_replicas=world_size, rank=r, **kw) for r in range(world_size)]


def epoch_lists(n, world_size, epoch=0, **kw):
    out = []
    for s in samplers(n, world_size, **kw):
        s.set_epoch(epoch)
        out.append(list(s))
    return out


@pytest.mark.parametrize("n,world_size", [(100, 4), (101, 4), (7, 3), (2, 5), (1, 1)])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_same_indices_as_torch(n, world_size, drop_last, shuffle):
    dataset = list(range(n))
    if drop_last and n < world_size:
        # torch silently gives every rank nothing; we refuse.
        assert len(torch_dist_sampler.DistributedSampler(dataset, world_size, 0, drop_last=True)) == 0
        with pytest.raises(ValueError, match="0 samples"):
            DistributedSampler(dataset, world_size, 0, drop_last=True)
        return
    for rank in range(world_size):
        ours = DistributedSampler(dataset, world_size, rank, shuffle=shuffle, seed=5, drop_last=drop_last)
        ref = torch_dist_sampler.DistributedSampler(
            dataset, world_size, rank, shuffle=shuffle, seed=5, drop_last=drop_last
        )
        for epoch in (0, 3):
            ours.set_epoch(epoch)
            ref.set_epoch(epoch)
            assert list(ours) == list(ref)
            assert len(ours) == len(ref)


def test_drop_last_covers_every_index_exactly_once_when_divisible():
    lists = epoch_lists(120, 4, drop_last=True)
    union = list(itertools.chain.from_iterable(lists))
    assert sorted(union) == list(range(120))


def test_drop_last_never_repeats_and_drops_less_than_world_size():
    lists = epoch_lists(103, 4, drop_last=True)
    union = list(itertools.chain.from_iterable(lists))
    assert len(union) == len(set(union)) == 100
    assert all(s.num_padded() == 0 for s in samplers(103, 4, drop_last=True))


def test_padding_is_counted_and_only_repeats():
    n, world_size = 10, 4  # 12 slots, 2 duplicates
    group = samplers(n, world_size)
    lists = [list(s) for s in group]
    union = list(itertools.chain.from_iterable(lists))
    assert set(union) == set(range(n))
    assert sum(s.num_padded() for s in group) == 2 == len(union) - n
    real = [i for s, lst in zip(group, lists) for pos, i in enumerate(lst) if not s.padding_mask()[pos]]
    assert sorted(real) == list(range(n))
    tails = [[False] * 3] * 2 + [[False, False, True]] * 2  # ranks 2 and 3 repeat samples 0 and 1
    assert [s.padding_mask().tolist() for s in group] == tails


def test_padding_mask_gives_exact_eval_reduction():
    n, world_size = 23, 5
    values = torch.arange(n, dtype=torch.float64) ** 2
    total = 0.0
    count = 0
    for s in samplers(n, world_size, shuffle=False):
        keep = ~s.padding_mask()
        mine = values[torch.tensor(list(s))]
        total += float(mine[keep].sum())
        count += int(keep.sum())
    assert count == n
    assert total == float(values.sum())


def test_padding_when_fewer_samples_than_ranks():
    group = samplers(2, 5, shuffle=False)
    assert [list(s) for s in group] == [[0], [1], [0], [1], [0]]
    assert [s.num_padded() for s in group] == [0, 0, 1, 1, 1]


def test_new_order_each_epoch_and_same_union():
    n, world_size = 64, 4
    first = epoch_lists(n, world_size, epoch=0, seed=11)
    second = epoch_lists(n, world_size, epoch=1, seed=11)
    assert first != second
    for lists, epoch in ((first, 0), (second, 1)):
        interleaved = [lists[p % world_size][p // world_size] for p in range(n)]
        g = torch.Generator().manual_seed(11 + epoch)
        assert interleaved == torch.randperm(n, generator=g).tolist()


def test_order_is_independent_of_rank_count():
    # The epoch's global order is one permutation; ranks only interleave it.
    two = epoch_lists(48, 2, epoch=2)
    three = epoch_lists(48, 3, epoch=2)
    g2 = [two[p % 2][p // 2] for p in range(48)]
    g3 = [three[p % 3][p // 3] for p in range(48)]
    assert g2 == g3


def test_warns_once_when_set_epoch_is_forgotten():
    s = DistributedSampler(50, 2, 0, shuffle=True)
    list(s)
    with pytest.warns(UserWarning, match=r"set_epoch\(epoch\)"):
        list(s)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(s)  # only once


def test_no_warning_with_set_epoch_or_without_shuffle():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = DistributedSampler(50, 2, 0, shuffle=True)
        for epoch in range(3):
            s.set_epoch(epoch)
            list(s)
        t = DistributedSampler(50, 2, 0, shuffle=False)
        list(t)
        list(t)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_replicas=2, rank=2), r"rank 2.*\[0, 1\]"),
        (dict(num_replicas=2, rank=-1), r"rank -1"),
        (dict(num_replicas=0, rank=0), r"num_replicas.*>= 1, got 0"),
    ],
)
def test_invalid_ranks_are_clear(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DistributedSampler(10, **kwargs)


def test_too_small_dataset_with_drop_last_is_clear():
    with pytest.raises(ValueError, match=r"3 samples and num_replicas=4.*0 samples"):
        DistributedSampler(3, 4, 0, drop_last=True)


def consume(sampler, k):
    it = iter(sampler)
    return [next(it) for _ in range(k)]


@pytest.mark.parametrize("drop_last", [False, True])
def test_mid_epoch_resume_yields_exactly_the_rest(drop_last):
    n, world_size = 101, 4
    for rank in range(world_size):
        s = DistributedSampler(n, world_size, rank, seed=3, drop_last=drop_last)
        s.set_epoch(5)
        full = s.epoch_indices()
        head = consume(s, 9)
        state = s.state_dict()
        assert state["consumed"] == 9 and state["epoch"] == 5 and state["version"] == 1

        resumed = DistributedSampler(n, world_size, rank, seed=3, drop_last=drop_last)
        resumed.load_state_dict(state)
        resumed.set_epoch(5)  # the usual loop calls set_epoch with the restored epoch
        tail = list(resumed)
        assert head + tail == full
        assert resumed.consumed == len(full)

        resumed.set_epoch(6)  # the next epoch starts fresh
        fresh = DistributedSampler(n, world_size, rank, seed=3, drop_last=drop_last)
        fresh.set_epoch(6)
        assert list(resumed) == list(fresh)


def test_resume_at_end_of_epoch_yields_nothing():
    s = DistributedSampler(20, 2, 1)
    list(s)
    resumed = DistributedSampler(20, 2, 1)
    resumed.load_state_dict(s.state_dict())
    assert list(resumed) == []


def test_any_ranks_state_resumes_every_rank():
    # Trainers often save rank 0's state only; positions are equal on all ranks.
    group = samplers(40, 4)
    for s in group:
        consume(s, 3)
    state = group[0].state_dict()
    for rank in range(4):
        r = DistributedSampler(40, 4, rank)
        r.load_state_dict(state)
        assert list(r) == group[rank].epoch_indices()[3:]


def test_advance_reports_trained_samples_despite_prefetch():
    dataset = TensorDataset(torch.arange(64))
    s = DistributedSampler(dataset, 2, 0, seed=1)
    loader = DataLoader(dataset, batch_size=4, sampler=s)
    seen = []
    for step, (batch,) in enumerate(loader):
        seen += batch.tolist()
        s.advance(len(batch))
        if step == 2:
            break
    assert s.consumed == 12
    r = DistributedSampler(dataset, 2, 0, seed=1)
    r.load_state_dict(s.state_dict())
    rest = [i for (b,) in DataLoader(dataset, batch_size=4, sampler=r) for i in b.tolist()]
    assert seen + rest == s.epoch_indices()


def test_manual_count_starts_from_resume_point():
    s = DistributedSampler(64, 2, 0)
    s.load_state_dict({**s.state_dict(), "consumed": 10})
    it = iter(s)
    [next(it) for _ in range(8)]  # fetched ahead
    s.advance(4)
    assert s.consumed == 14
    s.set_consumed(20)
    assert s.state_dict()["consumed"] == 20
    with pytest.raises(ValueError, match=r"\[0, 32\]"):
        s.set_consumed(33)


def test_stale_iterator_does_not_move_new_epoch():
    s = DistributedSampler(30, 3, 0)
    it = iter(s)
    next(it)
    s.set_epoch(1)
    next(it)
    assert s.consumed == 0


def test_refuses_world_size_change_by_default():
    s = DistributedSampler(100, 4, 0)
    consume(s, 5)
    t = DistributedSampler(100, 2, 0)
    expected = r"saved with 4 rank\(s\), not 2.*num_replicas=4.*allow_world_size_change=True"
    with pytest.raises(ValueError, match=expected):
        t.load_state_dict(s.state_dict())


def test_refuses_other_dataset_or_order():
    s = DistributedSampler(100, 2, 0)
    with pytest.raises(ValueError, match=r"100 samples.*has 90"):
        DistributedSampler(90, 2, 0).load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match=r"seed: saved 0, here 9"):
        DistributedSampler(100, 2, 0, seed=9).load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match="version"):
        DistributedSampler(100, 2, 0).load_state_dict({**s.state_dict(), "version": 99})


@pytest.mark.parametrize("old_ws,new_ws,consumed", [(4, 2, 5), (4, 3, 5), (2, 3, 7), (3, 4, 0)])
def test_world_size_change_resumes_from_global_position(old_ws, new_ws, consumed):
    n = 97
    old = samplers(n, old_ws, seed=2)
    for s in old:
        s.set_epoch(1)
    done = [i for s in old for i in consume(s, consumed)]
    state = old[0].state_dict()

    new = samplers(n, new_ws, seed=2)
    rest, real_rest = [], []
    for s in new:
        s.load_state_dict(state, allow_world_size_change=True)
        start = (consumed * old_ws) // new_ws
        assert s.epoch == 1 and s.consumed == start
        mine = list(s)
        assert mine == s.epoch_indices()[start:]
        rest += mine
        real_rest += [i for p, i in enumerate(mine, start) if not s.padding_mask()[p]]
    assert set(done + rest) == set(range(n))  # nothing skipped
    repeats = len(done) + len(real_rest) - n
    assert 0 <= repeats < new_ws


def test_world_size_change_at_end_of_epoch_stays_finished():
    old = DistributedSampler(10, 4, 0)
    list(old)
    new = DistributedSampler(10, 3, 0)
    new.load_state_dict(old.state_dict(), allow_world_size_change=True)
    assert list(new) == []


def test_rank_and_world_size_default_to_the_current_group_as_in_torch():
    from ddptrain.testing import run_threaded

    def body(rank, world_size):
        sampler = DistributedSampler(range(10))
        return sampler.num_replicas, sampler.rank, list(sampler)

    results = run_threaded(body, 3)
    assert [(n, r) for n, r, _ in results] == [(3, 0), (3, 1), (3, 2)]
    assert [idx for _, _, idx in results] == [list(DistributedSampler(range(10), 3, r)) for r in range(3)]


def test_torch_distributed_group_is_used_when_ddptrain_has_none(tmp_path):
    import torch.distributed as tdist

    tdist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        sampler = DistributedSampler(range(4))
    finally:
        tdist.destroy_process_group()
    assert (sampler.num_replicas, sampler.rank) == (1, 0)


def test_no_group_and_no_ranks_is_a_clear_error():
    with pytest.raises(
        ValueError, match=r"takes them from the current process group, and there is none.*num_replicas="
    ):
        DistributedSampler(range(4))


def test_a_version_1_state_written_by_an_earlier_ddptrain_still_resumes():
    # Literally what checkpoints hold (rank 1's state; any rank's state resumes every rank).
    saved = {
        "version": 1,
        "epoch": 2,
        "seed": 3,
        "num_replicas": 4,
        "rank": 1,
        "shuffle": True,
        "drop_last": False,
        "dataset_len": 50,
        "consumed": 6,
    }
    s = DistributedSampler(50, 4, 2, seed=3)
    s.load_state_dict(saved)
    s.set_epoch(2)
    g = torch.Generator().manual_seed(3 + 2)
    order = torch.randperm(50, generator=g).tolist()
    order += order[:2]  # 52 slots for 50 samples
    assert list(s) == order[2::4][6:]
    assert s.state_dict() == {**saved, "rank": 2, "consumed": 13}


def test_another_epoch_set_after_a_resume_starts_at_its_beginning():
    s = DistributedSampler(40, 2, 0)
    s.set_epoch(3)
    consume(s, 5)
    resumed = DistributedSampler(40, 2, 0)
    resumed.load_state_dict(s.state_dict())
    resumed.set_epoch(4)  # the restored position belongs to epoch 3 only
    assert resumed.consumed == 0
    assert list(resumed) == resumed.epoch_indices()
