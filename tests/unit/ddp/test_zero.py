"""ZeRO-1 and ZeRO-2 (``ddptrain.ddp.zero``) on the threaded group: the same bits as plain DDP.

Each rank trains the same small model twice on its own batches: once with plain DDP over the ring
all-reduce (``dist.algorithm=ring``) and the optimizer stepping whole tensors, once with
``ZeroOptimizer`` (ring reduce-scatter, shards, all-gather). After many steps the parameters must
be equal bit for bit, at world sizes 2, 3 and 4, stages 1 and 2, SGD with momentum, Adam and
AdamW with weight decay (each with two parameter groups). Small buckets and odd sizes make chunks
of unequal length that cut through parameters, and the buckets are rebuilt after the first
iteration (the shards' state is then re-split).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ddptrain.comm import api as comm_api
from ddptrain.comm.ring import RingAllReducer
from ddptrain.ddp import DistributedDataParallel as DDP
from ddptrain.ddp import ring_allreduce_hook
from ddptrain.ddp.zero import ZeroOptimizer
from ddptrain.testing import run_threaded

pytestmark = pytest.mark.timeout(300)

STEPS = 300
BUCKET_CAP_MB = 0.0004  # ~100 floats: several buckets, chunk bounds inside parameters


def _template() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 11), nn.Tanh(), nn.Linear(11, 3))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7919 * step + rank)
    return torch.randn(5, 7, generator=g), torch.randint(0, 3, (5,), generator=g)


def _optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    if name == "sgd":
        groups = [{"params": weights}, {"params": biases, "lr": 0.05, "momentum": 0.5}]
        return torch.optim.SGD(groups, lr=0.02, momentum=0.9, weight_decay=1e-3)
    if name == "adam":
        return torch.optim.Adam([{"params": weights}, {"params": biases, "lr": 3e-3}], lr=1e-3)
    groups = [{"params": weights, "weight_decay": 0.1}, {"params": biases, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=2e-3)


def _train(ddp: DDP, step_fn, zero_grad, rank: int, steps: int, clip: float | None = None, clip_fn=None):
    for step in range(steps):
        x, y = _batch(rank, step)
        F.cross_entropy(ddp(x), y).backward()
        if clip is not None:
            clip_fn(clip)
        step_fn()
        zero_grad()
    return [p.detach().clone() for p in ddp.module.parameters()]


def plain_ring(template, opt_name, steps, clip=None):
    """Plain DDP over the ring all-reduce: the reference."""
    pg = comm_api.get_process_group()
    model = copy.deepcopy(template)
    ddp = DDP(model, bucket_cap_mb=BUCKET_CAP_MB)
    ddp.register_comm_hook(RingAllReducer(pg), ring_allreduce_hook)
    opt = _optimizer(opt_name, model)
    clip_fn = lambda c: torch.nn.utils.clip_grad_norm_(model.parameters(), c)  # noqa: E731
    return _train(ddp, opt.step, opt.zero_grad, pg.rank(), steps, clip, clip_fn)


def zero_run(template, opt_name, stage, steps, algorithm="ring", clip=None):
    pg = comm_api.get_process_group()
    model = copy.deepcopy(template)
    ddp = DDP(model, bucket_cap_mb=BUCKET_CAP_MB)
    zero = ZeroOptimizer(ddp, _optimizer(opt_name, model), stage=stage, algorithm=algorithm)
    return _train(ddp, zero.step, zero.zero_grad, pg.rank(), steps, clip, zero.clip_grad_norm_)


def _both(rank, world_size, opt_name, stage, steps):
    template = _template()
    return plain_ring(template, opt_name, steps), zero_run(template, opt_name, stage, steps)


@pytest.mark.parametrize("opt_name", ["sgd", "adam", "adamw"])
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_bitwise_equal_to_plain_ring_ddp(world_size, stage, opt_name):
    results = run_threaded(_both, world_size, opt_name, stage, STEPS, timeout_s=240)
    for rank, (plain, zero) in enumerate(results):
        for i, (a, b) in enumerate(zip(plain, zero)):
            assert torch.equal(a, b), f"rank {rank} parameter {i}: max diff {(a - b).abs().max().item()}"
        assert all(torch.equal(a, b) for a, b in zip(zero, results[0][1])), "ranks diverged"
    initial = list(_template().parameters())
    assert not torch.equal(initial[0].detach(), results[0][0][0]), "nothing trained"
