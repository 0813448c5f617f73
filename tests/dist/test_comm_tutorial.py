"""The tutorial's own examples, run through ``import ddptrain.comm as dist`` on 2 and 3 processes.

The example functions below are copied from the tutorial (/work/shared/seed, sections 0x04-0x07)
unchanged apart from their names (the tutorial calls several of them ``run``). They report their
results with ``print``, so the test body captures what they print and also returns the tensors;
the parent checks both against values computed here.

On 3 processes the point-to-point examples run on ranks 0 and 1 only: the tutorial's code sends
from rank 0 and makes *every* other rank receive from it, so a third rank would wait forever
(as it would under torch.distributed). The ``new_group([0, 1])`` example runs on every rank, as
in torch: rank 2 must be refused clearly when it uses a group it is not a member of.

The collectives of the tutorial's list have no code in the tutorial; ``collectives_example`` calls
each one with exactly the signature the list gives.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import re

import pytest
import torch

import ddptrain.comm as dist
from tests.dist.shared_launch import launch_once

WORLD_SIZES = [2, 3]
# every example on gloo (spawned workers) and on mpi (ranks started by mpiexec)
WORLDS = [(backend, size) for backend in ("gloo", "mpi") for size in WORLD_SIZES]
# The tests of one world share one pytest-xdist worker (scripts/test.sh runs --dist loadgroup), so
# launch_once launches it once.
world_param = pytest.mark.parametrize(
    "backend, size",
    [pytest.param(b, n, id=f"{b}-{n}", marks=pytest.mark.xdist_group(f"tutorial-{b}-{n}")) for b, n in WORLDS],
)
LAUNCH_TIMEOUT_S = 120

pytestmark = [pytest.mark.dist, pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)]


# ------------------------------------------------------------------------------------------------
# The tutorial's code, verbatim apart from the function names.
# ------------------------------------------------------------------------------------------------
"""Blocking point-to-point communication."""


def run_blocking_p2p(rank, size):
    tensor = torch.zeros(1)
    if rank == 0:
        tensor += 1
        # Send the tensor to process 1
        dist.send(tensor=tensor, dst=1)
    else:
        # Receive tensor from process 0
        dist.recv(tensor=tensor, src=0)
    print("Rank ", rank, " has data ", tensor[0])


"""Non-blocking point-to-point communication."""


def run_nonblocking_p2p(rank, size):
    tensor = torch.zeros(1)
    req = None
    if rank == 0:
        tensor += 1
        # Send the tensor to process 1
        req = dist.isend(tensor=tensor, dst=1)
        print("Rank 0 started sending")
    else:
        # Receive tensor from process 0
        req = dist.irecv(tensor=tensor, src=0)
        print("Rank 1 started receiving")
    req.wait()
    print("Rank ", rank, " has data ", tensor[0])


""" All-Reduce example."""


def run_all_reduce_group(rank, size):
    """Simple collective communication."""
    group = dist.new_group([0, 1])
    tensor = torch.ones(1)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    print("Rank ", rank, " has data ", tensor[0])


""" Gradient averaging. """


def average_gradients(model):
    size = float(dist.get_world_size())
    for param in model.parameters():
        dist.all_reduce(param.grad.data, op=dist.ReduceOp.SUM)
        param.grad.data /= size


""" Implementation of a ring-reduce with addition. """


def allreduce(send, recv):
    rank = dist.get_rank()
    size = dist.get_world_size()
    send_buff = send.clone()
    recv_buff = send.clone()
    accum = send.clone()

    left = ((rank - 1) + size) % size
    right = (rank + 1) % size

    for i in range(size - 1):
        if i % 2 == 0:
            # Send send_buff
            send_req = dist.isend(send_buff, right)
            dist.recv(recv_buff, left)
            accum[:] += recv_buff[:]
        else:
            # Send recv_buff
            send_req = dist.isend(recv_buff, right)
            dist.recv(send_buff, left)
            accum[:] += send_buff[:]
        send_req.wait()
    recv[:] = accum[:]


# ------------------------------------------------------------------------------------------------
# The tutorial's list of collectives, each called with the signature the list gives.
# ------------------------------------------------------------------------------------------------
def collectives_example(rank, size):
    group = dist.new_group(list(range(size)))
    out = {}
    tensor = torch.tensor([float(rank + 1), 10.0 * (rank + 1)])
    dist.broadcast(tensor, 1, group)  # dist.broadcast(tensor, src, group)
    out["broadcast"] = tensor
    tensor = torch.tensor([float(rank + 1), 10.0 * (rank + 1)])
    dist.reduce(tensor, 0, dist.ReduceOp.SUM, group)  # dist.reduce(tensor, dst, op, group)
    out["reduce"] = tensor
    for op in ["SUM", "PRODUCT", "MAX", "MIN"]:  # dist.all_reduce(tensor, op, group), the 4 ops listed
        tensor = torch.tensor([float(rank + 1), -2.0 * (rank + 1)])
        dist.all_reduce(tensor, getattr(dist.ReduceOp, op), group)
        out["all_reduce", op] = tensor
    tensor = torch.zeros(2)
    scatter_list = [torch.tensor([100.0 + i, 200.0 + i]) for i in range(size)] if rank == 0 else None
    dist.scatter(tensor, scatter_list, 0, group)  # dist.scatter(tensor, scatter_list, src, group)
    out["scatter"] = tensor
    tensor = torch.tensor([float(rank), float(rank * rank)])
    gather_list = [torch.zeros(2) for _ in range(size)] if rank == size - 1 else None
    dist.gather(tensor, gather_list, size - 1, group)  # dist.gather(tensor, gather_list, dst, group)
    out["gather"] = gather_list
    tensor_list = [torch.zeros(2) for _ in range(size)]
    dist.all_gather(tensor_list, torch.tensor([float(rank), -float(rank)]), group)  # (tensor_list, tensor, group)
    out["all_gather"] = tensor_list
    dist.barrier(group)  # dist.barrier(group)
    out["barrier"] = True
    return out


# ------------------------------------------------------------------------------------------------
# Harness
# ------------------------------------------------------------------------------------------------
def _printed(fn, *args):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        fn(*args)
    return buf.getvalue()


def _data_for(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)


def _model():
    torch.manual_seed(1234)  # as the tutorial's run(): same initial weights on every rank
    return torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _local_grads(model, rank):
    x, y = _data_for(rank)
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def _body(rank: int, size: int) -> bytes:
    out = {}
    if rank < 2:  # see the module docstring
        out["p2p_printed"] = _printed(run_blocking_p2p, rank, size)
        out["nonblocking_printed"] = _printed(run_nonblocking_p2p, rank, size)
    try:
        out["group_printed"] = _printed(run_all_reduce_group, rank, size)
    except Exception as exc:  # noqa: BLE001 - rank 2 of 3 must be refused; the parent checks how
        out["group_error"] = (type(exc).__name__, str(exc))
    out["collectives"] = collectives_example(rank, size)

    model = _model()
    out["local_grads"] = _local_grads(model, rank)
    average_gradients(model)
    out["averaged_grads"] = [p.grad.clone() for p in model.parameters()]

    # a few steps of the tutorial's synchronous SGD loop (data made up instead of MNIST)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    for step in range(3):
        x, y = _data_for(rank + 10 * step)
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        average_gradients(model)
        optimizer.step()
    out["trained_params"] = [p.detach().clone() for p in model.parameters()]

    send = torch.arange(10, dtype=torch.float32) * (rank + 1) + rank
    recv = torch.zeros(10)
    allreduce(send, recv)
    out["tutorial_ring"] = (send, recv)
    t = torch.arange(10, dtype=torch.float32) * (rank + 1) + rank
    dist.ring_all_reduce(t)
    out["ddptrain_ring"] = t
    t = torch.arange(1001, dtype=torch.int64) * (rank + 1)  # chunks of unequal length
    dist.ring_all_reduce(t)
    out["ddptrain_ring_uneven"] = t
    return pickle.dumps(out)


def world(backend, size):
    return launch_once(("tutorial", backend, size), _body, size, backend=backend, timeout_s=LAUNCH_TIMEOUT_S)


def _has_data(printed: str, rank: int, value: float) -> bool:
    # print('Rank ', rank, ' has data ', tensor[0]) -> "Rank  1  has data  tensor(1.)"
    m = re.search(rf"Rank\s+{rank}\s+has data\s+tensor\(([-0-9.e]+)\)", printed)
    return m is not None and float(m.group(1)) == value


@world_param
def test_blocking_send_recv(backend, size):
    res = world(backend, size)
    for rank in (0, 1):
        assert _has_data(res[rank]["p2p_printed"], rank, 1.0), res[rank]["p2p_printed"]


@world_param
def test_isend_irecv_wait(backend, size):
    res = world(backend, size)
    assert "Rank 0 started sending" in res[0]["nonblocking_printed"]
    assert "Rank 1 started receiving" in res[1]["nonblocking_printed"]
    for rank in (0, 1):
        assert _has_data(res[rank]["nonblocking_printed"], rank, 1.0), res[rank]["nonblocking_printed"]


@world_param
def test_all_reduce_on_new_group_0_1(backend, size):
    res = world(backend, size)
    for rank in (0, 1):
        assert "group_error" not in res[rank], res[rank]["group_error"]
        assert _has_data(res[rank]["group_printed"], rank, 2.0), res[rank]["group_printed"]
    if size == 3:  # rank 2 called new_group like everyone, then used a group it is not in
        assert "group_printed" not in res[2], "rank 2 printed a result for a group it is not a member of"
        name, msg = res[2]["group_error"]
        assert name == "GroupError"
        assert "all_reduce" in msg and "rank 2 is not a member of group [0, 1]" in msg, msg


@world_param
def test_each_collective_of_the_list(backend, size):
    res = world(backend, size)
    ranks = range(size)
    for rank in ranks:
        c = res[rank]["collectives"]
        torch.testing.assert_close(c["broadcast"], torch.tensor([2.0, 20.0]))
        if rank == 0:
            torch.testing.assert_close(
                c["reduce"], torch.tensor([sum(r + 1.0 for r in ranks), sum(10.0 * (r + 1) for r in ranks)])
            )
        vals = torch.stack([torch.tensor([r + 1.0, -2.0 * (r + 1)]) for r in ranks])
        torch.testing.assert_close(c["all_reduce", "SUM"], vals.sum(0))
        torch.testing.assert_close(c["all_reduce", "PRODUCT"], vals.prod(0))
        torch.testing.assert_close(c["all_reduce", "MAX"], vals.amax(0))
        torch.testing.assert_close(c["all_reduce", "MIN"], vals.amin(0))
        torch.testing.assert_close(c["scatter"], torch.tensor([100.0 + rank, 200.0 + rank]))
        if rank == size - 1:
            assert [g.tolist() for g in c["gather"]] == [[float(r), float(r * r)] for r in ranks]
        else:
            assert c["gather"] is None
        assert [g.tolist() for g in c["all_gather"]] == [[float(r), -float(r)] for r in ranks]
        assert c["barrier"] is True


@world_param
def test_average_gradients(backend, size):
    res = world(backend, size)
    # recompute every rank's gradients here and average them
    expected_local = [_local_grads(_model(), r) for r in range(size)]
    expected = [torch.stack(gs).mean(0) for gs in zip(*expected_local)]
    for rank in range(size):
        for got, exp in zip(res[rank]["local_grads"], expected_local[rank]):
            torch.testing.assert_close(got, exp)
        for got, exp in zip(res[rank]["averaged_grads"], expected):
            torch.testing.assert_close(got, exp)
    # the ranks really had different gradients, and all hold the same average afterwards
    assert not torch.allclose(res[0]["local_grads"][0], res[1]["local_grads"][0])
    for rank in range(1, size):
        for a, b in zip(res[0]["averaged_grads"], res[rank]["averaged_grads"]):
            assert torch.equal(a, b)


@world_param
def test_synchronous_sgd_keeps_replicas_identical(backend, size):
    res = world(backend, size)
    # the same 3 steps on one process, averaging gradients by hand
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    for step in range(3):
        grads = []
        for r in range(size):
            x, y = _data_for(r + 10 * step)
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, gs in zip(model.parameters(), zip(*grads)):
            p.grad = torch.stack(gs).mean(0)
        optimizer.step()
    for rank in range(size):
        for a, b in zip(res[rank]["trained_params"], res[0]["trained_params"]):
            assert torch.equal(a, b), f"rank {rank} diverged from rank 0"
        for got, exp in zip(res[rank]["trained_params"], model.parameters()):
            torch.testing.assert_close(got, exp.detach())


@world_param
def test_ring_allreduce_tutorial_and_ddptrain(backend, size):
    res = world(backend, size)
    expected = sum(torch.arange(10, dtype=torch.float32) * (r + 1) + r for r in range(size))
    expected_uneven = sum(torch.arange(1001, dtype=torch.int64) * (r + 1) for r in range(size))
    for rank in range(size):
        send, recv = res[rank]["tutorial_ring"]
        torch.testing.assert_close(recv, expected, rtol=0, atol=0)
        torch.testing.assert_close(send, torch.arange(10, dtype=torch.float32) * (rank + 1) + rank)  # untouched
        torch.testing.assert_close(res[rank]["ddptrain_ring"], expected, rtol=0, atol=0)
        assert torch.equal(res[rank]["ddptrain_ring_uneven"], expected_uneven)
