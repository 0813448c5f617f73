"""ddptrain's DDP against the installed torch DDP, case by case, in one 2-rank gloo world.

The behaviours torch's own CPU tests of DDP check (``test_c10d_gloo.py``'s
``DistributedDataParallelTest`` and ``distributed_test.py``; see docs/torch-ddp-conformance.md),
written here as comparisons: each case runs the same model, inputs and calls through torch's
class and ours and returns what a user can observe — gradients, parameters, exception types and
messages. The parent asserts that ours equals torch's (bitwise where torch is deterministic).
"""

import copy
import io
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ddptrain.comm as dist
from ddptrain.ddp import DistributedDataParallel as OurDDP
from ddptrain.ddp import allreduce_hook
from ddptrain.testing import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]

IMPLS = ("torch", "ours")


def _ddp_class(impl):
    return torch.nn.parallel.DistributedDataParallel if impl == "torch" else OurDDP


def _init_torch_group(rank, ws):
    import torch.distributed as tdist

    tdist.init_process_group("gloo", store=tdist.PrefixStore("torch", dist.get_store().c10d), rank=rank, world_size=ws)


def _bits(t: torch.Tensor) -> list:
    """A tensor's exact contents (sparse ones densified after coalescing)."""
    t = t.detach()
    if t.layout != torch.strided:
        t = t.coalesce().to_dense()
    return t.reshape(-1).tolist()


def _raised(fn) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as exc:  # the type and text are what the case compares
        return type(exc).__name__, str(exc)
    return None


# -- sparse gradients --------------------------------------------------------------------------
class SparseBag(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(10, 10, sparse=True)
        self.head = nn.Linear(10, 3)

    def forward(self, x):
        return self.head(self.bag(x))


def _torch_style_sparse_hook(state, bucket):
    """The hook of torch's test_ddp_comm_hook_sparse_gradients, over torch.distributed."""
    import torch.distributed as tdist

    tensor = bucket.buffer()
    fut = tdist.all_reduce(tensor, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0] / tdist.get_world_size())


def _sparse_case(rank, ws, impl, hook, as_view):
    torch.manual_seed(1337)
    model = SparseBag()
    ddp = _ddp_class(impl)(copy.deepcopy(model), gradient_as_bucket_view=as_view)
    if hook == "torch-style":
        ddp.register_comm_hook(None, _torch_style_sparse_hook)
    elif hook == "allreduce":
        ddp.register_comm_hook(None, allreduce_hook if impl == "ours" else _torch_allreduce_hook())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(7)
    grads, layouts = [], []
    for _ in range(3):
        x = torch.randint(0, 10, (4 * ws, 3), generator=g)
        y = torch.randint(0, 3, (4 * ws,), generator=g)
        mine = slice(4 * rank, 4 * rank + 4)
        opt.zero_grad()
        F.cross_entropy(ddp(x[mine]), y[mine]).backward()
        layouts.append(str(ddp.module.bag.weight.grad.layout))
        grads.append([_bits(p.grad) for p in ddp.module.parameters()])
        opt.step()
    return {"grads": grads, "layouts": layouts, "params": [_bits(p) for p in ddp.module.parameters()]}


def _torch_allreduce_hook():
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return lambda state, bucket: default_hooks.allreduce_hook(None, bucket)


def _sparse_reference(ws):
    """The single-process gradients of the whole batch, to check both against."""
    torch.manual_seed(1337)
    model = SparseBag()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(7)
    grads = []
    for _ in range(3):
        x = torch.randint(0, 10, (4 * ws, 3), generator=g)
        y = torch.randint(0, 3, (4 * ws,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        grads.append([_bits(p.grad) for p in model.parameters()])
        opt.step()
    return grads


class SometimesEmbedded(nn.Module):
    """A sparse embedding that rank 1 skips on its first step: its gradient is missing there."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4, sparse=True)
        self.head = nn.Linear(4, 3)

    def forward(self, x, use_embedding):
        return self.head(self.emb(x).mean(1) if use_embedding else torch.ones(len(x), 4))


def _sparse_batches(rank):
    g = torch.Generator().manual_seed(50 + rank)
    return [(torch.randint(0, 10, (4, 3), generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(2)]


def _sparse_unused_here_case(rank, ws):
    """Ours only: torch's DDP hangs here (the rank without the sparse gradient fails its check
    and its peer waits in backward). Ours sends an empty sparse gradient from that rank."""
    torch.manual_seed(5)
    ddp = OurDDP(SometimesEmbedded(), find_unused_parameters=True)
    grads = []
    for step, (x, y) in enumerate(_sparse_batches(rank)):
        ddp.zero_grad(set_to_none=True)
        F.cross_entropy(ddp(x, use_embedding=rank == 0 or step == 1), y).backward()
        grads.append([(str(p.grad.layout), _bits(p.grad)) for p in ddp.module.parameters()])
    return grads


def _sparse_unused_here_reference(ws):
    """Each step's gradients averaged over the ranks' batches, in one process."""
    torch.manual_seed(5)
    model = SometimesEmbedded()
    batches = [_sparse_batches(rank) for rank in range(ws)]
    steps = []
    for step in range(2):
        per_rank = []
        for rank in range(ws):
            model.zero_grad(set_to_none=True)
            x, y = batches[rank][step]
            F.cross_entropy(model(x, use_embedding=rank == 0 or step == 1), y).backward()
            per_rank.append([torch.zeros_like(p) if p.grad is None else p.grad.to_dense() for p in model.parameters()])
        steps.append([_bits(sum(gs) / ws) for gs in zip(*per_rank)])
    return steps


# -- double backward ---------------------------------------------------------------------------
class Square(nn.Module):
    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.tensor([1.0, -2.0, 0.5]))

    def forward(self, x):
        return (self.p.pow(2) * x).sum()


def _double_backward_case(rank, ws, impl):
    torch.manual_seed(0)
    ddp = _ddp_class(impl)(Square())
    x = torch.tensor([1.0, 2.0, 3.0]) * (rank + 1)
    out = {}
    # backward(create_graph=True): .grad is the average and stays differentiable
    ddp(x).backward(create_graph=True)
    grad = ddp.module.p.grad
    out["create_graph_grad"] = _bits(grad)
    out["grad_requires_grad"] = grad.requires_grad
    (second,) = torch.autograd.grad(grad.sum(), ddp.module.p)
    out["second_order"] = _bits(second)
    ddp.module.p.grad = None
    # a gradient penalty (WGAN-GP): the inner gradient by autograd.grad, one backward
    for _ in range(2):
        ddp.module.p.grad = None
        loss = ddp(x)
        (inner,) = torch.autograd.grad(loss, ddp.module.p, create_graph=True)
        (loss + inner.pow(2).sum()).backward()
        out.setdefault("penalty_grads", []).append(_bits(ddp.module.p.grad))
    return out


# -- pickling and deepcopy ---------------------------------------------------------------------
def _train(ddp, rank, steps, seed):
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(seed + rank)  # each rank its own data: only the sync equalises
    for _ in range(steps):
        opt.zero_grad()
        ddp(torch.randn(4, 6, generator=g)).pow(2).mean().backward()
        opt.step()
    return [_bits(p) for p in ddp.module.parameters()]


def _pickle_case(rank, ws, impl):
    cls = _ddp_class(impl)
    torch.manual_seed(0)
    ddp = cls(nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2)))
    _train(ddp, rank, 2, seed=10)
    buf = io.BytesIO()
    torch.save(ddp, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    copied = copy.deepcopy(ddp)
    out = {"loaded_type": type(loaded).__name__, "copied_type": type(copied).__name__}
    out["state_equal"] = all(torch.equal(a, b) for a, b in zip(ddp.state_dict().values(), loaded.state_dict().values()))
    out["original"] = _train(ddp, rank, 3, seed=20)
    out["loaded"] = _train(loaded, rank, 3, seed=20)
    out["copied"] = _train(copied, rank, 3, seed=20)
    # a group passed explicitly cannot be found again by the copy: refused, as torch refuses it
    import torch.distributed as tdist

    group = tdist.new_group([0, 1]) if impl == "torch" else dist.new_group([0, 1])
    explicit = cls(nn.Linear(2, 2), process_group=group)
    out["explicit_group"] = _raised(lambda: torch.save(explicit, io.BytesIO()))
    return out


# -- exceptions and hook checks ----------------------------------------------------------------
class HookModule(nn.Module):
    """torch's ModuleForDdpCommHook: ``p + x + rank``."""

    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.ones(2, 2))

    def forward(self, x, rank):
        return self.p + x + rank


def _errors_case(rank, ws, impl):
    import torch.distributed as tdist

    cls = _ddp_class(impl)
    out = {"no_params": _raised(lambda: cls(nn.Module()))}
    out["frozen"] = _raised(lambda: cls(nn.Linear(2, 2).requires_grad_(False)))

    def bucket_int(state, bucket: int):
        return None

    def returns_int(state, bucket) -> int:
        return 1

    def annotated(state, bucket: tdist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        return tdist.all_reduce(bucket.buffer(), async_op=True).get_future()

    def returns_one(state, bucket):
        return 1

    ddp = cls(HookModule())
    out["not_callable"] = _raised(lambda: ddp.register_comm_hook(None, 1))
    out["bucket_int"] = _raised(lambda: ddp.register_comm_hook(None, bucket_int))
    out["returns_int"] = _raised(lambda: ddp.register_comm_hook(None, returns_int))
    out["after_failures"] = _raised(lambda: ddp.register_comm_hook(None, returns_one))  # failures did not count
    out["twice"] = _raised(lambda: ddp.register_comm_hook(None, annotated))
    out["non_future"] = _raised(lambda: ddp(torch.full((2, 2), 8.0), rank).mean().backward())

    ok = cls(HookModule())
    out["annotated"] = _raised(lambda: ok.register_comm_hook(None, annotated))

    # a hook whose future holds a plain tensor: its value replaces the gradient, undivided
    passing = cls(HookModule())

    def plus_one(state, bucket):
        fut = torch.futures.Future()
        fut.set_result(torch.ones_like(bucket.buffer()))
        return fut.then(lambda f: f.value() + 1)

    passing.register_comm_hook(None, plus_one)
    passing(torch.zeros(2, 2), rank).mean().backward()
    out["future_passing"] = _bits(passing.module.p.grad)

    return out


# -- torch's c10d training cases ---------------------------------------------------------------
class NoBiasNet(nn.Module):
    """torch's test ``Net``: three Linear layers without bias, softmax."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(2, 10, bias=False)
        self.fc2 = nn.Linear(10, 50, bias=False)
        self.fc3 = nn.Linear(50, 4, bias=False)

    def forward(self, x):
        return F.softmax(self.fc3(F.relu(self.fc2(F.relu(self.fc1(x))))), dim=1)


class UnusedNet(NoBiasNet):
    def forward(self, x):  # fc3 unused
        return F.softmax(self.fc2(F.relu(self.fc1(x))), dim=1)


def _training_case(rank, ws, impl, as_view):
    torch.manual_seed(3)
    ddp = _ddp_class(impl)(NoBiasNet(), bucket_cap_mb=0.001, gradient_as_bucket_view=as_view)
    g = torch.Generator().manual_seed(1337)
    x, y = torch.randn(2 * ws, 2, generator=g), torch.randn(2 * ws, 4, generator=g)
    for _ in range(2):
        mine = slice(2 * rank, 2 * rank + 2)
        F.mse_loss(ddp(x[mine]), y[mine]).backward()
        with torch.no_grad():
            for p in ddp.parameters():
                p -= p.grad
                p.grad = None
        x = x[torch.randperm(len(x), generator=g)]
    return [_bits(p) for p in ddp.module.parameters()]


class SkippableNet(NoBiasNet):
    def forward(self, x, skip_fc3=False):
        h = F.relu(self.fc2(F.relu(self.fc1(x))))
        return h if skip_fc3 else self.fc3(h)


def _no_sync_then_unused_case(rank, ws, impl, as_view):
    """fc3 gets a gradient in a no_sync backward, then no rank uses it in the synchronised one:
    its accumulated local gradient is left as it is, as torch leaves it."""
    torch.manual_seed(4)
    ddp = _ddp_class(impl)(SkippableNet(), find_unused_parameters=True, gradient_as_bucket_view=as_view)
    x = torch.randn(3, 2, generator=torch.Generator().manual_seed(rank))
    with ddp.no_sync():
        ddp(x).pow(2).mean().backward()
    ddp(x, skip_fc3=True).pow(2).mean().backward()
    return [None if p.grad is None else _bits(p.grad) for p in ddp.module.parameters()]


def _own_grad_unused_case(rank, ws, impl, as_view):
    """fc3 holds a gradient this rank set itself, and no rank's backward reaches fc3: DDP leaves
    that gradient alone (rank-local), as torch does."""
    torch.manual_seed(4)
    ddp = _ddp_class(impl)(SkippableNet(), find_unused_parameters=True, gradient_as_bucket_view=as_view)
    ddp.module.fc3.weight.grad = torch.full_like(ddp.module.fc3.weight, float(rank + 1))
    ddp(torch.randn(3, 2, generator=torch.Generator().manual_seed(rank)), skip_fc3=True).pow(2).mean().backward()
    return [None if p.grad is None else _bits(p.grad) for p in ddp.module.parameters()]


def _ignored_output_case(rank, ws, impl, unused):
    torch.manual_seed(3)
    model = UnusedNet() if unused else NoBiasNet()
    ddp = _ddp_class(impl)(model, find_unused_parameters=unused)
    x = torch.randn(4, 2)
    for _ in range(4):
        ddp(x)  # outputs ignored: no backward
    labels = torch.tensor([0, 1, 2, 3])
    for _ in range(4):
        out = ddp(x)
        F.cross_entropy(out, labels[: out.shape[1]] % out.shape[1]).backward()
    return {"grads": [None if p.grad is None else _bits(p.grad) for p in ddp.module.parameters()]}


def _body(rank, ws):
    _init_torch_group(rank, ws)
    results = {}
    for impl in IMPLS:
        r = results[impl] = {}
        for hook in ("none", "allreduce", "torch-style"):
            r[f"sparse_{hook}"] = _sparse_case(rank, ws, impl, hook, as_view=False)
        r["sparse_view"] = _sparse_case(rank, ws, impl, "none", as_view=True)
        r["double_backward"] = _double_backward_case(rank, ws, impl)
        r["pickle"] = _pickle_case(rank, ws, impl)
        r["errors"] = _errors_case(rank, ws, impl)
        r["training"] = _training_case(rank, ws, impl, as_view=False)
        r["training_view"] = _training_case(rank, ws, impl, as_view=True)
        r["ignored_output"] = _ignored_output_case(rank, ws, impl, unused=False)
        r["ignored_output_unused"] = _ignored_output_case(rank, ws, impl, unused=True)
        r["no_sync_then_unused"] = _no_sync_then_unused_case(rank, ws, impl, as_view=False)
        r["no_sync_then_unused_view"] = _no_sync_then_unused_case(rank, ws, impl, as_view=True)
        r["own_grad_unused"] = _own_grad_unused_case(rank, ws, impl, as_view=False)
        r["own_grad_unused_view"] = _own_grad_unused_case(rank, ws, impl, as_view=True)
    results["reference_sparse"] = _sparse_reference(ws)
    results["sparse_unused_here"] = _sparse_unused_here_case(rank, ws)
    results["reference_sparse_unused_here"] = _sparse_unused_here_reference(ws)
    return results


@pytest.fixture(scope="module")
def worlds():
    return run_distributed(_body, 2, timeout_s=200)


SPARSE_CASES = ["sparse_none", "sparse_allreduce", "sparse_torch-style", "sparse_view"]


@pytest.mark.parametrize("case", SPARSE_CASES)
def test_sparse_gradients_equal_torch_ddp_and_stay_sparse(worlds, case):
    for r in worlds:
        torch_r, ours = r["torch"][case], r["ours"][case]
        assert ours["layouts"] == ["torch.sparse_coo"] * 3, ours["layouts"]
        assert ours["grads"] == torch_r["grads"]  # bitwise: divided before the sum, as torch divides
        assert ours["params"] == torch_r["params"]
        assert _close(ours["grads"], r["reference_sparse"])  # and both are the whole batch's gradients
    assert worlds[0]["ours"][case]["params"] == worlds[1]["ours"][case]["params"]


def test_a_rank_without_the_sparse_gradient_sends_an_empty_one(worlds):
    for r in worlds:
        got = r["sparse_unused_here"]
        assert [step[0][0] for step in got] == ["torch.sparse_coo"] * 2, got  # the embedding's .grad
        assert _close([[bits for _, bits in step] for step in got], r["reference_sparse_unused_here"])
    assert worlds[0]["sparse_unused_here"] == worlds[1]["sparse_unused_here"]


def _close(a, b) -> bool:
    flat = lambda x: [v for step in x for p in step for v in p]  # noqa: E731
    return all(abs(u - v) <= 1e-6 + 1e-5 * abs(v) for u, v in zip(flat(a), flat(b)))


def test_double_backward_gives_torch_ddp_gradients(worlds):
    for r in worlds:
        torch_r, ours = r["torch"]["double_backward"], r["ours"]["double_backward"]
        assert ours["grad_requires_grad"] and torch_r["grad_requires_grad"]
        assert ours["create_graph_grad"] == torch_r["create_graph_grad"]
        assert ours["second_order"] == torch_r["second_order"], (ours, torch_r)
        assert ours["penalty_grads"] == torch_r["penalty_grads"]
    # .grad is the average over ranks: the same on both
    first, second = (w["ours"]["double_backward"]["create_graph_grad"] for w in worlds)
    assert first == second


def test_pickled_and_deepcopied_ddp_still_trains_and_syncs(worlds):
    for r in worlds:
        ours, torch_r = r["ours"]["pickle"], r["torch"]["pickle"]
        assert ours["loaded_type"] == ours["copied_type"] == "DistributedDataParallel"
        assert ours["state_equal"]
        # the copies train exactly as the original, and as torch's copies do
        assert ours["loaded"] == ours["original"] == ours["copied"]
        assert ours["original"] == torch_r["original"]
        assert ours["explicit_group"][0] == torch_r["explicit_group"][0] == "RuntimeError"
        assert "only supported when using DDP with the default process group" in ours["explicit_group"][1]
    # each rank trained on its own data: equal parameters mean the copies synchronised
    for key in ("loaded", "copied"):
        assert worlds[0]["ours"]["pickle"][key] == worlds[1]["ours"]["pickle"][key]


TORCH_MESSAGES = {
    # case -> (type, the regex torch's own tests match)
    "no_params": ("RuntimeError", "DistributedDataParallel is not needed when a module doesn't have any parameter"),
    "frozen": ("RuntimeError", "DistributedDataParallel is not needed when a module doesn't have any parameter"),
    "not_callable": ("TypeError", "Communication hook must be callable."),
    "bucket_int": ("ValueError", "bucket annotation should be dist.GradBucket."),
    "returns_int": ("ValueError", "Communication hook: return annotation should be torch.futures.Future"),
    "twice": ("RuntimeError", "register_comm_hook or register_builtin_comm_hook can only be called once."),
    "non_future": ("RuntimeError", "callback must return a torch.futures.Future object, but got"),
}


@pytest.mark.parametrize("case", sorted(TORCH_MESSAGES))
def test_errors_have_torch_ddp_types_and_words(worlds, case):
    kind, pattern = TORCH_MESSAGES[case]
    for r in worlds:
        torch_r, ours = r["torch"]["errors"][case], r["ours"]["errors"][case]
        assert torch_r is not None and torch_r[0] == kind and re.search(pattern, torch_r[1]), torch_r
        assert ours is not None and ours[0] == kind, ours
        assert re.search(pattern, ours[1]), ours


def test_hook_registration_and_futures_as_torch_ddp(worlds):
    for r in worlds:
        for impl in IMPLS:
            e = r[impl]["errors"]
            assert e["after_failures"] is None and e["annotated"] is None, (impl, e)
            assert e["future_passing"] == [2.0] * 4, (impl, e)  # the hook's value, undivided


@pytest.mark.parametrize(
    "case",
    [
        "training",
        "training_view",
        "ignored_output",
        "ignored_output_unused",
        "no_sync_then_unused",
        "no_sync_then_unused_view",
    ],
)
def test_torch_c10d_training_cases_match_torch_ddp(worlds, case):
    for r in worlds:
        assert r["ours"][case] == r["torch"][case]
    assert worlds[0]["ours"][case] == worlds[1]["ours"][case]


@pytest.mark.parametrize("case", ["own_grad_unused", "own_grad_unused_view"])
def test_a_gradient_no_backward_reached_is_treated_as_torch_treats_it(worlds, case):
    """Left as this rank set it, or (gradient_as_bucket_view) replaced by the bucket's average."""
    for r in worlds:
        assert r["ours"][case] == r["torch"][case]
    fc3 = [w["ours"][case][2][0] for w in worlds]
    assert fc3 == ([1.5, 1.5] if case.endswith("view") else [1.0, 2.0])
