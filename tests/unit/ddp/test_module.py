"""DistributedDataParallel on a threaded process group: no_sync, find_unused_parameters, the
construction broadcast, stats and the errors users meet, against a single-process reference."""

import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import ddptrain.ddp.reducer as reducer_module
from ddptrain.comm import api as comm_api
from ddptrain.ddp import DistributedDataParallel as DDP
from ddptrain.ddp import allreduce_hook
from ddptrain.testing import run_threaded
from tests.models import MODELS
from tests.recording_group import RecordingGroup
from tests.unit.ddp.reference import WORLD_SIZES, assert_matches, rank_loss, train_rank, train_reference

STEPS = 3
# (name, DDP keywords, in-place threshold): the three paths a gradient can take
MODES = [
    ("flat", {"bucket_cap_mb": 0.001}, None),
    ("in place", {}, 0),
    ("bucket view", {"gradient_as_bucket_view": True}, None),
]


def _template(name):
    torch.manual_seed(0)
    return MODELS[name]()


def _train(rank, ws, template, ddp_kwargs, micro=1, setup=None):
    model = copy.deepcopy(template)
    if setup is not None:
        setup(model, rank)
    return train_rank(DDP(model, **ddp_kwargs), rank, STEPS, micro=micro)


def _train_and_count_no_sync_messages(rank, ws, template, ddp_kwargs, micro):
    model = copy.deepcopy(template)
    wire = RecordingGroup(comm_api.get_process_group())
    ddp = DDP(model, process_group=wire, **ddp_kwargs)
    result = train_rank(ddp, rank, STEPS, micro=micro)
    wire.all_reduces.clear()
    with ddp.no_sync():
        rank_loss(ddp, rank, 0).backward()
    return result, len(wire.all_reduces)


def _modes():
    return pytest.mark.parametrize("mode,ddp_kwargs,threshold", MODES, ids=[m[0] for m in MODES])


def _set_threshold(monkeypatch, threshold):
    if threshold is not None:
        monkeypatch.setattr(reducer_module, "DIRECT_MIN_BYTES", threshold)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@_modes()
def test_no_sync_accumulates_then_averages_the_sum(world_size, mode, ddp_kwargs, threshold, monkeypatch):
    _set_threshold(monkeypatch, threshold)
    template = _template("net")
    out = run_threaded(_train_and_count_no_sync_messages, world_size, template, ddp_kwargs, 3, timeout_s=120)
    assert_matches([r for r, _ in out], train_reference(template, world_size, STEPS, micro=3), f"no_sync, {mode}")
    assert [n for _, n in out] == [0] * world_size  # a backward under no_sync() sends nothing


def _branch_on_rank_zero(model, rank):
    model.use_branch = rank == 0


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@_modes()
def test_find_unused_parameters(world_size, mode, ddp_kwargs, threshold, monkeypatch):
    """'branch' is used by rank 0 only, 'never' by no rank: its gradient stays None everywhere."""
    _set_threshold(monkeypatch, threshold)
    template = _template("branch")
    kwargs = dict(ddp_kwargs, find_unused_parameters=True)
    out = run_threaded(_train, world_size, template, kwargs, 1, _branch_on_rank_zero, timeout_s=120)
    reference = train_reference(template, world_size, STEPS, setup=_branch_on_rank_zero)
    assert_matches(out, reference, f"find_unused, {mode}")
    names = [n for n, _ in template.named_parameters()]
    for grads, _ in out:
        never = [g for n, g in zip(names, grads[-1]) if n.startswith("never.")]
        branch = [g for n, g in zip(names, grads[-1]) if n.startswith("branch.")]
        assert never == [None, None] and all(g is not None for g in branch)


def _start_apart(rank, ws, template):
    model = copy.deepcopy(template)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(rank)  # every rank starts elsewhere
    DDP(model)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_construction_broadcasts_rank_zeros_parameters(world_size):
    template = _template("net")
    for params in run_threaded(_start_apart, world_size, template, timeout_s=60):
        assert all(torch.equal(p, t) for p, t in zip(params, template.parameters()))


def _stats(rank, ws, template):
    ddp = DDP(copy.deepcopy(template), bucket_cap_mb=0.001)
    train_rank(ddp, rank, STEPS)
    s = ddp.last_iteration_stats
    return s.iteration, s.rebuilt_buckets, s.finalize_wait_s, s.launch_offsets_s, sum(s.bucket_bytes)


def test_last_iteration_stats_describe_the_last_backward():
    template = _template("net")
    nbytes = sum(p.numel() * p.element_size() for p in template.parameters())
    for iteration, rebuilt, wait_s, offsets, bucket_bytes in run_threaded(_stats, 2, template, timeout_s=60):
        assert iteration == STEPS - 1 and rebuilt and wait_s >= 0
        assert len(offsets) >= 4 and all(o is not None and o >= 0 for o in offsets)
        assert bucket_bytes == nbytes


def _errors(rank, ws):
    out = {}
    ddp = DDP(_template("branch"))  # 'branch' and 'never' get no gradient
    rank_loss(ddp, rank, 0).backward()
    try:
        rank_loss(ddp, rank, 1)
    except RuntimeError as exc:
        out["unused"] = str(exc)
    lin = torch.nn.Linear(4, 4)
    ddp = DDP(lin)
    try:  # the layer runs once outside and again inside a reentrant checkpoint
        checkpoint(lin, ddp(torch.ones(2, 4, requires_grad=True)), use_reentrant=True).sum().backward()
    except RuntimeError as exc:
        out["twice"] = str(exc)
    ddp = DDP(torch.nn.Linear(4, 4))
    ddp.register_comm_hook(None, allreduce_hook)
    try:
        ddp.register_comm_hook(None, allreduce_hook)
    except RuntimeError as exc:
        out["hook twice"] = str(exc)
    try:
        DDP(torch.nn.Linear(4, 4 + rank))
    except ValueError as exc:
        out["differs"] = str(exc)
    return out


def test_errors_name_the_rule_and_the_fix():
    for r in run_threaded(_errors, 2, timeout_s=60):
        assert "did not: branch.weight, branch.bias, never.weight, never.bias" in r["unused"], r
        assert "find_unused_parameters=True" in r["unused"]
        assert "marked ready twice" in r["twice"] and "use_reentrant=False" in r["twice"], r
        assert "can only be called once" in r["hook twice"], r
        assert "ranks disagree" in r["differs"] and "rank 1" in r["differs"], r
