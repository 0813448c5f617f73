"""Every collective of ``ddptrain.comm`` on world sizes 1-4, checked against values computed here.

Spawning a world costs seconds, so each world size is launched ONCE: the body below runs every
check (all collectives x reduce ops x dtypes, point-to-point, async handles, the ring all-reduce,
subgroups, the key-value store) and returns what it saw; the tests then compare each part with
values recomputed locally in this (parent) process from the same deterministic inputs.

Inputs are integers or quarter-integers, so float sums and products are exact whatever order the
backend reduces in: results must match bit for bit (AVG and the ring's float sums use allclose).

Results travel back pickled to bytes: ``launch`` currently cannot return torch tensors (they go
through torch's shared-memory reducer and the worker exits before the parent reads them) — see
``test_launch_can_return_tensors``.
"""

from __future__ import annotations

import functools
import os
import pickle
import shutil
import tempfile
import time
import zlib
from datetime import timedelta

import pytest
import torch

import ddptrain.comm as dist
from ddptrain.launch import find_free_port, launch
from ddptrain.testing import run_distributed, run_threaded

WORLD_SIZES = [1, 2, 3, 4]
# (backend, world size) of each launch: gloo through the spawning launcher, mpi under mpiexec
# ... and the in-process threaded group of ddptrain.testing, held to the same suite (8 ranks too).
WORLDS = [("gloo", ws) for ws in WORLD_SIZES] + [("mpi", 2), ("mpi", 3)] + [("threaded", ws) for ws in (1, 2, 3, 8)]
DTYPES = {"float32": torch.float32, "float64": torch.float64, "int64": torch.int64}
OPS = ["SUM", "PRODUCT", "MAX", "MIN", "AVG"]
SHAPE = (3, 5)
RING_LENGTHS = [0, 1, 7, 1000003]
BIG = 1000003
LAUNCH_TIMEOUT_S = 150
COMM_TIMEOUT_S = 60

pytestmark = [pytest.mark.dist, pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)]


# -- deterministic inputs, shared by the workers and the parent ------------------------------------
def make_input(rank: int, dtype_name: str, tag: str, op: str = "SUM", shape=SHAPE) -> torch.Tensor:
    """Rank ``rank``'s tensor for check ``tag``: small integers (quarters for floats), exact to reduce."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{rank}/{dtype_name}/{tag}/{op}".encode()))
    if op == "PRODUCT":  # +-1..3 keeps products of 4 ranks small and exact
        vals = torch.randint(1, 4, shape, generator=g) * (torch.randint(0, 2, shape, generator=g) * 2 - 1)
    else:
        vals = torch.randint(-8, 9, shape, generator=g)
    dtype = DTYPES[dtype_name]
    return vals.to(dtype) / 4 if dtype.is_floating_point else vals.to(dtype)


def make_ring_input(rank: int, dtype_name: str, op: str, n: int, shape=None) -> torch.Tensor:
    """Inputs for ring-vs-native: random floats (so the ring's summation order matters), wide ints."""
    g = torch.Generator().manual_seed(zlib.crc32(f"ring/{rank}/{dtype_name}/{op}/{n}".encode()))
    dtype = DTYPES[dtype_name]
    if dtype.is_floating_point:
        x = torch.randn(n, generator=g, dtype=dtype)
        if op == "PRODUCT":
            x = 1 + x / 10
    else:
        x = (
            torch.randint(-3, 4, (n,), generator=g)
            if op == "PRODUCT"
            else torch.randint(-(10**6), 10**6, (n,), generator=g)
        )
        x = x.to(dtype)
    return x.view(shape) if shape is not None else x


def reduce_local(op: str, tensors) -> torch.Tensor:
    s = torch.stack(list(tensors))
    if op == "SUM":
        return s.sum(0)
    if op == "PRODUCT":
        return s.prod(0)
    if op == "MAX":
        return s.amax(0)
    if op == "MIN":
        return s.amin(0)
    if op == "AVG":
        return s.sum(0) / len(tensors)
    raise ValueError(op)


def subgroup_members(ws: int) -> list[int]:
    """A proper subset of ranks where possible, not starting at 0 for ws=4 (group != global ranks)."""
    return {1: [0], 2: [1], 3: [0, 2], 4: [1, 3], 8: [1, 3, 4, 6]}[ws]


RAISED = "__raised__"


def _capture(results: dict, key, fn) -> None:
    try:
        results[key] = fn()
    except Exception as exc:  # noqa: BLE001 - the parent asserts on what was raised
        results[key] = (RAISED, type(exc).__name__, str(exc))


# -- the body run on every rank -----------------------------------------------------------------
def _body(rank: int, ws: int, init_args=None) -> bytes:  # noqa: C901 - one launch checks everything
    R: dict = {}
    R["identity"] = (dist.is_initialized(), dist.get_rank(), dist.get_world_size(), dist.get_backend())
    op_of = {name: getattr(dist.ReduceOp, name) for name in OPS}

    for dn, dtype in DTYPES.items():
        for src in range(ws):

            def bcast():
                t = make_input(rank, dn, f"bcast{src}")
                assert dist.broadcast(t, src) is None
                return t

            _capture(R, ("broadcast", dn, src), bcast)

        for op in OPS:

            def allreduce():
                t = make_input(rank, dn, "allreduce", op)
                assert dist.all_reduce(t, op=op_of[op]) is None
                return t

            _capture(R, ("all_reduce", dn, op), allreduce)

            def reduce():
                t = make_input(rank, dn, "reduce", op)
                dist.reduce(t, OPS.index(op) % ws, op=op_of[op])
                return t

            _capture(R, ("reduce", dn, op), reduce)

            def reduce_scatter():
                inputs = [make_input(rank, dn, f"rs{j}", op) for j in range(ws)]
                out = torch.full(SHAPE, 99, dtype=dtype)
                dist.reduce_scatter(out, inputs, op=op_of[op])
                return out

            _capture(R, ("reduce_scatter", dn, op), reduce_scatter)

        def all_gather():
            out = [torch.zeros(SHAPE, dtype=dtype) for _ in range(ws)]
            dist.all_gather(out, make_input(rank, dn, "allgather"))
            return out

        _capture(R, ("all_gather", dn), all_gather)

        def gather():
            dst = ws - 1
            out = [torch.zeros(SHAPE, dtype=dtype) for _ in range(ws)] if rank == dst else None
            dist.gather(make_input(rank, dn, "gather"), out, dst)
            return out

        _capture(R, ("gather", dn), gather)

        def scatter():
            src = ws // 2
            lst = [make_input(src, dn, f"scatter{j}") for j in range(ws)] if rank == src else None
            out = torch.zeros(SHAPE, dtype=dtype)
            dist.scatter(out, lst, src)
            return out

        _capture(R, ("scatter", dn), scatter)

        def all_to_all():  # uneven sizes: rank r sends r+j+1 elements to rank j
            inputs = [make_input(rank, dn, f"a2a{j}", shape=(rank + j + 1,)) for j in range(ws)]
            outputs = [torch.zeros(j + rank + 1, dtype=dtype) for j in range(ws)]
            dist.all_to_all(outputs, inputs)
            return outputs

        _capture(R, ("all_to_all", dn), all_to_all)

        if ws > 1:

            def send_recv():  # blocking, round the ring: even ranks send first, odd ranks receive first
                right, left = (rank + 1) % ws, (rank - 1) % ws
                out = torch.zeros(SHAPE, dtype=dtype)
                mine = make_input(rank, dn, "p2p")
                if rank % 2 == 0:
                    dist.send(mine, right)
                    dist.recv(out, left)
                else:
                    dist.recv(out, left)
                    dist.send(mine, right)
                return out

            _capture(R, ("send_recv", dn), send_recv)

            def isend_irecv():
                right, left = (rank + 1) % ws, (rank - 1) % ws
                out = torch.zeros(SHAPE, dtype=dtype)
                reqs = [dist.isend(make_input(rank, dn, "ip2p"), right), dist.irecv(out, left)]
                for req in reqs:
                    req.wait()
                return out, [req.is_completed() for req in reqs]

            _capture(R, ("isend_irecv", dn), isend_irecv)

    if ws > 1:

        def tags():  # messages are matched by tag, not by arrival order
            a, b = torch.zeros(2), torch.zeros(2)
            if rank == 0:
                w1 = dist.isend(torch.tensor([1.0, 1.0]), 1, tag=11)
                w2 = dist.isend(torch.tensor([2.0, 2.0]), 1, tag=22)
                w1.wait(), w2.wait()
            elif rank == 1:
                r2 = dist.irecv(b, 0, tag=22)
                r1 = dist.irecv(a, 0, tag=11)
                r2.wait(), r1.wait()
            return a, b

        _capture(R, "tags", tags)

    def barrier():  # nobody may leave the barrier before the late rank arrives
        if rank == ws - 1:
            time.sleep(0.3)
        arrived = time.time()
        dist.barrier()
        left = time.time()
        arrivals = [torch.zeros(1, dtype=torch.float64) for _ in range(ws)]
        dist.all_gather(arrivals, torch.tensor([arrived], dtype=torch.float64))
        return left >= max(a.item() for a in arrivals)

    _capture(R, "barrier", barrier)

    # AVG on integers is refused before anything moves, identically on every rank
    for name, call in [
        ("all_reduce", lambda t: dist.all_reduce(t, op=dist.ReduceOp.AVG)),
        ("reduce", lambda t: dist.reduce(t, 0, op=dist.ReduceOp.AVG)),
        ("reduce_scatter", lambda t: dist.reduce_scatter(t, [t.clone() for _ in range(ws)], op=dist.ReduceOp.AVG)),
        ("ring_all_reduce", lambda t: dist.ring_all_reduce(t, op=dist.ReduceOp.AVG)),
    ]:
        _capture(R, ("avg_int", name), lambda: call(torch.ones(4, dtype=torch.int64)))

    # async handles: wait(), is_completed(), get_future()
    def async_checks():
        out = {}
        t = make_input(rank, "float32", "async_ar")
        w = dist.all_reduce(t, async_op=True)
        out["all_reduce"] = (isinstance(w, dist.Work), w.wait(), w.is_completed(), w.get_future().wait(), t)
        t = make_input(rank, "float32", "async_bc")
        w = dist.broadcast(t, ws - 1, async_op=True)
        out["broadcast"] = (isinstance(w, dist.Work), w.wait(), w.is_completed(), w.get_future().wait(), t)
        lst = [torch.zeros(SHAPE) for _ in range(ws)]
        w = dist.all_gather(lst, make_input(rank, "float32", "async_ag"), async_op=True)
        out["all_gather"] = (isinstance(w, dist.Work), w.wait(), w.is_completed(), w.get_future().wait(), lst)
        o = torch.zeros(SHAPE)
        w = dist.reduce_scatter(o, [make_input(rank, "float32", f"async_rs{j}") for j in range(ws)], async_op=True)
        out["reduce_scatter"] = (isinstance(w, dist.Work), w.wait(), w.is_completed(), None, o)
        _capture(out, "reduce_scatter/future", lambda: w.get_future().wait())
        outs = [torch.zeros(j + rank + 1) for j in range(ws)]
        w = dist.all_to_all(
            outs,
            [make_input(rank, "float32", f"async_a2a{j}", shape=(rank + j + 1,)) for j in range(ws)],
            async_op=True,
        )
        # get_future() before wait(): the value must already be unpacked into the outputs
        fut_val = w.get_future().wait()
        out["all_to_all"] = (isinstance(w, dist.Work), w.wait(), w.is_completed(), fut_val, outs)
        w = dist.barrier(async_op=True)
        out["barrier"] = (isinstance(w, dist.Work), w.wait(), w.is_completed())
        # two outstanding ops waited in reverse order; AVG post-processing happens exactly once
        a, b = make_input(rank, "float64", "async_a"), make_input(rank, "float64", "async_b")
        wa = dist.all_reduce(a, op=dist.ReduceOp.AVG, async_op=True)
        wb = dist.all_reduce(b, op=dist.ReduceOp.MAX, async_op=True)
        wb.wait(), wa.wait(), wa.wait()
        wa.get_future().wait()
        out["two_outstanding"] = (a, b)
        # a future chained with then(), as DDP communication hooks do
        c = make_input(rank, "float32", "async_then")
        fut = dist.all_reduce(c, async_op=True).get_future().then(lambda f: f.value()[0] * 2)
        out["then"] = fut.wait()
        if ws > 1:
            r = torch.zeros(SHAPE)
            reqs = [
                dist.isend(make_input(rank, "float32", "async_p2p"), (rank + 1) % ws),
                dist.irecv(r, (rank - 1) % ws),
            ]
            for req in reqs:
                req.wait()
            out["p2p"] = (r, [req.is_completed() for req in reqs])
            r2 = torch.zeros(SHAPE)
            reqs = [
                dist.isend(make_input(rank, "float32", "async_p2p_fut"), (rank + 1) % ws),
                dist.irecv(r2, (rank - 1) % ws),
            ]
            for name, req in zip(("isend", "irecv"), reqs):
                _capture(out, f"p2p/{name} future", lambda req=req: req.get_future().wait())
            for req in reqs:
                req.wait()
            out["p2p/irecv buffer"] = r2
        return out

    _capture(R, "async", async_checks)

    def async_temporary_inputs():
        """Inputs the caller does not keep must live until the operation completes: allocate
        look-alike tensors while it runs, which would reuse freed memory."""
        n = 4096
        outs = [torch.zeros(n) for _ in range(ws)]
        works = [dist.all_gather(outs, torch.full((n,), float(rank + 1)), async_op=True)]
        sums = [torch.zeros(n) for _ in range(4)]
        works += [dist.all_reduce(s, async_op=True) for s in sums]
        works.append(dist.broadcast(torch.full((n,), float(rank)), 0, async_op=True))
        # reduce_scatter stacks its inputs into a temporary of its own: it must outlive the call
        scattered = [torch.zeros(n) for _ in range(4)]
        works += [
            dist.reduce_scatter(o, [torch.full((n,), float(j + 1)) for j in range(ws)], async_op=True)
            for o in scattered
        ]
        junk = [torch.full((n * ws,), -7.0) for _ in range(64)]
        for w in works:
            w.wait()
        del junk
        return (
            [o[[0, n - 1]].tolist() for o in outs],
            [s.abs().max().item() for s in sums],
            [o[[0, n - 1]].tolist() for o in scattered],
        )

    _capture(R, "async_temporary_inputs", async_temporary_inputs)

    # ring all-reduce against the native one
    def ring():
        out = {}
        for dn, dtype in DTYPES.items():
            for n in RING_LENGTHS:
                for op in OPS if n != BIG else ["SUM"]:
                    if op == "AVG" and not dtype.is_floating_point:
                        continue
                    x = make_ring_input(rank, dn, op, n)
                    ring_t, native_t = x.clone(), x.clone()
                    ptr = ring_t.data_ptr()
                    returned = dist.ring_all_reduce(ring_t, op=op_of[op])
                    dist.all_reduce(native_t, op=op_of[op])
                    in_place = returned is ring_t and ring_t.data_ptr() == ptr
                    if n == BIG:
                        same = (
                            torch.equal(ring_t, native_t)
                            if not dtype.is_floating_point
                            else bool(torch.allclose(ring_t, native_t, rtol=1e-5, atol=1e-5))
                        )
                        full = ring_t if rank == 0 else None
                        out[(dn, n, op)] = (in_place, same, full, float(ring_t.double().sum()))
                    else:
                        out[(dn, n, op)] = (in_place, ring_t, native_t)
            # non-contiguous: a transposed, strided view of a bigger tensor
            base = make_ring_input(rank, dn, "SUM", 6 * 14, shape=(6, 14))
            view = base[:, ::2].t()
            assert not view.is_contiguous()
            expect_native = view.contiguous()
            dist.all_reduce(expect_native)
            native_base = base.clone()

            def native_on_view():  # native all_reduce on the non-contiguous view itself
                dist.all_reduce(native_base[:, ::2].t())
                return native_base

            _capture(out, (dn, "native_noncontig"), native_on_view)
            dist.ring_all_reduce(view)
            out[(dn, "noncontig")] = (base, view.clone(), expect_native)
        return out

    _capture(R, "ring", ring)

    # subgroups of a subset of ranks: src/dst are global ranks
    def subgroups():
        members = subgroup_members(ws)
        sub = dist.new_group(members)
        everyone = dist.new_group()
        out = {"member": rank in members}
        if rank in members:
            out["rank_size"] = (dist.get_rank(sub), dist.get_world_size(sub))
            t = torch.tensor([rank + 1.0, 10.0 * (rank + 1)])
            dist.all_reduce(t, group=sub)
            out["all_reduce"] = t
            t = torch.full((3,), float(rank))
            dist.broadcast(t, members[-1], group=sub)
            out["broadcast"] = t
            t = torch.tensor([rank, -rank], dtype=torch.int64)
            dist.reduce(t, members[-1], op=dist.ReduceOp.MAX, group=sub)
            out["reduce"] = t
            lst = [torch.zeros(2) for _ in members]
            dist.all_gather(lst, torch.tensor([rank, rank * 2.0]), group=sub)
            out["all_gather"] = lst
            lst = [torch.zeros(1) for _ in members] if rank == members[0] else None
            dist.gather(torch.tensor([rank * 3.0]), lst, members[0], group=sub)
            out["gather"] = lst
            src = members[-1]
            lst = [torch.tensor([100.0 + m]) for m in members] if rank == src else None
            t = torch.zeros(1)
            dist.scatter(t, lst, src, group=sub)
            out["scatter"] = t
            t = torch.arange(7, dtype=torch.int64) * (rank + 1)
            dist.ring_all_reduce(t, group=sub)
            out["ring"] = t
            if len(members) > 1:
                t = torch.zeros(2)
                if rank == members[0]:
                    dist.send(torch.tensor([5.0, 6.0]), members[-1], group=sub)
                elif rank == members[-1]:
                    dist.recv(t, members[0], group=sub)
                out["p2p"] = t
            dist.barrier(group=sub)
            outsiders = [r for r in range(ws) if r not in members]
            if outsiders:  # a root outside the group is refused on every member
                _capture(out, "foreign_src", lambda: dist.broadcast(torch.zeros(1), outsiders[0], group=sub))
        else:
            _capture(out, "all_reduce", lambda: dist.all_reduce(torch.ones(1), group=sub))
            _capture(out, "broadcast", lambda: dist.broadcast(torch.ones(1), members[0], group=sub))
            _capture(out, "barrier", lambda: dist.barrier(group=sub))
            _capture(out, "get_rank", lambda: dist.get_rank(sub))
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=everyone)  # the world still works after the subgroup's traffic
        out["everyone"] = t
        t = torch.tensor([1.0])
        dist.all_reduce(t)
        out["world"] = t
        return out

    _capture(R, "subgroups", subgroups)

    def store():
        s = dist.get_store()
        s.set(f"kv/{rank}", f"value-{rank}")
        s.wait([f"kv/{r}" for r in range(ws)], timeout=30)
        values = [s.get(f"kv/{r}") for r in range(ws)]
        s.add("kv/counter", rank + 1)
        dist.barrier()
        total = s.add("kv/counter", 0)
        t0 = time.monotonic()
        try:
            s.wait(["kv/never-set"], timeout=0.5)
            missing = "no error"
        except dist.CommTimeoutError as exc:
            missing = str(exc)
        return values, total, missing, time.monotonic() - t0

    _capture(R, "store", store)
    if init_args is not None:  # the other init methods, in the same processes (spawning costs seconds)
        dist.destroy_process_group()
        _capture(R, "init_methods", lambda: _init_methods_body(rank, ws, *init_args))
    return pickle.dumps(R)


# -- parent side ----------------------------------------------------------------------------------
_CACHE: dict = {}


INIT_WS = 2  # the world size whose launch also tries every init method


def world(backend: str, ws: int) -> list[dict]:
    """Per-rank results of the one launch for this backend and world size (run on first use)."""
    key = (backend, ws)
    if key not in _CACHE:
        t0 = time.monotonic()
        tmp = tempfile.mkdtemp(prefix="ddptrain-test-init-")
        try:
            ports = set()
            while len(ports) < 3:
                ports.add(find_free_port())
            init_args = (*sorted(ports), os.path.join(tmp, "rendezvous")) if key == ("gloo", INIT_WS) else None
            run = run_threaded if backend == "threaded" else functools.partial(run_distributed, backend=backend)
            raw = run(_body, ws, init_args, timeout_s=LAUNCH_TIMEOUT_S, comm_timeout_s=COMM_TIMEOUT_S)
            _CACHE[key] = [pickle.loads(r) for r in raw]
        except Exception as exc:  # noqa: BLE001 - every test of this world reports it
            _CACHE[key] = exc
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        print(f"{backend} world size {ws}: launch took {time.monotonic() - t0:.1f} s")
    got = _CACHE[key]
    if isinstance(got, Exception):
        pytest.fail(f"the {backend} launch for world size {ws} failed: {type(got).__name__}: {got}")
    return got


class Mismatches:
    """Collects every mismatch of a test so one failure shows them all."""

    def __init__(self):
        self.items: list[str] = []

    def tensor(self, what, actual, expected, exact=True):
        if isinstance(actual, tuple) and actual and actual[0] == RAISED:
            self.items.append(f"{what}: raised {actual[1]}: {actual[2]}")
            return
        try:
            if exact:
                torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=False)
            else:
                torch.testing.assert_close(actual, expected)
        except AssertionError as exc:
            self.items.append(f"{what}: {str(exc).splitlines()[0]}\n   got {actual}\n   expected {expected}")

    def ok(self, what, cond, detail=""):
        if not cond:
            self.items.append(f"{what}: {detail}")

    def check(self):
        assert not self.items, f"{len(self.items)} mismatch(es):\n" + "\n".join(self.items)


def not_raised(value):
    assert not (isinstance(value, tuple) and value and value[0] == RAISED), f"raised {value[1]}: {value[2]}"
    return value


def _world_params(worlds):
    """One param per world; the tests of a launched world share one pytest-xdist worker
    (``xdist_group``, scripts/test.sh runs ``--dist loadgroup``), so :func:`world` launches it once."""
    return [
        pytest.param(
            b, w, id=f"{b}-{w}", marks=() if b == "threaded" else pytest.mark.xdist_group(f"collectives-{b}-{w}")
        )
        for b, w in worlds
    ]


ws_param = pytest.mark.parametrize("backend, ws", _world_params(WORLDS))
multi_param = pytest.mark.parametrize("backend, ws", _world_params([(b, w) for b, w in WORLDS if w > 1]))


@ws_param
def test_identity(backend, ws):
    for rank, res in enumerate(world(backend, ws)):
        assert res["identity"] == (True, rank, ws, backend)


@ws_param
def test_broadcast_from_every_root(backend, ws):
    m = Mismatches()
    for rank, res in enumerate(world(backend, ws)):
        for dn in DTYPES:
            for src in range(ws):
                m.tensor(f"rank {rank} {dn} src={src}", res[("broadcast", dn, src)], make_input(src, dn, f"bcast{src}"))
    m.check()


@ws_param
def test_all_reduce_every_op_and_dtype(backend, ws):
    m = Mismatches()
    for dn, dtype in DTYPES.items():
        for op in OPS:
            if op == "AVG" and not dtype.is_floating_point:
                continue
            expected = reduce_local(op, [make_input(r, dn, "allreduce", op) for r in range(ws)])
            for rank, res in enumerate(world(backend, ws)):
                m.tensor(f"rank {rank} {dn} {op}", res[("all_reduce", dn, op)], expected, exact=op != "AVG")
    m.check()


@ws_param
def test_reduce_every_op_and_dtype(backend, ws):
    m = Mismatches()
    for dn, dtype in DTYPES.items():
        for op in OPS:
            if op == "AVG" and not dtype.is_floating_point:
                continue
            dst = OPS.index(op) % ws
            expected = reduce_local(op, [make_input(r, dn, "reduce", op) for r in range(ws)])
            m.tensor(f"dst {dst} {dn} {op}", world(backend, ws)[dst][("reduce", dn, op)], expected, exact=op != "AVG")
    m.check()


@ws_param
def test_reduce_scatter_every_op_and_dtype(backend, ws):
    m = Mismatches()
    for dn, dtype in DTYPES.items():
        for op in OPS:
            if op == "AVG" and not dtype.is_floating_point:
                continue
            for rank, res in enumerate(world(backend, ws)):
                expected = reduce_local(op, [make_input(q, dn, f"rs{rank}", op) for q in range(ws)])
                m.tensor(f"rank {rank} {dn} {op}", res[("reduce_scatter", dn, op)], expected, exact=op != "AVG")
    m.check()


@ws_param
def test_avg_on_int64_is_a_clear_type_error(backend, ws):
    for rank, res in enumerate(world(backend, ws)):
        for name in ["all_reduce", "reduce", "reduce_scatter", "ring_all_reduce"]:
            got = res[("avg_int", name)]
            assert got[:2] == (RAISED, "TypeError"), f"{name} on rank {rank}: {got}"
            assert "AVG" in got[2] and "torch.int64" in got[2] and "float" in got[2], got[2]
        for name in ["all_reduce", "reduce", "reduce_scatter"]:  # the same calls inside the op loop
            got = res[(name, "int64", "AVG")]
            assert got[:2] == (RAISED, "TypeError"), got


@ws_param
def test_all_gather_gather_scatter(backend, ws):
    m = Mismatches()
    results = world(backend, ws)
    for dn in DTYPES:
        gathered = [make_input(r, dn, "allgather") for r in range(ws)]
        for rank, res in enumerate(results):
            got = not_raised(res[("all_gather", dn)])
            m.ok(f"all_gather rank {rank} {dn} length", len(got) == ws)
            for i, (g, e) in enumerate(zip(got, gathered)):
                m.tensor(f"all_gather rank {rank} {dn} [{i}]", g, e)
        got = not_raised(results[ws - 1][("gather", dn)])
        for i in range(ws):
            m.tensor(f"gather {dn} [{i}]", got[i], make_input(i, dn, "gather"))
        for rank, res in enumerate(results):
            if rank != ws - 1:
                m.ok(f"gather {dn} rank {rank}", not_raised(res[("gather", dn)]) is None)
            m.tensor(f"scatter rank {rank} {dn}", res[("scatter", dn)], make_input(ws // 2, dn, f"scatter{rank}"))
    m.check()


@ws_param
def test_all_to_all_uneven_sizes(backend, ws):
    m = Mismatches()
    for dn in DTYPES:
        for rank, res in enumerate(world(backend, ws)):
            got = not_raised(res[("all_to_all", dn)])
            for j in range(ws):
                m.tensor(f"rank {rank} {dn} from {j}", got[j], make_input(j, dn, f"a2a{rank}", shape=(j + rank + 1,)))
    m.check()


@multi_param
def test_send_recv_and_isend_irecv(backend, ws):
    m = Mismatches()
    for dn in DTYPES:
        for rank, res in enumerate(world(backend, ws)):
            left = (rank - 1) % ws
            m.tensor(f"send/recv rank {rank} {dn}", res[("send_recv", dn)], make_input(left, dn, "p2p"))
            out, completed = not_raised(res[("isend_irecv", dn)])
            m.tensor(f"isend/irecv rank {rank} {dn}", out, make_input(left, dn, "ip2p"))
            m.ok(f"isend/irecv rank {rank} {dn} is_completed after wait", completed == [True, True], completed)
    a, b = not_raised(world(backend, ws)[1]["tags"])
    m.tensor("tag 11", a, torch.tensor([1.0, 1.0]))
    m.tensor("tag 22", b, torch.tensor([2.0, 2.0]))
    m.check()


@ws_param
def test_barrier_waits_for_the_late_rank(backend, ws):
    for rank, res in enumerate(world(backend, ws)):
        assert not_raised(res["barrier"]) is True, f"rank {rank} left the barrier before every rank arrived"


@ws_param
def test_async_handles(backend, ws):
    m = Mismatches()
    results = world(backend, ws)
    expected = {
        "all_reduce": reduce_local("SUM", [make_input(r, "float32", "async_ar") for r in range(ws)]),
        "broadcast": make_input(ws - 1, "float32", "async_bc"),
    }
    for rank, res in enumerate(results):
        a = not_raised(res["async"])
        for name in ["all_reduce", "broadcast", "all_gather", "all_to_all", "barrier"]:
            is_work, waited, completed = a[name][:3]
            m.ok(
                f"{name} rank {rank}: Work/wait()/is_completed()",
                (is_work, waited, completed) == (True, True, True),
                (is_work, waited, completed),
            )
        for name in ["all_reduce", "broadcast"]:
            _, _, _, fut_value, tensor = a[name]
            m.tensor(f"{name} rank {rank} tensor", tensor, expected[name])
            m.ok(f"{name} rank {rank} future value", len(fut_value) == 1, fut_value)
            m.tensor(f"{name} rank {rank} future value", fut_value[0], expected[name])
        _, _, _, fut_value, lst = a["all_gather"]
        for i in range(ws):
            e = make_input(i, "float32", "async_ag")
            m.tensor(f"all_gather rank {rank} [{i}]", lst[i], e)
            m.tensor(f"all_gather rank {rank} future [{i}]", fut_value[i], e)
        o = a["reduce_scatter"][4]
        m.tensor(
            f"reduce_scatter rank {rank}",
            o,
            reduce_local("SUM", [make_input(q, "float32", f"async_rs{rank}") for q in range(ws)]),
        )
        _, _, _, fut_value, outs = a["all_to_all"]
        for j in range(ws):
            e = make_input(j, "float32", f"async_a2a{rank}", shape=(j + rank + 1,))
            m.tensor(f"all_to_all rank {rank} from {j}", outs[j], e)
            m.tensor(f"all_to_all rank {rank} future from {j}", fut_value[j], e)
        got_a, got_b = a["two_outstanding"]
        m.tensor(
            f"outstanding AVG rank {rank} (divided exactly once)",
            got_a,
            reduce_local("AVG", [make_input(r, "float64", "async_a") for r in range(ws)]),
            exact=False,
        )
        m.tensor(
            f"outstanding MAX rank {rank}",
            got_b,
            reduce_local("MAX", [make_input(r, "float64", "async_b") for r in range(ws)]),
        )
        m.tensor(
            f"then() rank {rank}",
            a["then"],
            2 * reduce_local("SUM", [make_input(r, "float32", "async_then") for r in range(ws)]),
        )
        if ws > 1:
            r, completed = a["p2p"]
            m.tensor(f"irecv rank {rank}", r, make_input((rank - 1) % ws, "float32", "async_p2p"))
            m.ok(f"p2p rank {rank} is_completed", completed == [True, True], completed)
    m.check()


@ws_param
def test_async_ops_keep_inputs_the_caller_dropped(backend, ws):
    for rank, res in enumerate(world(backend, ws)):
        gathered, sums, scattered = not_raised(res["async_temporary_inputs"])
        assert gathered == [[r + 1.0, r + 1.0] for r in range(ws)], (rank, gathered)
        assert sums == [0.0] * 4, (rank, sums)
        assert scattered == [[ws * (rank + 1.0)] * 2] * 4, (rank, scattered)


@ws_param
def test_reduce_scatter_and_p2p_handles(backend, ws):
    m = Mismatches()
    for rank, res in enumerate(world(backend, ws)):
        a = not_raised(res["async"])
        m.ok(
            f"reduce_scatter rank {rank}: Work/wait()/is_completed()",
            a["reduce_scatter"][:3] == (True, True, True),
            a["reduce_scatter"][:3],
        )
        fut_value = a["reduce_scatter/future"]
        m.tensor(
            f"reduce_scatter rank {rank} future",
            fut_value[0] if isinstance(fut_value, list) else fut_value,
            reduce_local("SUM", [make_input(q, "float32", f"async_rs{rank}") for q in range(ws)]),
        )
        if ws > 1:  # each future's value: the tensor sent, and the tensor received (the message)
            sent, received = a["p2p/isend future"], a["p2p/irecv future"]
            for what, got, expected in (
                ("isend", sent, make_input(rank, "float32", "async_p2p_fut")),
                ("irecv", received, make_input((rank - 1) % ws, "float32", "async_p2p_fut")),
            ):
                m.ok(f"{what} rank {rank} get_future() value is [tensor]", isinstance(got, list) and len(got) == 1, got)
                if isinstance(got, list) and len(got) == 1:
                    m.tensor(f"{what} rank {rank} get_future() value", got[0], expected)
            m.tensor(
                f"irecv rank {rank} buffer",
                a["p2p/irecv buffer"],
                make_input((rank - 1) % ws, "float32", "async_p2p_fut"),
            )
    m.check()


@ws_param
def test_ring_all_reduce_matches_native_and_local(backend, ws):
    m = Mismatches()
    results = [not_raised(res["ring"]) for res in world(backend, ws)]
    for dn, dtype in DTYPES.items():
        exact = not dtype.is_floating_point
        for n in RING_LENGTHS:
            for op in OPS if n != BIG else ["SUM"]:
                if op == "AVG" and exact:
                    continue
                expected = reduce_local(op, [make_ring_input(r, dn, op, n) for r in range(ws)])
                what = f"{dn} n={n} {op}"
                if n == BIG:
                    sums = []
                    for rank, res in enumerate(results):
                        in_place, same, full, checksum = res[(dn, n, op)]
                        m.ok(f"{what} rank {rank} in place", in_place)
                        m.ok(f"{what} rank {rank} ring == native", same)
                        sums.append(checksum)
                    m.tensor(f"{what} rank 0 vs local", results[0][(dn, n, op)][2], expected, exact=exact)
                    m.ok(f"{what} every rank holds the same result", len(set(sums)) == 1, sums)
                    continue
                for rank, res in enumerate(results):
                    in_place, ring_t, native_t = res[(dn, n, op)]
                    m.ok(f"{what} rank {rank} in place", in_place)
                    m.tensor(f"{what} rank {rank} ring vs native", ring_t, native_t, exact=exact)
                    m.tensor(f"{what} rank {rank} ring vs local", ring_t, expected, exact=exact)
                    m.tensor(f"{what} rank {rank} native vs local", native_t, expected, exact=exact)
    m.check()


@ws_param
def test_ring_and_native_on_non_contiguous_tensors(backend, ws):
    m = Mismatches()
    for dn, dtype in DTYPES.items():
        exact = not dtype.is_floating_point
        inputs = [make_ring_input(r, dn, "SUM", 6 * 14, shape=(6, 14)) for r in range(ws)]
        expected = reduce_local("SUM", [x[:, ::2].t() for x in inputs])
        for rank, res in enumerate(world(backend, ws)):
            base, view, native_contig = not_raised(res["ring"])[(dn, "noncontig")]
            m.tensor(f"{dn} rank {rank} ring on view", view, expected, exact=exact)
            m.tensor(f"{dn} rank {rank} written through to the base tensor", base[:, ::2].t(), expected, exact=exact)
            m.tensor(f"{dn} rank {rank} untouched columns", base[:, 1::2], inputs[rank][:, 1::2])
            m.tensor(f"{dn} rank {rank} native on contiguous copy", native_contig, expected, exact=exact)
    m.check()


@multi_param
def test_native_all_reduce_on_non_contiguous_view_is_right_or_refused(backend, ws):
    m = Mismatches()
    for dn, dtype in DTYPES.items():
        inputs = [make_ring_input(r, dn, "SUM", 6 * 14, shape=(6, 14)) for r in range(ws)]
        expected = reduce_local("SUM", [x[:, ::2].t() for x in inputs])
        for rank, res in enumerate(world(backend, ws)):
            got = not_raised(res["ring"])[(dn, "native_noncontig")]
            if isinstance(got, tuple) and got[0] == RAISED:
                m.ok(f"{dn} rank {rank} refusal names the rule", "contiguous" in got[2], got)
                continue
            m.tensor(
                f"{dn} rank {rank} native on the view", got[:, ::2].t(), expected, exact=not dtype.is_floating_point
            )
            m.tensor(f"{dn} rank {rank} elements outside the view untouched", got[:, 1::2], inputs[rank][:, 1::2])
    m.check()


@ws_param
def test_subgroup_of_a_subset_of_ranks(backend, ws):
    members = subgroup_members(ws)
    m = Mismatches()
    for rank, res in enumerate(world(backend, ws)):
        s = not_raised(res["subgroups"])
        m.tensor(f"rank {rank} world group of everyone", s["everyone"], torch.tensor([float(sum(range(ws)))]))
        m.tensor(f"rank {rank} world after subgroup", s["world"], torch.tensor([float(ws)]))
        if rank in members:
            m.ok(f"rank {rank} group rank/size", s["rank_size"] == (members.index(rank), len(members)), s["rank_size"])
            m.tensor(
                f"rank {rank} all_reduce",
                s["all_reduce"],
                torch.tensor([sum(r + 1.0 for r in members), sum(10.0 * (r + 1) for r in members)]),
            )
            m.tensor(
                f"rank {rank} broadcast from global {members[-1]}", s["broadcast"], torch.full((3,), float(members[-1]))
            )
            if rank == members[-1]:
                m.tensor(
                    f"rank {rank} reduce MAX",
                    s["reduce"],
                    torch.tensor([max(members), max(-r for r in members)], dtype=torch.int64),
                )
            for i, r in enumerate(members):
                m.tensor(f"rank {rank} all_gather[{i}]", s["all_gather"][i], torch.tensor([r, r * 2.0]))
            if rank == members[0]:
                for i, r in enumerate(members):
                    m.tensor(f"rank {rank} gather[{i}]", s["gather"][i], torch.tensor([r * 3.0]))
            m.tensor(f"rank {rank} scatter", s["scatter"], torch.tensor([100.0 + rank]))
            m.tensor(f"rank {rank} ring", s["ring"], torch.arange(7, dtype=torch.int64) * sum(r + 1 for r in members))
            if len(members) > 1 and rank == members[-1]:
                m.tensor(f"rank {rank} p2p", s["p2p"], torch.tensor([5.0, 6.0]))
            if ws > len(members):
                got = s["foreign_src"]
                m.ok(
                    f"rank {rank} foreign src refused",
                    got[:2] == (RAISED, "GroupError")
                    and "not a member" in got[2]
                    and str([r for r in range(ws) if r not in members][0]) in got[2],
                    got,
                )
        else:
            for name in ["all_reduce", "broadcast", "barrier"]:
                got = s[name]
                m.ok(f"rank {rank} outside the group: {name} refused", got[:2] == (RAISED, "GroupError"), got)
                m.ok(f"rank {rank} {name} message", f"rank {rank} is not a member of group {members}" in got[2], got)
            got = s["get_rank"]  # torch returns -1 here; refusing is also clear
            m.ok(f"rank {rank} get_rank(non-member)", got == -1 or got[:2] == (RAISED, "GroupError"), got)
    m.check()


@ws_param
def test_store_set_get_add_wait(backend, ws):
    for _rank, res in enumerate(world(backend, ws)):
        if backend in ("mpi", "threaded"):  # ranks that meet without a store: asking for one is refused clearly
            name, msg = res["store"][1:]
            assert name == "GroupError" and f"backend ({backend}) uses no key-value store" in msg, res["store"]
            continue
        values, total, missing, waited_s = not_raised(res["store"])
        assert values == [f"value-{r}".encode() for r in range(ws)]
        assert total == ws * (ws + 1) // 2
        assert "kv/never-set" in missing and "0.5 s" in missing, missing
        assert 0.4 <= waited_s < 5, waited_s


# -- init methods: four ways to initialise, torch.distributed alongside (run in the ws=2 launch) --
def _init_methods_body(rank: int, ws: int, tcp_port: int, store_port: int, torch_port: int, file_path: str):
    out = {}

    def exercise(label):
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t)
        s = dist.get_store()
        s.set(f"{label}/{rank}", str(rank))
        peers = [s.get(f"{label}/{r}", timeout=30) for r in range(ws)]
        sub = dist.new_group([0, ws - 1])
        u = torch.ones(1)
        dist.all_reduce(u, group=sub)
        out[label] = (dist.get_rank(), dist.get_world_size(), t.item(), peers, u.item())
        dist.destroy_process_group()
        out[label + "/after_destroy"] = dist.is_initialized()

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{tcp_port}", rank=rank, world_size=ws, timeout=60)
    exercise("tcp")
    dist.init_process_group(
        "gloo", init_method=f"file://{file_path}", rank=rank, world_size=ws, timeout=timedelta(seconds=60)
    )
    exercise("file")
    dist.init_process_group("gloo", init_method="env://", timeout=60)  # launch set RANK, WORLD_SIZE, MASTER_*
    exercise("env")
    c10d_store = torch.distributed.TCPStore("127.0.0.1", store_port, ws, rank == 0, timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.Store(c10d_store), rank=rank, world_size=ws, timeout=60)
    # torch.distributed's own default group coexists with ddptrain's
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{torch_port}", rank=rank, world_size=ws, timeout=timedelta(seconds=60)
    )
    a, b = torch.tensor([rank + 1.0]), torch.tensor([10.0 * (rank + 1)])
    torch.distributed.all_reduce(a)
    dist.all_reduce(b)
    torch.distributed.all_reduce(a)
    out["coexist"] = (a.item(), b.item())
    torch.distributed.destroy_process_group()
    exercise("store")
    return out


def test_init_methods_tcp_file_env_store():
    ws = INIT_WS
    for rank, res in enumerate(world("gloo", ws)):
        out = not_raised(res["init_methods"])
        for label in ["tcp", "file", "env", "store"]:
            assert out[label] == (rank, ws, 3.0, [b"0", b"1"], 2.0), (label, out[label])
            assert out[label + "/after_destroy"] is False
        assert out["coexist"] == (6.0, 30.0)  # torch: 1+2=3, then 3+3; ours: 10+20


def test_launch_can_return_tensors():
    assert [t.tolist() for t in launch(_return_tensor, 1, timeout_s=60)] == [[0.0]]


def _return_tensor(rank, ws):
    return torch.tensor([float(rank)])
