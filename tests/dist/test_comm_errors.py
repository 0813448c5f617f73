"""Bad input to ``ddptrain.comm`` and ``ddptrain.launch``: each gives a clear error, fast, never a hang.

Every test asserts on the message text (the rule broken and the actual values), and on the time
it took where a timeout is involved. Whatever can run in this process does (world size 1 gloo
groups, rendezvous with a missing peer); the rest shares as few spawned launches as possible.
"""

from __future__ import annotations

import errno
import os
import pickle
import signal
import socket
import time

import pytest
import torch

import ddptrain.comm as dist
from ddptrain.comm import CommTimeoutError, GroupError, RendezvousError
from ddptrain.launch import LaunchTimeoutError, WorkerFailedError, find_free_port, launch
from ddptrain.testing import run_distributed
from tests.dist.shared_launch import launch_once

# timed: its tests bound durations (scripts/test.sh runs this phase after the parallel one)
pytestmark = [pytest.mark.timed, pytest.mark.timeout(90)]


@pytest.fixture(autouse=True)
def _no_group_left_behind():
    """Each in-process test starts and ends with the functional API uninitialised, whatever it did."""
    if dist.is_initialized():  # left behind by some other test module: not ours to judge here
        dist.destroy_process_group()
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def tcp_url() -> str:
    return f"tcp://127.0.0.1:{find_free_port()}"


def init_single(**kwargs):
    return dist.init_process_group("gloo", init_method=tcp_url(), rank=0, world_size=1, timeout=10, **kwargs)


# -- using the API wrongly ----------------------------------------------------------------------
def test_api_before_init_says_to_call_init():
    assert dist.get_rank() == -1 and dist.get_world_size() == -1  # as torch.distributed outside a job
    for name, call in [
        ("all_reduce", lambda: dist.all_reduce(torch.ones(1))),
        ("broadcast", lambda: dist.broadcast(torch.ones(1), 0)),
        ("barrier", lambda: dist.barrier()),
        ("send", lambda: dist.send(torch.ones(1), 0)),
        ("new_group", lambda: dist.new_group([0])),
        ("get_process_group", lambda: dist.get_process_group()),
        ("get_store", lambda: dist.get_store()),
        ("ring_all_reduce", lambda: dist.ring_all_reduce(torch.ones(1))),
    ]:
        with pytest.raises(GroupError) as info:
            call()
        msg = str(info.value)
        assert name in msg and "not initialised" in msg and "init_process_group" in msg, msg


def test_init_twice_is_refused_and_the_first_group_survives():
    first = init_single()
    with pytest.raises(GroupError, match=r"init_process_group called twice.*destroy_process_group\(\) first"):
        init_single()
    assert dist.get_process_group() is first
    t = torch.tensor([3.0])
    dist.all_reduce(t)
    assert t.item() == 3.0


@pytest.mark.parametrize("scheme", ["tcp", "file", "env"])
def test_rank_out_of_range(scheme, tmp_path, monkeypatch):
    if scheme == "tcp":
        url, kwargs = tcp_url(), {"rank": 2, "world_size": 2}
    elif scheme == "file":
        url, kwargs = f"file://{tmp_path}/store", {"rank": 2, "world_size": 2}
    else:
        url, kwargs = "env://", {}
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(find_free_port()))
        monkeypatch.setenv("RANK", "2")
        monkeypatch.setenv("WORLD_SIZE", "2")
    t0 = time.monotonic()
    with pytest.raises(RendezvousError) as info:
        dist.init_process_group("gloo", init_method=url, timeout=10, **kwargs)
    assert time.monotonic() - t0 < 2
    msg = str(info.value)
    assert "rank 2 is out of range for world_size 2" in msg and "0 to 1" in msg and url in msg, msg


def test_zero_world_size():
    with pytest.raises(RendezvousError, match="world_size must be at least 1, got 0"):
        dist.init_process_group("gloo", init_method=tcp_url(), rank=0, world_size=0, timeout=5)


def test_port_already_in_use():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(RendezvousError) as info:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=10)
        assert time.monotonic() - t0 < 3
    msg = str(info.value)
    assert f"127.0.0.1:{port}" in msg and "already in use" in msg and "MASTER_PORT" in msg, msg


def test_port_already_in_use_env(monkeypatch):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for name, value in [
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", str(port)),
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
        ]:
            monkeypatch.setenv(name, value)
        with pytest.raises(RendezvousError, match=rf"cannot listen on 127\.0\.0\.1:{port}.*already in use"):
            dist.init_process_group("gloo", timeout=10)


def test_env_init_names_the_missing_variables(monkeypatch):
    for name in ["MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"]:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RendezvousError, match="needs WORLD_SIZE in the environment"):
        dist.init_process_group("gloo", timeout=5)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(RendezvousError, match="needs MASTER_ADDR and MASTER_PORT"):
        dist.init_process_group("gloo", timeout=5)


def test_unknown_backend_lists_the_available_ones():
    with pytest.raises(ValueError) as info:
        dist.init_process_group("glo", init_method=tcp_url(), rank=0, world_size=1, timeout=5)
    msg = str(info.value)
    assert "unknown backend 'glo'" in msg and "gloo, mpi, nccl" in msg, msg
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="available backends: gloo, mpi, nccl"):
        dist.create_backend("ucc", None, 0, 1, None)


def test_unknown_backend_is_reported_before_the_rendezvous():
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="unknown backend"):
        dist.init_process_group("glo", init_method=tcp_url(), rank=0, world_size=2, timeout=2)
    assert time.monotonic() - t0 < 1


def test_unknown_init_method_and_bad_urls():
    with pytest.raises(
        RendezvousError, match=r"unknown init_method 'udp://x:1'.*env://, tcp://HOST:PORT or file:///PATH"
    ):
        dist.init_process_group("gloo", init_method="udp://x:1", rank=0, world_size=1)
    with pytest.raises(RendezvousError, match=r"must look like tcp://HOST:PORT"):
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1", rank=0, world_size=1)


def test_bad_timeout_values():
    with pytest.raises(ValueError, match="timeout must be positive, got -1"):
        dist.init_process_group("gloo", init_method=tcp_url(), rank=0, world_size=1, timeout=-1)
    with pytest.raises(TypeError, match="timeout must be seconds or a datetime.timedelta, got str"):
        dist.init_process_group("gloo", init_method=tcp_url(), rank=0, world_size=1, timeout="10")


def test_file_init_in_a_missing_directory():
    t0 = time.monotonic()
    with pytest.raises(RendezvousError) as info:
        dist.init_process_group(
            "gloo", init_method="file:///nonexistent-ddptrain-dir/sub/store", rank=0, world_size=1, timeout=5
        )
    assert time.monotonic() - t0 < 2
    msg = str(info.value)
    assert (
        "'/nonexistent-ddptrain-dir/sub' does not exist" in msg and "file:///nonexistent-ddptrain-dir/sub/store" in msg
    )


def test_file_init_in_a_read_only_place():
    # tests run as root, for whom permission bits do not apply: sysfs refuses new files to root too
    path = "/sys/kernel/ddptrain-store"
    try:
        os.close(os.open(path, os.O_RDWR | os.O_CREAT))
        os.unlink(path)
        pytest.skip(f"{path} is writable here")
    except OSError as exc:
        if exc.errno == errno.ENOENT:  # see the /proc test below
            pytest.skip(f"creating {path} fails with ENOENT here")
    t0 = time.monotonic()
    with pytest.raises(RendezvousError) as info:
        dist.init_process_group(
            "gloo", init_method="file:///sys/kernel/ddptrain-store", rank=0, world_size=1, timeout=5
        )
    assert time.monotonic() - t0 < 2
    msg = str(info.value)
    assert "file:///sys/kernel/ddptrain-store" in msg and ("not writable" in msg or "Permission denied" in msg), msg


def _init_on_proc(rank, ws):
    t0 = time.monotonic()
    try:
        dist.init_process_group("gloo", init_method="file:///proc/ddptrain-store", rank=0, world_size=1, timeout=2)
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc), time.monotonic() - t0
    dist.destroy_process_group()
    return "no error", "", time.monotonic() - t0


@pytest.mark.dist
@pytest.mark.timeout(40)
def test_file_init_where_the_file_cannot_be_created_fails_fast():
    name, msg, elapsed = launch(_init_on_proc, 1, backend=None, timeout_s=8)[0]
    assert name == "RendezvousError" and "file:///proc/ddptrain-store" in msg, (name, msg)
    assert elapsed < 4


# -- a rank that never joins -------------------------------------------------------------------
@pytest.mark.parametrize("scheme", ["tcp", "file", "env"])
def test_rank_that_never_joins_times_out_with_the_count(scheme, tmp_path, monkeypatch):
    timeout_s = 1.5
    if scheme == "tcp":
        url = tcp_url()
    elif scheme == "file":
        url = f"file://{tmp_path}/store"
    else:
        url = "env://"
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(find_free_port()))
    t0 = time.monotonic()
    with pytest.raises(CommTimeoutError) as info:
        dist.init_process_group("gloo", init_method=url, rank=0, world_size=3, timeout=timeout_s)
    elapsed = time.monotonic() - t0
    assert timeout_s - 0.1 <= elapsed < timeout_s + 2, elapsed
    msg = str(info.value)
    for part in [
        f"init_method={url!r}",
        "expected world size 3",
        "1 rank(s) arrived",
        "missing rank(s) [1, 2]",
        "1.5 s",
    ]:
        assert part in msg, (part, msg)
    assert not dist.is_initialized()


def test_rank_whose_master_never_listens_times_out():
    url, timeout_s = tcp_url(), 1  # nobody listens on that port
    t0 = time.monotonic()
    with pytest.raises(CommTimeoutError) as info:
        dist.init_process_group("gloo", init_method=url, rank=1, world_size=2, timeout=timeout_s)
    elapsed = time.monotonic() - t0
    # torch's TCPStore reconnect back-off overshoots (a 2 s timeout takes ~5 s); bound it loosely
    assert elapsed < timeout_s + 3, elapsed
    msg = str(info.value)
    port = url.rsplit(":", 1)[1]
    assert f"127.0.0.1:{port}" in msg and "world_size=2" in msg and "rank 0 never started listening" in msg, msg


# -- destroyed groups --------------------------------------------------------------------------
def test_collective_on_a_destroyed_group():
    world = init_single()
    sub = dist.new_group([0])
    t = torch.ones(2)
    dist.all_reduce(t, group=sub)
    dist.destroy_process_group(sub)
    with pytest.raises(GroupError, match=r"all_reduce on process group 'group1' after it was destroyed"):
        dist.all_reduce(t, group=sub)
    with pytest.raises(GroupError, match=r"broadcast on process group 'group1' after it was destroyed"):
        sub.broadcast(t, 0)
    with pytest.raises(GroupError, match="after it was destroyed"):
        dist.ring_all_reduce(t, group=sub)
    dist.all_reduce(t)  # the world group is unaffected
    dist.destroy_process_group()
    with pytest.raises(GroupError, match=r"all_reduce on process group 'world' after it was destroyed"):
        world.all_reduce(t)
    with pytest.raises(GroupError, match=r"barrier on process group 'world' after it was destroyed"):
        world.barrier()
    with pytest.raises(GroupError, match="default process group is not initialised"):
        dist.all_reduce(t)
    # and initialising again works
    init_single()
    dist.all_reduce(t)


# -- errors that need several ranks: one launch for the cheap ones ----------------------------------
def _mismatches_body(rank: int, ws: int) -> bytes:
    out = {}

    def capture(key, fn):
        t0 = time.monotonic()
        try:
            fn()
            out[key] = ("no error", "", time.monotonic() - t0)
        except Exception as exc:  # noqa: BLE001
            out[key] = (type(exc).__name__, str(exc), time.monotonic() - t0)

    capture("sizes", lambda: dist.all_reduce(torch.ones(rank + 1)))
    capture("dtypes", lambda: dist.all_reduce(torch.ones(4, dtype=torch.float64 if rank == 1 else torch.float32)))
    capture("ops", lambda: dist.all_reduce(torch.ones(4), op=dist.ReduceOp.MAX if rank == 2 else dist.ReduceOp.SUM))
    capture("collectives", lambda: dist.broadcast(torch.ones(4), 0) if rank == 0 else dist.all_reduce(torch.ones(4)))
    capture("roots", lambda: dist.broadcast(torch.ones(4), rank % 2))
    t = torch.full((3,), float(rank))
    dist.all_reduce(t)  # the group still works after every mismatch
    out["after"] = t.tolist()

    # a rank that skips a collective: the others time out, naming the operation
    short = dist.new_group(list(range(ws)), timeout=2)
    if rank != ws - 1:
        capture("skipped", lambda: dist.all_reduce(torch.ones(4), group=short))
    # ... and when the skipped collective is a broadcast, the error must say broadcast
    dist.barrier()  # new_group's timeout also bounds its creation: line the ranks up first
    short_b = dist.new_group(list(range(ws)), timeout=1)
    if rank != ws - 1:
        capture("skipped_broadcast", lambda: dist.broadcast(torch.ones(4), 0, group=short_b))

    # async_op=True returns before the peers arrive (torch semantics), so this overlap works in torch
    dist.barrier()
    short_o = dist.new_group(list(range(ws)), timeout=1)

    def overlap():
        # With the argument check on, an async call first waits for its peers (see
        # api._check_uniform); code that overlaps it with p2p runs with the check off.
        from ddptrain.comm import api

        previous, api._state.check_collectives = api._state.check_collectives, False
        x = torch.ones(2)
        if rank == 0:
            work = dist.all_reduce(x, group=short_o, async_op=True)
            dist.send(torch.ones(1), 1, group=short_o)
            work.wait()
        elif rank == 1:
            dist.recv(torch.zeros(1), 0, group=short_o)
            dist.all_reduce(x, group=short_o, async_op=True).wait()
        else:
            dist.all_reduce(x, group=short_o)
        api._state.check_collectives = previous
        if x.tolist() != [3.0, 3.0]:
            raise AssertionError(f"overlapped all_reduce gave {x.tolist()}")

    capture("async_overlap", overlap)
    dist.barrier()

    # Work.wait(timeout=...) shorter than the group's
    short2 = dist.new_group(list(range(ws)), timeout=2)
    if rank == 0:
        work = short2.all_reduce(torch.ones(4))  # nobody else joins
        capture("wait_timeout", lambda: work.wait(timeout=0.5))
    dist.barrier()
    t = torch.ones(1)
    dist.all_reduce(t)
    out["after_timeout"] = t.item()
    return pickle.dumps(out)


BACKENDS = ["gloo", "mpi"]  # mpi: the ranks are started by mpiexec
backend_param = pytest.mark.parametrize("backend", BACKENDS)


def mismatch_results(backend):
    """Per-rank results of the one 3-rank launch per backend shared by the tests below.

    With the synchronous check (``DDPTRAIN_CHECK_COLLECTIVES=sync``): every mismatch raises before
    it reaches the backend, so the group keeps working after each. The default ledger check is
    tested with the backends' own failures in ``test_hang_forensics.py``."""
    return launch_once(
        ("mismatches", backend),
        _mismatches_body,
        3,
        backend=backend,
        timeout_s=60,
        comm_timeout_s=30,
        env={"DDPTRAIN_CHECK_COLLECTIVES": "sync"},
    )


@pytest.mark.dist
@backend_param
def test_all_reduce_of_different_sizes_lists_every_rank(backend):
    for rank, out in enumerate(mismatch_results(backend)):
        name, msg, elapsed = out["sizes"]
        assert name == "ValueError", (rank, name, msg)
        for r in range(3):
            assert f"rank {r}: all_reduce of {r + 1} elements" in msg, msg
        assert "same size" in msg and elapsed < 10
        assert out["after"] == [3.0, 3.0, 3.0]


@pytest.mark.dist
@backend_param
def test_mismatched_dtypes_ops_collectives_and_roots(backend):
    for _rank, out in enumerate(mismatch_results(backend)):
        name, msg, _ = out["dtypes"]
        assert (
            name == "ValueError"
            and "rank 1: all_reduce of 4 elements, dtype torch.float64" in msg
            and "rank 0: all_reduce of 4 elements, dtype torch.float32" in msg
        ), msg
        name, msg, _ = out["ops"]
        assert name == "ValueError" and "op/root" in msg, msg
        name, msg, _ = out["collectives"]
        assert name == "ValueError" and "rank 0: broadcast" in msg and "rank 1: all_reduce" in msg, msg
        name, msg, _ = out["roots"]
        assert name == "ValueError" and "rank 1: broadcast of 4 elements" in msg, msg


@pytest.mark.dist
@backend_param
def test_a_rank_skipping_a_collective_gives_a_timeout_naming_it(backend):
    results = mismatch_results(backend)
    for rank in (0, 1):
        name, msg, elapsed = results[rank]["skipped"]
        assert name == "CommTimeoutError", (rank, name, msg)
        assert "all_reduce" in msg and "timed out after 2 s" in msg, msg
        assert "Rank(s) [2] never arrived" in msg, msg  # found out through the store (gloo) or the peers (mpi)
        # the timeout, plus up to min(5 s, timeout) spent asking the store which ranks never arrived
        assert 1.9 <= elapsed < 8, elapsed
    assert all(out["after_timeout"] == 3.0 for out in results)


@pytest.mark.dist
@backend_param
def test_a_skipped_broadcast_is_named_broadcast(backend):
    for rank in (0, 1):
        name, msg, _ = mismatch_results(backend)[rank]["skipped_broadcast"]
        assert name == "CommTimeoutError" and msg.startswith("broadcast"), msg


@pytest.mark.dist
@backend_param
def test_async_op_returns_before_the_peers_arrive(backend):
    for rank, out in enumerate(mismatch_results(backend)):
        name, msg, elapsed = out["async_overlap"]
        assert name == "no error", (rank, name, msg)
        assert elapsed < 1.5, elapsed


@pytest.mark.dist
@backend_param
def test_work_wait_timeout_raises_in_time(backend):
    name, msg, elapsed = mismatch_results(backend)[0]["wait_timeout"]
    assert name == "CommTimeoutError" and "all_reduce" in msg, (name, msg)
    assert 0.4 <= elapsed < 2, elapsed


@pytest.mark.dist
@backend_param
def test_work_wait_timeout_message_gives_the_wait_timeout(backend):
    name, msg, _ = mismatch_results(backend)[0]["wait_timeout"]
    assert "0.5 s" in msg, msg


# -- the launcher: a failing, a killed and a stuck worker -------------------------------------------
def _rank_1_raises(rank, ws):
    if rank == 1:
        raise KeyError("the-missing-key-on-rank-1")
    time.sleep(60)  # rank 0 would go on for a minute: the launcher must stop it


def _rank_1_raises_rank_0_waits_for_it(rank, ws):
    if rank == 1:
        raise KeyError("the-missing-key-on-rank-1")
    dist.barrier()  # fails at once with "peer closed": rank 0 is a victim, not the cause


@pytest.mark.dist
@backend_param
def test_worker_that_raises_names_the_rank_with_its_traceback(backend):
    t0 = time.monotonic()
    with pytest.raises(WorkerFailedError) as info:
        run_distributed(_rank_1_raises, 2, backend=backend, timeout_s=40)
    assert time.monotonic() - t0 < 20, "the surviving rank was not stopped promptly"
    err = info.value
    assert err.rank == 1
    msg = str(err)
    assert "rank 1 failed: KeyError" in msg and "the-missing-key-on-rank-1" in msg, msg
    assert "_rank_1_raises" in err.worker_traceback and "Traceback" in err.worker_traceback
    assert "raise KeyError" in msg  # the traceback is in the message users see


@pytest.mark.dist
@backend_param
def test_the_failing_rank_is_blamed_not_the_peer_it_broke(backend):
    with pytest.raises(WorkerFailedError) as info:
        run_distributed(_rank_1_raises_rank_0_waits_for_it, 2, backend=backend, timeout_s=40)
    assert info.value.rank == 1, str(info.value)
    assert "the-missing-key-on-rank-1" in str(info.value)


def _rank_1_is_killed(rank, ws):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


@pytest.mark.dist
@backend_param
def test_worker_killed_by_sigkill_names_the_signal(backend):
    t0 = time.monotonic()
    with pytest.raises(WorkerFailedError) as info:
        run_distributed(_rank_1_is_killed, 2, backend=backend, timeout_s=40)
    assert time.monotonic() - t0 < 20
    err = info.value
    assert err.rank == 1 and err.exitcode == -signal.SIGKILL
    assert "rank 1" in str(err) and "killed by signal SIGKILL" in str(err), str(err)


def _sleeps(rank, ws):
    time.sleep(60)


@pytest.mark.dist
def test_stuck_job_is_killed_at_the_launch_timeout():
    t0 = time.monotonic()
    with pytest.raises(LaunchTimeoutError, match=r"did not finish within 3 s; rank\(s\) \[0\] still running"):
        launch(_sleeps, 1, timeout_s=3)
    assert time.monotonic() - t0 < 10
