"""ddptrain's DistributedDataParallel against a single-process reference and against torch DDP.

Each test spawns ONE world and runs many configurations inside it (a spawn costs seconds on
two cores); the bodies return numbers, the parent asserts on them.
"""

import contextlib
import copy
import hashlib

import pytest
import torch
import torch.nn.functional as F

import ddptrain.comm as dist
from ddptrain.comm.ring import RingAllReducer
from ddptrain.ddp import DistributedDataParallel as DDP
from ddptrain.ddp import ring_allreduce_hook
from ddptrain.testing import run_distributed
from tests.models import MODELS
from tests.recording_group import RecordingGroup

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]

PER_RANK = 8
STEPS = 5


def _digest(model) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    return h.hexdigest()


def _batches(world_size, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    n = PER_RANK * world_size
    return [(torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)) for _ in range(steps)]


def _max_diff(a, b) -> float:
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))


def _equivalence_case(
    rank,
    ws,
    name,
    cap,
    as_view,
    no_sync_steps=0,
    find_unused=False,
    branch_ranks=(),
    ring=False,
    direct_min_bytes=None,
    set_to_none=True,
):
    """``direct_min_bytes``: the size from which gradients are all-reduced in place (the default
    1 MiB leaves the small test models on the flat-buffer path; 0 sends every gradient direct)."""
    torch.manual_seed(0)
    model = MODELS[name]()
    ref = copy.deepcopy(model)
    if name == "branch":
        model.use_branch = rank in branch_ranks
    import ddptrain.ddp.reducer as reducer_module

    default_direct = reducer_module.DIRECT_MIN_BYTES
    if direct_min_bytes is not None:
        reducer_module.DIRECT_MIN_BYTES = direct_min_bytes
    wire = RecordingGroup(dist.get_process_group(), watch=list(model.parameters()))
    try:
        ddp = DDP(
            model,
            process_group=wire,
            bucket_cap_mb=cap,
            gradient_as_bucket_view=as_view,
            find_unused_parameters=find_unused,
        )
    finally:
        reducer_module.DIRECT_MIN_BYTES = default_direct
    if ring:
        ddp.register_comm_hook(RingAllReducer(wire), ring_allreduce_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    micro = no_sync_steps + 1
    diffs = []
    batches = _batches(ws, STEPS * micro)
    for step in range(STEPS):
        wire.all_reduces.clear()  # keep the last step's
        opt.zero_grad(set_to_none=set_to_none)
        ropt.zero_grad(set_to_none=set_to_none)
        for m in range(micro):
            x, y = batches[step * micro + m]
            mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
            ctx = ddp.no_sync() if m < micro - 1 else contextlib.nullcontext()
            with ctx:
                F.nll_loss(ddp(x[mine]), y[mine]).backward()
            # Reference: one process, the concatenated global batch (per-rank chunks for
            # BatchNorm, whose statistics are per batch; for branch, each chunk as its rank ran it).
            if name in ("bn", "branch"):
                loss = 0
                for r in range(ws):
                    if name == "branch":
                        ref.use_branch = r in branch_ranks
                    chunk = slice(r * PER_RANK, (r + 1) * PER_RANK)
                    loss = loss + F.nll_loss(ref(x[chunk]), y[chunk]) / ws
            else:
                loss = F.nll_loss(ref(x), y)
            loss.backward()
        opt.step()
        ropt.step()
        diffs.append(_max_diff(model, ref))
    never = None
    if name == "branch":
        never = [model.never.weight.grad is None, model.never.bias.grad is None]
    # seen on the wire: all-reduces of a tensor that is a parameter's own .grad (not a flat buffer)
    in_place = sum(call.is_grad_of is not None for call in wire.all_reduces)
    return {
        "diff": max(diffs),
        "digest": _digest(model),
        "never_grad_none": never,
        "buckets": len(ddp.bucket_assignment),
        "reduced_in_place": in_place,
        "ring_sends": wire.sends,
        "all_reduces": len(wire.all_reduces),
    }


# mpi: ranks started by mpiexec (ddptrain's mpi backend over mpi4py). Its two-rank cases share one
# launch (mpi_pair, below), on one xdist worker: an mpiexec rank imports torch itself (~3.6 s of
# CPU here), where a gloo rank is forked from a preloaded server.
BACKENDS = ["gloo", pytest.param("mpi", marks=pytest.mark.xdist_group("ddp-mpi-2"))]

CASES = [
    ("net", 25, False),
    ("net", 0.001, False),
    ("net", 1, True),
    ("net", 0.001, True),
    ("bn", 1, False),
    ("tied", 0.001, False),
    ("tied", 25, True),
    ("frozen", 1, False),
    ("mixed", 1, False),
    ("mixed", 0.001, True),
]


def _equivalence_body(rank, ws):
    out = {}
    for name, cap, view in CASES:
        out[f"{name}/cap{cap}/view{view}"] = _equivalence_case(rank, ws, name, cap, view)
    for view in (False, True):
        out[f"net/no_sync3/view{view}"] = _equivalence_case(rank, ws, "net", 0.001, view, no_sync_steps=3)
    out["net/ring"] = _equivalence_case(rank, ws, "net", 0.001, False, ring=True)
    out["branch/find_unused"] = _equivalence_case(rank, ws, "branch", 0.001, False, find_unused=True, branch_ranks=(0,))
    out["branch/find_unused/view"] = _equivalence_case(
        rank, ws, "branch", 1, True, find_unused=True, branch_ranks=(ws - 1,)
    )
    # large gradients reduced in place (every one, or a mix of direct tensors and flat runs)
    for name, cap, direct in (("net", 25, 0), ("net", 0.001, 0), ("mixed", 1, 4096), ("tied", 25, 0), ("bn", 1, 2048)):
        out[f"{name}/cap{cap}/direct{direct}"] = _equivalence_case(rank, ws, name, cap, False, direct_min_bytes=direct)
    out["aliased/direct0"] = _equivalence_case(rank, ws, "aliased", 25, False, direct_min_bytes=0)
    out["net/direct0/keep_grads"] = _equivalence_case(rank, ws, "net", 25, False, direct_min_bytes=0, set_to_none=False)
    out["net/direct0/no_sync3"] = _equivalence_case(rank, ws, "net", 25, False, no_sync_steps=3, direct_min_bytes=0)
    out["net/ring/direct4096"] = _equivalence_case(rank, ws, "net", 1, False, ring=True, direct_min_bytes=4096)
    out["branch/find_unused/direct0"] = _equivalence_case(
        rank, ws, "branch", 25, False, find_unused=True, branch_ranks=(0,), direct_min_bytes=0
    )
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world_size", [2, 3])
def test_equivalence_with_single_process(world_size, backend, request):
    if backend == "mpi" and world_size == 2:
        results = [r["equivalence"] for r in request.getfixturevalue("mpi_pair")]
    else:
        results = run_distributed(_equivalence_body, world_size, backend=backend, timeout_s=200)
    for case, r0 in results[0].items():
        for rank, res in enumerate(results):
            assert res[case]["diff"] <= 1e-6, f"{case}: rank {rank} drifted {res[case]['diff']:.3g} from the reference"
            assert res[case]["digest"] == r0["digest"], f"{case}: rank {rank} parameters differ bitwise from rank 0"
    assert results[0]["net/cap0.001/viewFalse"]["buckets"] >= 4  # tiny cap really splits the model
    assert results[0]["net/cap25/viewFalse"]["buckets"] == 1
    # the in-place path really ran: every gradient of Net (8) with threshold 0, none by default
    assert results[0]["net/cap25/direct0"]["reduced_in_place"] == 8
    assert results[0]["net/direct0/keep_grads"]["reduced_in_place"] == 8
    assert results[0]["net/cap25/viewFalse"]["reduced_in_place"] == 0
    assert 0 < results[0]["mixed/cap1/direct4096"]["reduced_in_place"] < 8
    # gradients that share one buffer are copied, not reduced in place (only fc's two go direct)
    assert results[0]["aliased/direct0"]["reduced_in_place"] == 2
    # the ring carried the buckets: point-to-point messages, no bucket all-reduce
    for case in ("net/ring", "net/ring/direct4096"):
        assert results[0][case]["ring_sends"] > 0 and results[0][case]["all_reduces"] == 0, results[0][case]
    # a head that no rank uses keeps grad None on every rank
    for res in results:
        assert res["branch/find_unused"]["never_grad_none"] == [True, True]
        assert res["branch/find_unused/direct0"]["never_grad_none"] == [True, True]


def _torch_ddp_body(rank, ws, opt_name):
    import torch.distributed as tdist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    tdist.init_process_group("gloo", store=tdist.PrefixStore("torch", dist.get_store().c10d), rank=rank, world_size=ws)
    try:
        torch.manual_seed(0)
        ours_model = MODELS["net"]()
        theirs_model = copy.deepcopy(ours_model)
        ours, theirs = DDP(ours_model), TorchDDP(theirs_model)
        make = {
            "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
            "adam": lambda p: torch.optim.Adam(p, lr=1e-3),
        }[opt_name]
        o1, o2 = make(ours.parameters()), make(theirs.parameters())
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        for x, y in _batches(ws, 20, seed=7):
            for model, opt in ((ours, o1), (theirs, o2)):
                opt.zero_grad()
                F.nll_loss(model(x[mine]), y[mine]).backward()
                opt.step()
        return _max_diff(ours_model, theirs_model)
    finally:
        tdist.destroy_process_group()


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_same_trajectory_as_torch_ddp(opt_name):
    diffs = run_distributed(_torch_ddp_body, 2, opt_name, timeout_s=120)
    assert max(diffs) <= 1e-5, diffs


def _hooks_body(rank, ws):
    from ddptrain.ddp import PowerSGDState, bf16_compress_hook, fp16_compress_hook, powerSGD_hook

    out = {}
    x, y = _batches(ws, 1, seed=3)[0]
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)

    def grads(hook=None, state=None):
        """The gradients after one step, and the dtypes the buckets' all-reduces put on the wire."""
        torch.manual_seed(0)
        model = MODELS["net"]()
        wire = RecordingGroup(dist.get_process_group())
        ddp = DDP(model, process_group=wire, bucket_cap_mb=0.01)
        if hook is not None:
            ddp.register_comm_hook(state, hook)
        wire.all_reduces.clear()  # construction's model check
        F.nll_loss(ddp(x[mine]), y[mine]).backward()
        return [p.grad.clone() for p in model.parameters()], sorted({str(c.dtype) for c in wire.all_reduces})

    plain, out["plain_wire"] = grads()
    for name, hook in (("fp16", fp16_compress_hook), ("bf16", bf16_compress_hook)):
        g, out[f"{name}_wire"] = grads(hook)
        out[name] = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item() for a, b in zip(g, plain))
    g, _ = grads(powerSGD_hook, PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=10))
    out["powersgd_before_start"] = max((a - b).abs().max().item() for a, b in zip(g, plain))

    # PowerSGD after its start iteration still trains a small regression to a low loss.
    torch.manual_seed(0)
    w_true = torch.randn(32, 1)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 1))
    ddp = DDP(model)
    ddp.register_comm_hook(PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=5), powerSGD_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(300):
        xb = torch.randn(32, 32, generator=g)
        loss = F.mse_loss(ddp(xb), xb @ w_true)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    out["powersgd_first_loss"] = losses[0]
    out["powersgd_last_loss"] = sum(losses[-20:]) / 20
    out["digest"] = _digest(model)
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_comm_hooks(backend, request):
    results = _two_ranks(request, "hooks", _hooks_body, 2, backend=backend, timeout_s=120)
    for r in results:
        # what reached the wire: compressed buckets travel as half precision, and only so
        assert r["plain_wire"] == ["torch.float32"], r
        assert r["fp16_wire"] == ["torch.float16"], r
        assert r["bf16_wire"] == ["torch.bfloat16"], r
        assert r["fp16"] < 1e-2, r
        assert r["bf16"] < 3e-2, r
        assert r["powersgd_before_start"] <= 1e-7, r
        assert r["powersgd_last_loss"] < 0.05 * r["powersgd_first_loss"], r
    assert results[0]["digest"] == results[1]["digest"]


def _overlap_body(rank, ws):
    """Watch the wire during the third backward (on rebuilt buckets): when each all-reduce
    started and when anyone waited for it, counted in gradients autograd had yet to produce."""
    torch.manual_seed(0)
    model = MODELS["mlp"](width=512, depth=4)
    params = list(model.parameters())
    wire = RecordingGroup(dist.get_process_group(), watch=params)
    ddp = DDP(model, process_group=wire, bucket_cap_mb=0.5)
    x, y = _batches(ws, 1)[0]
    for _ in range(3):
        wire.all_reduces.clear()
        for p in params:
            p.grad = None
        F.nll_loss(ddp(x), y).backward()
    s = ddp.last_iteration_stats
    return {
        "n_params": len(params),
        "grads_missing_at_call": [c.grads_missing for c in wire.all_reduces],
        "grads_missing_at_wait": [c.waits_with_grads_missing for c in wire.all_reduces],
        "rebuilt": s.rebuilt_buckets,
        "offsets": s.launch_offsets_s,
    }


@pytest.mark.parametrize("backend", BACKENDS)
def test_overlap_all_reduce_runs_while_backward_computes(backend, request):
    for r in _two_ranks(request, "overlap", _overlap_body, 2, backend=backend, timeout_s=90):
        at_call, at_wait = r["grads_missing_at_call"], r["grads_missing_at_wait"]
        assert len(at_call) >= 2, r
        # the first bucket went out while autograd still had gradients to produce ...
        assert 0 < at_call[0] < r["n_params"], r
        # ... and nothing waited for communication before the last gradient existed
        assert all(waits and max(waits) == 0 for waits in at_wait), r
        assert r["rebuilt"] and all(o is not None for o in r["offsets"]), r


JOIN_BATCHES = (5, 8)  # per rank: rank 0 runs out of data first


def _join_batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(PER_RANK, 1, 28, 28, generator=g), torch.randint(0, 10, (PER_RANK,), generator=g)


def _train_joined(model, rank, counts):
    ddp = DDP(model, bucket_cap_mb=0.01)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    with ddp.join():
        for step in range(counts[rank]):
            x, y = _join_batch(rank, step)
            opt.zero_grad()
            F.nll_loss(ddp(x), y).backward()
            opt.step()


def _join_body(rank, ws, counts):
    torch.manual_seed(0)
    model = MODELS["net"]()
    ref = copy.deepcopy(model)
    _train_joined(model, rank, counts)
    # torch DDP's join semantics in one process: at each step the ranks still running contribute
    # their gradients, joined ranks zeros, and the sum is divided by the full world size.
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(max(counts)):
        ropt.zero_grad()
        active = [r for r in range(ws) if step < counts[r]]
        loss = sum(F.nll_loss(ref(_join_batch(r, step)[0]), _join_batch(r, step)[1]) for r in active) / ws
        loss.backward()
        ropt.step()
    # with buffers (BatchNorm): the end of join leaves every rank with the same parameters and buffers
    torch.manual_seed(0)
    bn = MODELS["bn"]()
    _train_joined(bn, rank, counts)
    buffers = hashlib.sha256(b"".join(b.numpy().tobytes() for b in bn.buffers())).hexdigest()
    return {"diff": _max_diff(model, ref), "digest": _digest(model), "bn": (_digest(bn), buffers)}


@pytest.mark.parametrize("backend", BACKENDS)
def test_join_uneven_inputs_matches_the_reference(backend, request):
    results = _two_ranks(request, "join", _join_body, 2, JOIN_BATCHES, backend=backend, timeout_s=90)
    for rank, r in enumerate(results):
        assert r["diff"] <= 1e-6, f"rank {rank} drifted {r['diff']:.3g} from the single-process reference"
        assert r["digest"] == results[0]["digest"] and r["bn"] == results[0]["bn"], rank


def _errors_body(rank, ws):
    out = {}
    torch.manual_seed(0)
    model = MODELS["branch"]()  # 'branch' and 'never' get no gradient
    ddp = DDP(model)
    x, y = _batches(ws, 1)[0]
    F.nll_loss(ddp(x), y).backward()
    try:
        ddp(x)
    except RuntimeError as exc:
        out["unused"] = str(exc)
    # module with nothing to train
    frozen = torch.nn.Linear(3, 3).requires_grad_(False)
    try:
        DDP(frozen)
    except RuntimeError as exc:  # torch's type: code written against torch catches it
        out["frozen"] = str(exc)
    # reentrant checkpointing marks parameters ready twice
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    ddp2 = DDP(lin)
    try:
        inp = torch.randn(2, 4, requires_grad=True)
        out1 = ddp2(inp)  # the layer runs outside and again inside a reentrant checkpoint
        out2 = checkpoint(lin, out1, use_reentrant=True)
        out2.sum().backward()
    except RuntimeError as exc:
        out["twice"] = str(exc)
    # unsupported keyword
    try:
        DDP(torch.nn.Linear(2, 2), mixed_precision=True)
    except TypeError as exc:
        out["kwarg"] = str(exc)
    # a model that differs between ranks: torch's RuntimeError, and the ValueError ddptrain raised first
    try:
        DDP(torch.nn.Linear(4, 4 + rank))
    except RuntimeError as exc:
        out["differs"] = str(exc)
        out["differs_is_value_error"] = isinstance(exc, ValueError)
    # only rank 1's copy is all frozen: every rank learns that the models differ, none is left waiting
    lin = torch.nn.Linear(3, 3).requires_grad_(rank != 1)
    try:
        DDP(lin)
    except RuntimeError as exc:
        out["frozen_on_one"] = str(exc)
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_errors_users_meet_most(backend, request):
    results = _two_ranks(request, "errors", _errors_body, 2, backend=backend, timeout_s=90)
    for r in results:
        assert "did not: branch.weight, branch.bias, never.weight, never.bias" in r["unused"], r["unused"]
        assert "find_unused_parameters=True" in r["unused"]
        assert "is not needed when a module doesn't have any parameter that requires a gradient" in r["frozen"]
        assert "all frozen or none at all" in r["frozen"]
        assert "marked ready twice" in r["twice"] and "use_reentrant=False" in r["twice"], r.get("twice")
        assert "mixed_precision" in r["kwarg"]
        assert "ranks disagree" in r["differs"] and "rank 1" in r["differs"] and "weight" in r["differs"], r["differs"]
        assert r["differs_is_value_error"]
        assert "ranks disagree" in r["frozen_on_one"] and "requires_grad" in r["frozen_on_one"], r["frozen_on_one"]


def _mpi_pair_body(rank, ws):
    return {
        "equivalence": _equivalence_body(rank, ws),
        "hooks": _hooks_body(rank, ws),
        "overlap": _overlap_body(rank, ws),
        "join": _join_body(rank, ws, JOIN_BATCHES),
        "errors": _errors_body(rank, ws),  # last: it leaves DDP wrappers that failed on purpose
    }


@pytest.fixture(scope="module")
def mpi_pair():
    """Every two-rank mpi case of this module, in one mpiexec launch; each rank's results by case."""
    return run_distributed(_mpi_pair_body, 2, backend="mpi", timeout_s=400)


def _two_ranks(request, case, body, *args, **kwargs):
    """``run_distributed(body, *args, **kwargs)``'s results, or ``case``'s from the shared mpi launch."""
    if kwargs["backend"] == "mpi":
        return [r[case] for r in request.getfixturevalue("mpi_pair")]
    return run_distributed(body, *args, **kwargs)
