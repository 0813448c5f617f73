"""NCCL paths: collectives and DDP on CUDA tensors. Skipped without two GPUs (none in CI here)."""

import copy

import pytest
import torch
import torch.nn.functional as F

import ddptrain.comm as dist
from ddptrain.ddp import DistributedDataParallel as DDP
from ddptrain.testing import run_distributed
from tests.models import Net

pytestmark = [
    pytest.mark.dist,
    pytest.mark.timeout(180),
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="NCCL needs two CUDA GPUs; this machine has "
        f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}",
    ),
]


def _nccl_body(rank, ws):
    torch.cuda.set_device(rank)
    t = torch.full((1000,), float(rank + 1), device="cuda")
    dist.all_reduce(t)
    avg = torch.full((4,), float(rank), device="cuda")
    dist.all_reduce(avg, op=dist.ReduceOp.AVG)
    torch.manual_seed(0)
    model = Net().cuda()
    ref = copy.deepcopy(model)
    ddp = DDP(model, device_ids=[rank], bucket_cap_mb=0.01)
    x = torch.randn(16, 1, 28, 28, device="cuda")
    y = torch.randint(0, 10, (16,), device="cuda")
    F.nll_loss(ddp(x[rank * 8 : (rank + 1) * 8]), y[rank * 8 : (rank + 1) * 8]).backward()
    F.nll_loss(ref(x), y).backward()
    diff = max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    return t[0].item(), avg[0].item(), diff


def test_nccl_collectives_and_ddp():
    for total, avg, diff in run_distributed(_nccl_body, 2, backend="nccl", timeout_s=150):
        assert total == 3.0 and avg == 0.5 and diff < 1e-5
