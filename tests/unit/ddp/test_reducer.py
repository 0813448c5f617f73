"""The reducer on a threaded process group: averaged gradients equal a single-process reference on
every path a gradient can take (flat buffer, in place, bucket views), observed on the wire.

The reducer is driven the way ``DistributedDataParallel.forward`` drives it and nothing more,
so these tests see the reducer alone; tests/unit/ddp/test_module.py covers the module around it.
"""

import copy

import pytest
import torch

import ddptrain.ddp.reducer as reducer_module
from ddptrain.comm import api as comm_api
from ddptrain.ddp.buckets import MB
from ddptrain.ddp.reducer import Reducer
from ddptrain.testing import run_threaded
from tests.models import MODELS
from tests.recording_group import RecordingGroup
from tests.unit.ddp.reference import WORLD_SIZES, assert_matches, train_rank, train_reference

STEPS = 3


class Driven(torch.nn.Module):
    """A model whose forward drives ``reducer`` exactly as DistributedDataParallel.forward does."""

    def __init__(self, module, reducer):
        super().__init__()
        self.module = module
        self.reducer = reducer

    def forward(self, x):
        self.reducer.prepare_for_forward()
        out = self.module(x)
        self.reducer.prepare_for_backward(out, sync=True)
        return out


def _template(name):
    torch.manual_seed(0)
    return MODELS[name]()


def _reduce(rank, ws, template, cap_mb, as_view=False, setup=None):
    """Train a copy of ``template`` with a bare reducer on a recording group; the results and,
    per step, what the wire saw (calls, gradients reduced in place) plus the final layout."""
    model = copy.deepcopy(template)
    if setup is not None:
        setup(model, rank)
    params = list(model.parameters())
    wire = RecordingGroup(comm_api.get_process_group(), watch=params)
    names = [n for n, _ in model.named_parameters()]
    reducer = Reducer(params, names, wire, int(cap_mb * MB), gradient_as_bucket_view=as_view)
    seen = []

    def before_step(step):
        if step:
            seen.append([c.is_grad_of for c in wire.all_reduces])
        wire.all_reduces.clear()

    result = train_rank(Driven(model, reducer), rank, STEPS, hook=before_step)
    seen.append([c.is_grad_of for c in wire.all_reduces])
    shared = [p.grad.untyped_storage().data_ptr() for p in params]
    return result, {"calls": seen, "assignment": reducer.plan.assignment, "grad_storages": shared}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("cap_mb", [25, 0.001])
def test_flat_path_matches_the_reference(world_size, cap_mb):
    template = _template("net")
    out = run_threaded(_reduce, world_size, template, cap_mb, timeout_s=120)
    assert_matches([r for r, _ in out], train_reference(template, world_size, STEPS), f"flat cap {cap_mb}")
    for _, wire in out:  # every gradient went through a flat buffer: one all-reduce per bucket
        assert all(g is None for calls in wire["calls"] for g in calls)
        assert len(wire["calls"][-1]) == len(wire["assignment"])
        assert len(wire["assignment"]) == 1 if cap_mb == 25 else len(wire["assignment"]) >= 4


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("threshold", [0, 4096])
def test_in_place_path_matches_the_reference(world_size, threshold, monkeypatch):
    monkeypatch.setattr(reducer_module, "DIRECT_MIN_BYTES", threshold)
    template = _template("net")
    large = {i for i, p in enumerate(template.parameters()) if p.numel() * p.element_size() >= threshold}
    assert 0 < len(large) <= 8
    out = run_threaded(_reduce, world_size, template, 25, timeout_s=120)
    assert_matches([r for r, _ in out], train_reference(template, world_size, STEPS), f"in place >= {threshold}")
    for _, wire in out:  # seen on the wire: exactly the large gradients travel as themselves, once each
        first, *later = wire["calls"]
        # The first backward learns which gradients share storage: all of it through the buffers.
        assert [g for g in first if g is not None] == []
        for calls in later:
            assert sorted(g for g in calls if g is not None) == sorted(large)
            assert threshold > 0 or len(calls) == len(large)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_aliased_gradients_are_copied_not_changed_in_place(world_size, monkeypatch):
    monkeypatch.setattr(reducer_module, "DIRECT_MIN_BYTES", 0)
    template = _template("aliased")
    out = run_threaded(_reduce, world_size, template, 25, timeout_s=120)
    assert_matches([r for r, _ in out], train_reference(template, world_size, STEPS), "aliased")
    for _, wire in out:  # a and b share one gradient buffer: only fc's weight and bias go in place
        assert {g for g in wire["calls"][-1] if g is not None} == {2, 3}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_gradient_as_bucket_view(world_size, monkeypatch):
    monkeypatch.setattr(reducer_module, "DIRECT_MIN_BYTES", 0)  # ignored for bucket views
    template = _template("net")
    out = run_threaded(_reduce, world_size, template, 25, True, timeout_s=120)
    assert_matches([r for r, _ in out], train_reference(template, world_size, STEPS), "bucket view")
    for _, wire in out:  # one bucket: every gradient is a view of its one flat buffer
        assert len(set(wire["grad_storages"])) == 1
        assert all(g is None for calls in wire["calls"] for g in calls)


def _swap_on_ranks_but_zero(model, rank):
    model.swap = rank != 0


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_rebuild_follows_rank_zeros_gradient_order(world_size):
    """Rank 0 produces right's gradients first, the others left's; after the first iteration
    every rank must adopt rank 0's order (else their buckets and collectives would differ)."""
    template = _template("two_path")
    out = run_threaded(_reduce, world_size, template, 0, False, _swap_on_ranks_but_zero, timeout_s=120)
    reference = train_reference(template, world_size, STEPS, setup=_swap_on_ranks_but_zero)
    assert_matches([r for r, _ in out], reference, "two paths")
    layouts = [wire["assignment"] for _, wire in out]
    assert all(layout == layouts[0] for layout in layouts), layouts
    order = [i for bucket in layouts[0] for i in bucket]
    # parameters: left.weight 0, left.bias 1, right.weight 2, right.bias 3, head 4, 5
    assert order.index(2) < order.index(0) and order.index(3) < order.index(1), order


def _overlap(rank, ws):
    torch.manual_seed(0)
    model = MODELS["mlp"](width=256, depth=4)
    params = list(model.parameters())
    wire = RecordingGroup(comm_api.get_process_group(), watch=params)
    driven = Driven(model, Reducer(params, [str(i) for i in range(len(params))], wire, int(0.2 * MB)))
    x, y = torch.randn(4, 784), torch.randint(0, 10, (4,))
    for _ in range(3):
        wire.all_reduces.clear()
        for p in params:
            p.grad = None
        torch.nn.functional.nll_loss(driven(x), y).backward()
    return (
        len(params),
        [c.grads_missing for c in wire.all_reduces],
        [c.waits_with_grads_missing for c in wire.all_reduces],
    )


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_buckets_go_out_during_backward_and_nothing_waits_before_its_end(world_size):
    for n_params, at_call, at_wait in run_threaded(_overlap, world_size, timeout_s=120):
        assert len(at_call) >= 2 and 0 < at_call[0] < n_params, at_call
        assert all(waits and max(waits) == 0 for waits in at_wait), at_wait


def _with_sideband(rank, ws, template, in_place_min_bytes, hook):
    """Train with a sideband of ``[rank + step, 1]``: the wire's all-reduces per step, each step's
    sums, and how often the values were asked for."""
    from ddptrain.ddp import DistributedDataParallel, allreduce_hook

    reducer_module.DIRECT_MIN_BYTES = in_place_min_bytes  # read when the reducer is built
    model = copy.deepcopy(template)
    wire = RecordingGroup(comm_api.get_process_group(), watch=list(model.parameters()))
    ddp = DistributedDataParallel(model, process_group=wire)
    if hook:
        ddp.register_comm_hook(None, allreduce_hook)
    step, asked, calls, sums = [0], [], [], []
    ddp.register_sideband(2, lambda: asked.append(step[0]) or [float(rank + step[0]), 1.0])

    def before_step(s):
        if s:
            calls.append(len(wire.all_reduces))
            sums.append(ddp.take_sideband())
        step[0] = s
        wire.all_reduces.clear()

    result = train_rank(ddp, rank, STEPS, micro=2, hook=before_step)  # no_sync backward: casts nothing
    calls.append(len(wire.all_reduces))
    sums.append(ddp.take_sideband())
    transfers = [len(b.transfers) for b in ddp.reducer.plan.buckets]
    return result, {"calls": calls, "sums": sums, "asked": asked, "transfers": transfers}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize(
    "case, in_place_min_bytes, hook",
    [("rides in the flat run", 1 << 20, False), ("every gradient in place", 0, False), ("comm hook", 1 << 20, True)],
)
def test_sideband_sums_over_ranks_without_changing_gradients(world_size, case, in_place_min_bytes, hook, monkeypatch):
    monkeypatch.setattr(reducer_module, "DIRECT_MIN_BYTES", reducer_module.DIRECT_MIN_BYTES)  # restored after
    template = _template("net")
    out = run_threaded(_with_sideband, world_size, template, in_place_min_bytes, hook, timeout_s=120)
    assert_matches([r for r, _ in out], train_reference(template, world_size, STEPS, micro=2), case)
    ranks = sum(range(world_size))
    for _, seen in out:
        assert seen["sums"] == [[float(ranks + world_size * s), float(world_size)] for s in range(STEPS)], seen
        assert seen["asked"] == list(range(STEPS))  # once per synchronised backward
        # Riding: exactly the bucket's own all-reduces. Otherwise (no flat run ends a bucket, or
        # a hook, which may compress) one small all-reduce more.
        own = len(seen["transfers"]) if hook else sum(seen["transfers"])
        extra = 0 if case == "rides in the flat run" else 1
        assert seen["calls"] == [own + extra] * STEPS, seen


class _AliasesLater(torch.nn.Module):
    """Gradients of ``a`` and ``b`` are separate tensors until ``alias`` is set; then autograd hands
    both out as views of one buffer (as in ``AliasedGradsNet``)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(28, 28) / 28)
        self.b = torch.nn.Parameter(torch.randn(28, 28) / 28)
        self.alias = False

    def forward(self, x):
        flat = x.view(len(x), -1)
        if self.alias:
            return ((self.a.view(-1) + self.b.view(-1)) * flat).sum(1)
        return (self.a.view(-1) * flat).sum(1) + (self.b.view(-1) * flat.flip(1)).sum(1)


def _aliasing_changes(rank, ws):
    model = _AliasesLater()
    reducer = Reducer(list(model.parameters()), ["a", "b"], comm_api.get_process_group(), 25 * MB)
    driven = Driven(model, reducer)
    x = torch.randn(4, 1, 28, 28)
    for step in range(3):
        model.alias = step == 2
        for p in model.parameters():
            p.grad = None
        try:
            driven(x).sum().backward()
        except RuntimeError as exc:
            return step, sorted(reducer.shares_storage), str(exc)
    return None


def test_gradients_that_start_sharing_storage_after_the_first_backward_fail_loudly(monkeypatch):
    """The first backward learns that a and b have gradients of their own, so both go in place;
    when the graph later makes autograd hand them one buffer, the reducer must say so, not
    return an average it computed on a buffer changed under it."""
    monkeypatch.setattr(reducer_module, "DIRECT_MIN_BYTES", 0)
    for step, learnt, message in run_threaded(_aliasing_changes, 2, timeout_s=60):
        assert step == 2 and learnt == []
        assert "shared one buffer in this backward but not in the first one" in message
        assert "gradient_as_bucket_view=True" in message
