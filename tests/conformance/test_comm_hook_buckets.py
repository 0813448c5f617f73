"""What a comm hook sees of the buckets, and the built-in hooks, against the installed torch DDP.

A hook that keeps state per bucket (PowerSGD keys its error feedback by ``bucket.index()`` and
counts iterations on ``bucket.is_last()``) relies on these: in each backward every bucket has its
own index, and exactly one bucket — the last one handed to the hook — says it is the last, sparse
gradients' buckets included.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ddptrain.ddp import DistributedDataParallel as OurDDP
from ddptrain.testing import run_distributed
from tests.conformance.test_against_torch_ddp import SparseBag, _bits, _ddp_class, _init_torch_group, _raised

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]


class TwoSparse(SparseBag):
    def __init__(self):
        super().__init__()
        self.extra = nn.Embedding(10, 10, sparse=True)

    def forward(self, x):
        return super().forward(x) + self.extra(x).sum(1)[:, :3]


def _recording_hook(calls):
    import torch.distributed as tdist

    def hook(state, bucket):
        calls[-1].append((bucket.index(), bucket.is_last()))
        buffer = bucket.buffer()
        fut = tdist.all_reduce(buffer, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0] / tdist.get_world_size())

    return hook


def _buckets_case(rank, ws, impl, model_name):
    torch.manual_seed(0)
    if model_name == "sparse":  # two sparse gradients, each a bucket of its own, after the dense ones
        model, make = TwoSparse(), lambda g: torch.randint(0, 10, (4, 3), generator=g)
    else:  # many small buckets
        model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
        make = lambda g: torch.randn(4, 8, generator=g)  # noqa: E731
    ddp = _ddp_class(impl)(model, bucket_cap_mb=0.0005)
    calls = []
    ddp.register_comm_hook(None, _recording_hook(calls))
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        calls.append([])
        ddp(make(g)).float().pow(2).mean().backward()
    return calls


def _builtin_case(rank, ws, impl, kind):
    import torch.distributed as tdist

    torch.manual_seed(0)
    ddp = _ddp_class(impl)(nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2)))
    ddp._register_builtin_comm_hook(getattr(tdist.BuiltinCommHookType, kind))
    g = torch.Generator().manual_seed(rank)
    registered = _raised(lambda: ddp.register_comm_hook(None, _recording_hook([])))  # a second hook
    F.mse_loss(ddp(torch.randn(4, 6, generator=g)), torch.zeros(4, 2)).backward()
    return {"grads": [_bits(p.grad) for p in ddp.module.parameters()], "second_hook": registered}


def _body(rank, ws):
    _init_torch_group(rank, ws)
    out = {}
    for impl in ("torch", "ours"):
        out[impl] = {
            "dense": _buckets_case(rank, ws, impl, "dense"),
            "sparse": _buckets_case(rank, ws, impl, "sparse"),
            "ALLREDUCE": _builtin_case(rank, ws, impl, "ALLREDUCE"),
            "FP16_COMPRESS": _builtin_case(rank, ws, impl, "FP16_COMPRESS"),
        }
    ddp = OurDDP(nn.Linear(2, 2))
    out["unknown_builtin"] = _raised(lambda: ddp._register_builtin_comm_hook("NO_SUCH_HOOK"))

    def renamed(state, grads: int):  # the second parameter need not be called "bucket"
        return None

    out["renamed_int"] = _raised(lambda: ddp.register_comm_hook(None, renamed))
    return out


@pytest.fixture(scope="module")
def worlds():
    return run_distributed(_body, 2, timeout_s=200)


@pytest.mark.parametrize("model", ["dense", "sparse"])
def test_each_backward_hands_the_hook_distinct_buckets_and_one_last(worlds, model):
    for r in worlds:
        for impl in ("torch", "ours"):
            for calls in r[impl][model]:
                indices = [index for index, _ in calls]
                assert len(set(indices)) == len(indices), (impl, calls)
                assert [last for _, last in calls] == [False] * (len(calls) - 1) + [True], (impl, calls)
            assert len(r[impl][model][-1]) >= 2, (impl, r[impl][model])  # rebuilt to the tiny cap
        # as many buckets as torch's, sparse gradients' included, once both have rebuilt
        assert len(r["ours"][model][-1]) == len(r["torch"][model][-1])


@pytest.mark.parametrize("kind", ["ALLREDUCE", "FP16_COMPRESS"])
def test_builtin_comm_hooks_average_as_torch_ddp(worlds, kind):
    tolerance = 1e-6 if kind == "ALLREDUCE" else 2e-3  # torch divides after the sum, ours before
    for r in worlds:
        for impl in ("torch", "ours"):  # the built-in hook took the one place a hook has
            kind_, message = r[impl][kind]["second_hook"]
            assert kind_ == "RuntimeError" and "can only be called once" in message, (impl, message)
        ours = [v for p in r["ours"][kind]["grads"] for v in p]
        theirs = [v for p in r["torch"][kind]["grads"] for v in p]
        assert len(ours) == len(theirs)
        assert all(abs(a - b) <= tolerance * (1 + abs(b)) for a, b in zip(ours, theirs)), kind
    assert worlds[0]["ours"][kind] == worlds[1]["ours"][kind]


def test_hook_checks_name_the_problem(worlds):
    kind, message = worlds[0]["unknown_builtin"]
    assert kind == "ValueError" and "NO_SUCH_HOOK" in message and "ALLREDUCE" in message
    kind, message = worlds[0]["renamed_int"]
    assert kind == "ValueError" and "bucket annotation should be dist.GradBucket" in message
