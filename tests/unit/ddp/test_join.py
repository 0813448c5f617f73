"""``DistributedDataParallel.join`` on a threaded process group: ranks with uneven numbers of
batches end where torch DDP's join semantics put them — at each step the ranks still training
contribute their gradients, joined ranks zeros, and the sum is divided by the full world size."""

import copy

import pytest
import torch

import ddptrain.ddp.reducer as reducer_module
from ddptrain.comm.ring import RingAllReducer
from ddptrain.ddp import DistributedDataParallel as DDP
from ddptrain.ddp import allreduce_hook, ring_allreduce_hook
from ddptrain.testing import run_threaded
from tests.models import MODELS
from tests.unit.ddp.reference import WORLD_SIZES, assert_matches, train_rank, train_reference


def _counts(world_size):
    """Batches per rank: uneven, rank 0 not the busiest; at 8 ranks one rank has none at all."""
    return [(3 * r + 1) % 5 for r in range(world_size)]


def _branch_on_rank_one(model, rank):
    model.use_branch = rank == 1


# (id, model, DDP keywords, in-place threshold, comm hook, per-rank setup)
MODES = [
    ("flat", "net", {"bucket_cap_mb": 0.001}, None, None, None),
    ("in place", "net", {}, 0, None, None),
    ("bucket view", "net", {"gradient_as_bucket_view": True}, None, None, None),
    ("find unused", "branch", {"find_unused_parameters": True}, 0, None, _branch_on_rank_one),
    ("allreduce hook", "net", {"bucket_cap_mb": 0.001}, None, "allreduce", None),
    ("ring hook", "net", {"bucket_cap_mb": 0.001}, None, "ring", None),
]


def _join(rank, ws, template, ddp_kwargs, counts, hook=None, setup=None):
    model = copy.deepcopy(template)
    if setup is not None:
        setup(model, rank)
    ddp = DDP(model, **ddp_kwargs)
    if hook == "allreduce":
        ddp.register_comm_hook(None, allreduce_hook)
    elif hook == "ring":
        ddp.register_comm_hook(RingAllReducer(ddp.process_group), ring_allreduce_hook)
    with ddp.join():
        grads, _ = train_rank(ddp, rank, counts[rank])
    return grads, [p.detach().clone() for p in model.parameters()]  # after join's final broadcast


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("mode,model,ddp_kwargs,threshold,hook,setup", MODES, ids=[m[0] for m in MODES])
def test_uneven_inputs_match_the_reference(world_size, mode, model, ddp_kwargs, threshold, hook, setup, monkeypatch):
    if threshold is not None:
        monkeypatch.setattr(reducer_module, "DIRECT_MIN_BYTES", threshold)
    torch.manual_seed(0)
    template = MODELS[model]()
    counts = _counts(world_size)
    out = run_threaded(_join, world_size, template, ddp_kwargs, counts, hook, setup, timeout_s=120)
    reference = train_reference(template, world_size, max(counts), counts=counts, setup=setup)
    assert_matches(out, reference, f"join, {mode}, batches per rank {counts}")


def _join_with_buffers(rank, ws, template, counts):
    model = copy.deepcopy(template)
    ddp = DDP(model, bucket_cap_mb=0.01)
    with ddp.join():
        train_rank(ddp, rank, counts[rank])
    return [t.detach().clone() for t in list(model.parameters()) + list(model.buffers())]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_join_leaves_every_rank_with_the_same_parameters_and_buffers(world_size):
    torch.manual_seed(0)
    out = run_threaded(_join_with_buffers, world_size, MODELS["bn"](), _counts(world_size), timeout_s=120)
    for rank, tensors in enumerate(out):
        assert all(torch.equal(a, b) for a, b in zip(tensors, out[0])), f"rank {rank} differs from rank 0"
