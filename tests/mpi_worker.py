"""Checks run on every rank under `mpiexec` by tests/dist/test_mpi.py (the mpi backend needs a
real MPI launcher, so these cannot run under ddptrain's spawn harness). Prints one line per rank."""
import sys

import torch

import ddptrain.comm as dist
from ddptrain.comm.types import RendezvousError

if len(sys.argv) > 1 and sys.argv[1] == "wrong-size":
    try:
        dist.init_process_group("mpi", world_size=5)
    except RendezvousError as exc:
        print("refused:", exc)
    sys.exit(0)

if len(sys.argv) > 1 and sys.argv[1] == "crash":
    dist.init_process_group("mpi", timeout=60)
    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 crashes on purpose")
    dist.barrier()  # rank 0 would wait here for ever: mpiexec must end the job instead
    sys.exit(0)

pg = dist.init_process_group("mpi", timeout=60)
r, n = dist.get_rank(), dist.get_world_size()
t = torch.ones(5) * (r + 1); dist.all_reduce(t); assert t[0] == n*(n+1)/2, t
a = torch.arange(11, dtype=torch.int64) * (r + 1); dist.ring_all_reduce(a); assert a[3] == 3 * n*(n+1)//2, a
outs = [torch.zeros(2) for _ in range(n)]; dist.all_gather(outs, torch.full((2,), float(r))); assert [o[0].item() for o in outs] == list(range(n))
b = torch.full((3,), float(r)); dist.broadcast(b, 1); assert b[0] == 1
x = torch.full((2,), float(r)); dist.all_reduce(x, op=dist.ReduceOp.AVG); assert abs(x[0] - (n-1)/2) < 1e-6
g = dist.new_group([0, 1]); y = torch.ones(1)
if r < 2: dist.all_reduce(y, group=g); assert y[0] == 2
h = torch.full((4,), float(r), dtype=torch.float16); dist.all_reduce(h); assert h[0] == n*(n-1)/2
o = torch.zeros(2); dist.reduce_scatter(o, [torch.full((2,), float(r + i)) for i in range(n)]); assert o[0] == sum(q + r for q in range(n))
dist.barrier()

# DDP over mpi: equal to one process on the global batch, identical on all ranks, real overlap
from ddptrain.comm.objects import all_gather_object
from tests.dist.test_ddp import _equivalence_case, _overlap_body
for name, cap, view in (("net", 0.001, False), ("mixed", 1, True), ("bn", 1, False)):
    res = _equivalence_case(r, n, name, cap, view)
    assert res["diff"] <= 1e-6, (name, res["diff"])
    digests = all_gather_object(pg, res["digest"])
    assert len(set(digests)) == 1, (name, digests)
ring = _equivalence_case(r, n, "net", 0.001, False, ring=True)
assert ring["diff"] <= 1e-6, ring
ov = _overlap_body(r, n)
assert ov["n"] >= 2 and ov["first_launch"] < ov["end"], ov
print("rank", r, "ok")
dist.destroy_process_group()
