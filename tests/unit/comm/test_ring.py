"""The ring all-reduce algorithm, on an in-memory group of threads (no processes, no sockets).

``FakeGroup`` implements the two operations the ring needs (``send``/``recv``) over per-pair
queues and counts what every rank sends, so these tests check, for world sizes 1-8 that the
multi-process suite cannot afford: the result of every op on every dtype against a local
reduction, lengths that do not divide evenly (chunks of length 0 included), in-place updates of
non-contiguous tensors, tag isolation, and the bandwidth-optimal message volume
(each chunk crosses the ring ``2(p-1)`` times: ``2(p-1)·N`` elements in all, ``2(p-1)`` messages a rank).
"""

from __future__ import annotations

import queue
import threading
import zlib
from collections import defaultdict
from datetime import timedelta

import pytest
import torch

from ddptrain.comm import GroupError, ReduceOp
from ddptrain.comm.process_group import ProcessGroup
from ddptrain.comm.ring import RING_TAG, ring_all_reduce
from ddptrain.comm.types import CompletedWork, Work

pytestmark = pytest.mark.timeout(120)


class Network:
    """Queues between every ordered pair of ranks, per tag, plus a log of what was sent."""

    def __init__(self):
        self.queues: dict = defaultdict(queue.Queue)
        self.lock = threading.Lock()
        self.sent = defaultdict(list)  # rank -> [numel of each message]

    def queue(self, src: int, dst: int, tag: int) -> queue.Queue:
        """The queue from ``src`` to ``dst`` for ``tag``, made under the lock: defaultdict's factory
        runs Python code, so a sender and its receiver creating one queue at once could each get
        their own, and the receiver would wait on a queue nobody fills."""
        with self.lock:
            return self.queues[(src, dst, tag)]


class _RecvWork(Work):
    def __init__(self, q, tensor):
        super().__init__("recv", [tensor])
        self._q, self._tensor, self._done = q, tensor, False

    def _wait(self, timeout):
        if not self._done:
            payload = self._q.get(timeout=10)
            assert payload.shape == self._tensor.shape, (payload.shape, self._tensor.shape)
            self._tensor.copy_(payload)
            self._done = True

    def is_completed(self):
        return self._done


class FakeGroup(ProcessGroup):
    backend = "fake"

    def __init__(self, net: Network, rank: int, size: int):
        super().__init__(rank, size, list(range(size)), timedelta(seconds=10))
        self.net = net

    def _send(self, tensor, dst, tag=0):
        self._check_peer(dst, "send", "dst")
        with self.net.lock:
            self.net.sent[self._rank].append(tensor.numel())
        self.net.queue(self._rank, dst, tag).put(tensor.clone())
        return CompletedWork("send", [tensor])

    def _recv(self, tensor, src, tag=0):
        self._check_peer(src, "recv", "src")
        return _RecvWork(self.net.queue(src, self._rank, tag), tensor)

    def _unused(self, *args, **kwargs):
        raise NotImplementedError("the ring must only use send/recv")

    _broadcast = _all_reduce = _reduce = _all_gather = _gather = _scatter = _unused
    _reduce_scatter = _all_to_all = _barrier = _new_subgroup = _unused


def run_ring(inputs, op, net=None):
    """Run ring_all_reduce on len(inputs) threads; return the tensors (reduced in place) and the network."""
    net = run_many([(inputs, op)], net or Network())
    return inputs, net


def run_many(cases, net=None):
    """Run several ring all-reduces one after another on the same p threads (one thread per rank)."""
    p = len(cases[0][0])
    net = net or Network()
    groups = [FakeGroup(net, r, p) for r in range(p)]
    errors = []

    def worker(r):
        for inputs, op in cases:
            try:
                returned = ring_all_reduce(groups[r], inputs[r], op)
            except BaseException as exc:  # noqa: BLE001
                errors.append((r, exc))
                return
            if returned is not inputs[r]:
                errors.append((r, AssertionError("ring_all_reduce must return the tensor it reduced in place")))

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(p)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "ring deadlocked"
    if errors:
        raise errors[0][1]
    return net


def expected(op: ReduceOp, tensors):
    dtype = tensors[0].dtype
    if dtype == torch.bool:
        s = torch.stack(tensors)
        return s.any(0) if op in (ReduceOp.SUM, ReduceOp.MAX) else s.all(0)
    if dtype.is_floating_point:
        s = torch.stack([t.double() for t in tensors])
    else:  # reduce in int64, then wrap to the dtype exactly like in-dtype arithmetic does
        s = torch.stack([t.long() for t in tensors])
    out = {
        ReduceOp.SUM: lambda: s.sum(0),
        ReduceOp.PRODUCT: lambda: s.prod(0),
        ReduceOp.MAX: lambda: s.amax(0),
        ReduceOp.MIN: lambda: s.amin(0),
        ReduceOp.AVG: lambda: s.sum(0) / len(tensors),
    }[op]()
    return out.to(dtype)


def make(rank, n, dtype, op):
    g = torch.Generator().manual_seed(zlib.crc32(f"{rank}/{n}/{dtype}/{op}".encode()))
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if op == ReduceOp.PRODUCT:  # +-1, +-2: products stay exact in float16/bfloat16
        vals = torch.randint(1, 3, (n,), generator=g) * (torch.randint(0, 2, (n,), generator=g) * 2 - 1)
    elif dtype == torch.uint8:
        vals = torch.randint(0, 30, (n,), generator=g)
    else:
        vals = torch.randint(-3, 4, (n,), generator=g)
    return vals.to(dtype)


DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
]


@pytest.mark.parametrize("p", range(1, 9))
def test_every_op_dtype_and_uneven_length(p):
    cases, wanted = [], []
    for dtype in DTYPES:
        for op in ReduceOp:
            if op is ReduceOp.AVG and not dtype.is_floating_point:
                continue
            for n in sorted({0, 1, max(p - 1, 1), p, p + 1, 37}):
                inputs = [make(r, n, dtype, op) for r in range(p)]
                wanted.append((f"p={p} {dtype} {op} n={n}", expected(op, [t.clone() for t in inputs])))
                cases.append((inputs, op))
    run_many(cases)
    failures = []
    for (inputs, _), (what, want) in zip(cases, wanted):
        for r, t in enumerate(inputs):
            if t.dtype != want.dtype or not torch.equal(t, want):
                failures.append(f"{what} rank {r}: {t.tolist()} != {want.tolist()}")
    assert not failures, "\n".join(failures[:20])


@pytest.mark.parametrize("p", [2, 3, 5, 8])
def test_random_floats_match_within_rounding(p):
    inputs = [torch.randn(1000, generator=torch.Generator().manual_seed(r), dtype=torch.float32) for r in range(p)]
    want = torch.stack([t.double() for t in inputs]).sum(0).float()
    got, _ = run_ring([t.clone() for t in inputs], ReduceOp.SUM)
    for t in got:
        torch.testing.assert_close(t, want, rtol=1e-5, atol=1e-5)
    # every rank holds bit-identical results: the reduced chunks are copied, not recomputed
    for t in got[1:]:
        assert torch.equal(t, got[0])


@pytest.mark.parametrize("p", [2, 3, 4, 7])
@pytest.mark.parametrize("n", [1, 5, 64, 1001])
def test_message_volume_is_bandwidth_optimal(p, n):
    inputs = [torch.ones(n) for _ in range(p)]
    _, net = run_ring(inputs, ReduceOp.SUM)
    total = sum(sum(sizes) for sizes in net.sent.values())
    assert total == 2 * (p - 1) * n, "each chunk must cross the ring exactly 2(p-1) times"
    chunk = -(-n // p)  # ceil
    for r in range(p):
        assert len(net.sent[r]) <= 2 * (p - 1)
        if n >= p:  # no empty chunks: exactly 2(p-1) messages per rank
            assert len(net.sent[r]) == 2 * (p - 1)
        assert sum(net.sent[r]) <= 2 * (p - 1) * chunk
    assert all(t.eq(p).all() for t in inputs)


def test_world_size_one_and_empty_tensors_send_nothing():
    t = torch.arange(5.0)
    got, net = run_ring([t], ReduceOp.SUM)
    assert torch.equal(got[0], torch.arange(5.0)) and not net.sent
    got, net = run_ring([torch.empty(0) for _ in range(3)], ReduceOp.SUM)
    assert all(g.numel() == 0 for g in got) and not net.sent


@pytest.mark.parametrize("p", [2, 3, 4])
def test_non_contiguous_view_is_reduced_in_place(p):
    bases = [torch.arange(6 * 8, dtype=torch.float64).view(6, 8) * (r + 1) for r in range(p)]
    views = [b[:, ::2].t() for b in bases]
    assert not views[0].is_contiguous()
    want = sum(torch.arange(6 * 8, dtype=torch.float64).view(6, 8) * (r + 1) for r in range(p))
    run_ring(views, ReduceOp.SUM)
    for r, b in enumerate(bases):
        assert torch.equal(b[:, ::2], want[:, ::2]), "the view's elements were not written back"
        assert torch.equal(b[:, 1::2], (torch.arange(6 * 8, dtype=torch.float64).view(6, 8) * (r + 1))[:, 1::2]), (
            "elements outside the view were touched"
        )


def test_multi_dimensional_tensor_keeps_its_shape():
    inputs = [torch.full((2, 3, 4), float(r)) for r in range(3)]
    got, _ = run_ring(inputs, ReduceOp.MAX)
    assert all(t.shape == (2, 3, 4) and t.eq(2).all() for t in got)


def test_ring_messages_do_not_steal_user_messages():
    net = Network()
    net.queue(0, 1, 0).put(torch.tensor([42.0]))  # a user's message from rank 0 to 1, tag 0, not yet received
    got, _ = run_ring([torch.ones(4), torch.ones(4) * 2], ReduceOp.SUM, net)
    assert all(torch.equal(t, torch.full((4,), 3.0)) for t in got)
    assert net.queue(0, 1, 0).get_nowait().item() == 42.0
    assert RING_TAG != 0


def test_avg_on_integers_and_unknown_ops_are_refused():
    g = FakeGroup(Network(), 0, 1)
    with pytest.raises(
        TypeError, match=r"ring_all_reduce with ReduceOp.AVG needs a floating-point tensor, got torch.int32"
    ):
        ring_all_reduce(g, torch.ones(3, dtype=torch.int32), ReduceOp.AVG)
    with pytest.raises(ValueError, match="unknown reduce op 'BAND'"):
        ring_all_reduce(g, torch.ones(3), "BAND")
    assert torch.equal(ring_all_reduce(g, torch.ones(3), "max"), torch.ones(3))  # names work, any case


def test_destroyed_group_is_refused():
    g = FakeGroup(Network(), 0, 2)
    g.destroy()
    with pytest.raises(GroupError, match="ring_all_reduce on process group 'world' after it was destroyed"):
        ring_all_reduce(g, torch.ones(3))
