"""ddptrain.testing.threaded: the in-process group behaves like a real backend, failures included.

The collectives' values are held to the full comm suite (tests/dist/test_comm_collectives.py runs
it on "threaded" worlds of 1, 2, 3 and 8 ranks); here: asynchrony, mismatches, timeouts, failures.
"""

import threading
import time

import pytest
import torch

import ddptrain.comm as dist
from ddptrain.comm import CommError, CommTimeoutError
from ddptrain.launch import LaunchTimeoutError
from ddptrain.testing import PeerFailedError, ThreadedProcessGroup, ThreadedWorld, run_threaded

pytestmark = pytest.mark.timeout(60)


def test_each_thread_sees_its_own_rank_and_default_group():
    def body(rank, ws):
        return dist.is_initialized(), dist.get_rank(), dist.get_world_size(), dist.get_backend()

    assert run_threaded(body, 3) == [(True, r, 3, "threaded") for r in range(3)]
    assert not dist.is_initialized()  # the calling thread has no default group


def test_a_collective_returns_before_its_peers_arrive():
    rank1_may_go = threading.Event()

    def body(rank, ws):
        group = dist.get_process_group()
        t = torch.tensor([rank + 1.0])
        if rank == 0:
            work = group.all_reduce(t)
            early = work.is_completed()
            rank1_may_go.set()
            work.wait()
            return early, t.item()
        assert rank1_may_go.wait(10)
        group.all_reduce(t).wait()
        return None, t.item()

    assert run_threaded(body, 2) == [(False, 3.0), (None, 3.0)]


def test_inputs_are_taken_when_called_not_when_the_last_rank_arrives():
    def body(rank, ws):
        t = torch.tensor([float(rank)])
        work = dist.get_process_group().all_reduce(t.clone())
        t.fill_(100.0)  # changing the caller's copy after the call must not matter
        work.wait()
        return work.outputs[0].item()

    assert run_threaded(body, 3) == [3.0, 3.0, 3.0]


def test_mismatched_shapes_fail_every_rank_and_list_each_call():
    def body(rank, ws):
        group = dist.get_process_group()
        group.all_reduce(torch.zeros(3 + rank)).wait()

    with pytest.raises(CommError) as info:
        run_threaded(body, 3)
    text = str(info.value)
    assert "mismatched collectives" in text
    for rank in range(3):
        assert f"rank {rank}: all_reduce(SUM, shape ({3 + rank},) float32)" in text


def test_a_rank_that_skips_a_collective_is_named_when_its_peers_time_out():
    def body(rank, ws):
        if rank != 1:
            dist.get_process_group().all_reduce(torch.ones(1)).wait()

    started = time.monotonic()
    with pytest.raises(CommTimeoutError, match=r"Rank\(s\) \[1\] never arrived at this all_reduce"):
        run_threaded(body, 3, comm_timeout_s=0.5)
    assert time.monotonic() - started < 10


def test_the_failing_ranks_own_error_is_raised_and_its_waiting_peers_are_released():
    def body(rank, ws):
        if rank == 2:
            raise ValueError("bad batch on rank 2")
        dist.get_process_group().barrier().wait()  # would wait for rank 2 until the comm timeout

    started = time.monotonic()
    with pytest.raises(ValueError, match="bad batch on rank 2") as info:
        run_threaded(body, 3, comm_timeout_s=30)
    assert time.monotonic() - started < 10
    assert any("rank 2 of 3" in note for note in getattr(info.value, "__notes__", [])) or not hasattr(
        info.value, "add_note"
    )


def test_peers_of_a_failed_rank_get_peer_failed_errors():
    world = ThreadedWorld(2, timeout=30)
    group = ThreadedProcessGroup(world, 0)
    work = group.all_reduce(torch.ones(1))
    world.abort("rank 1 failed with RuntimeError: boom")
    with pytest.raises(PeerFailedError, match="rank 1 failed"):
        work.wait()
    with pytest.raises(PeerFailedError):
        group.all_reduce(torch.ones(1)).wait()


def test_a_stuck_rank_is_reported_with_where_it_was():
    release = threading.Event()

    def wait_forever_in_user_code(rank, ws):
        if rank == 1:
            release.wait(30)

    try:
        with pytest.raises(LaunchTimeoutError) as info:
            run_threaded(wait_forever_in_user_code, 2, timeout_s=1.0)
    finally:
        release.set()
    assert "rank(s) [1] did not finish within 1 s" in str(info.value)
    assert "wait_forever_in_user_code" in str(info.value)


def test_point_to_point_in_both_orders_and_by_tag():
    def body(rank, ws):
        group = dist.get_process_group()
        if rank == 0:
            group.send(torch.tensor([1.0]), 1, tag=7)
            group.send(torch.tensor([2.0]), 1, tag=8)
            return None
        late, early = torch.zeros(1), torch.zeros(1)
        w8 = group.recv(late, 0, tag=8)
        w7 = group.recv(early, 0, tag=7)
        w8.wait()
        w7.wait()
        return early.item(), late.item()

    assert run_threaded(body, 2)[1] == (1.0, 2.0)


def test_destroyed_group_refuses_use():
    group = ThreadedProcessGroup(ThreadedWorld(1), 0)
    group.destroy()
    with pytest.raises(dist.GroupError, match="after it was destroyed"):
        group.all_reduce(torch.ones(1))
