"""Communication hooks on a threaded process group: exact hooks (all-reduce, the ring, PowerSGD
before its start) give the reference's gradients; compression hooks put half precision on the
wire; the ring carries buckets over point-to-point messages, in the same order on every rank."""

import copy

import pytest
import torch

from ddptrain.comm import api as comm_api
from ddptrain.comm.ring import RingAllReducer
from ddptrain.ddp import DistributedDataParallel as DDP
from ddptrain.ddp import (
    PowerSGDState,
    allreduce_hook,
    bf16_compress_hook,
    fp16_compress_hook,
    powerSGD_hook,
    ring_allreduce_hook,
)
from ddptrain.testing import run_threaded
from tests.models import MODELS
from tests.recording_group import RecordingGroup
from tests.unit.ddp.reference import WORLD_SIZES, assert_matches, max_diff, train_rank, train_reference

STEPS = 3


def _out_of_place_hook(state, bucket):
    """Reduces a copy and returns it, leaving the bucket's buffer as it was: DDP must copy it back."""
    pg = bucket.process_group
    averaged = bucket.buffer().div(pg.size())
    return pg.all_reduce(averaged).get_future().then(lambda fut: fut.value()[0])


def _hook_and_state(name, group):
    return {
        "allreduce": (allreduce_hook, None),
        "out of place": (_out_of_place_hook, None),
        "ring": (ring_allreduce_hook, RingAllReducer(group)),
        "powerSGD before start": (powerSGD_hook, PowerSGDState(None, start_powerSGD_iter=100)),
        "fp16": (fp16_compress_hook, None),
        "bf16": (bf16_compress_hook, None),
    }[name]


def _hooked(rank, ws, template, hook_name, steps=STEPS):
    model = copy.deepcopy(template)
    wire = RecordingGroup(comm_api.get_process_group(), watch=list(model.parameters()))
    ddp = DDP(model, process_group=wire, bucket_cap_mb=0.001)
    hook, state = _hook_and_state(hook_name, wire)
    ddp.register_comm_hook(state, hook)
    wire.all_reduces.clear()  # construction's model check
    result = train_rank(ddp, rank, steps)
    seen = {"dtypes": sorted({str(c.dtype) for c in wire.all_reduces}), "sends": wire.sends}
    return result, seen


def _template():
    torch.manual_seed(0)
    return MODELS["net"]()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("hook_name", ["allreduce", "out of place", "ring", "powerSGD before start"])
def test_exact_hooks_match_the_reference(world_size, hook_name):
    template = _template()
    out = run_threaded(_hooked, world_size, template, hook_name, timeout_s=120)
    assert_matches([r for r, _ in out], train_reference(template, world_size, STEPS), hook_name)
    for _, seen in out:
        if hook_name == "ring":  # point-to-point only: no bucket was all-reduced by the backend
            assert seen["dtypes"] == [] and seen["sends"] > 0, seen
        else:
            assert seen["dtypes"] == ["torch.float32"] and seen["sends"] == 0, seen


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("hook_name,dtype,rel_tol", [("fp16", "torch.float16", 1e-2), ("bf16", "torch.bfloat16", 3e-2)])
def test_compression_hooks_send_half_precision(world_size, hook_name, dtype, rel_tol):
    template = _template()
    out = run_threaded(_hooked, world_size, template, hook_name, 1, timeout_s=120)
    (ref_grads,), _ = train_reference(template, world_size, 1)
    for (grads, _), seen in out:
        assert seen["dtypes"] == [dtype], seen
        for g, r in zip(grads[0], ref_grads):
            assert max_diff([g], [r]) <= rel_tol * r.abs().max().item()


def _wrong_ring_state(rank, ws):
    ddp = DDP(torch.nn.Linear(4, 4))
    ddp.register_comm_hook(None, ring_allreduce_hook)
    try:
        ddp(torch.ones(1, 4)).sum().backward()
    except TypeError as exc:
        return str(exc)
    return None


def test_ring_hook_without_its_state_says_how_to_register_it():
    for message in run_threaded(_wrong_ring_state, 2, timeout_s=30):
        assert message is not None and "RingAllReducer(ddp.process_group)" in message, message
