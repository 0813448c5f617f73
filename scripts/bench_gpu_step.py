#!/usr/bin/env python
"""Training step time on one GPU: ddptrain's DistributedDataParallel against torch's, world size 1.

One process, one device, a process group of size 1 (W=1): ``nccl`` on ``--device cuda`` (the
default when CUDA is available), ``gloo`` on ``--device cpu``. As in ``bench_host_overhead.py``
both layers are set up at once: ddptrain's comm group (``ddptrain.comm.init_process_group``) on an
in-process store, and torch.distributed's default group on the same store under the prefix
``torch``; both with ``timeout=--timeout-s``, so every collective has a timeout. By default both
DDPs all-reduce over torch's group (the same NCCL communicator, as bench_host_overhead.py does for
gloo); ``--ours-group ddptrain`` gives ours ddptrain's own group instead.

Two variants train from identical initial weights on identical batches: ``torch DDP``
(``torch.nn.parallel.DistributedDataParallel``) and ``ours`` (``ddptrain.ddp.DistributedDataParallel``),
both with ``bucket_cap_mb`` 25 (torch's default), ``device_ids=[0]`` on CUDA, defaults otherwise.
A step is ``opt.zero_grad(set_to_none=True)``, forward and loss (under ``torch.autocast`` bf16
with ``--precision bf16-mixed``, the default on CUDA; fp32 with ``32``, the default on CPU),
``loss.backward()``, ``opt.step()``. Optimizer: AdamW (lr 3e-4, weight decay 0.1, torch's default
implementation, i.e. foreach on CUDA) or, with ``--optimizer sgd``, SGD (lr 1e-3, no momentum).
Models (``--models``):

* ``gpt2`` — a GPT-2-small-shaped decoder-only transformer: 12 layers, d_model 768, 12 heads,
  MLP 3072, vocabulary 50257, context 1024, learned position embeddings, pre-LayerNorm blocks of
  plain ``nn.Linear`` / ``nn.LayerNorm`` (with biases) and
  ``F.scaled_dot_product_attention(is_causal=True)``, tanh GELU, no dropout, a final LayerNorm and an
  LM head **tied** to the token embedding (as GPT-2): 124.4M parameters in 148 tensors. Batch
  ``--batch`` (default 8) sequences of 1024 random tokens, next-token cross-entropy;
* ``small_tensors`` — 200 residual blocks of ``LayerNorm(64)`` and two ``Linear(64, 64)``
  (1200 parameter tensors, 1.7M parameters), a batch of 16 x 64, MSE loss: a step is a few
  thousand tiny kernels, so host overhead (hooks, bucket bookkeeping, launches) dominates.

**Correctness check, before timing.** The ``--warmup`` steps (default 10) are not timed: each
variant, and a second ``torch DDP`` replica (the *reference*, used only here and then freed),
trains ``--warmup`` steps from the same weights on the same batches (4 pre-generated batches,
cycled). Then the parameters are compared, tensor by tensor:

* all bitwise equal between ours and torch DDP: **pass (bitwise)**;
* otherwise, on CPU: **FAIL** (CPU kernels are deterministic at a fixed thread count; the
  reference confirms it);
* otherwise, on CUDA, if torch DDP and its reference are bitwise equal (torch's step is
  deterministic on this machine): **FAIL** (ours should be bitwise equal too);
* otherwise (nondeterministic kernels, e.g. flash-attention's backward, so no bitwise result
  exists): **pass (allclose)** if every tensor satisfies ``torch.allclose(ours, torch,
  rtol=1e-3, atol=1e-5)`` or, failing that for a tensor, its max |ours - torch| is at most 2x the
  reference's own run-to-run max |ref - torch| for that tensor (AdamW turns near-zero gradient
  noise into lr-sized steps); else **FAIL**. A real synchronisation bug (a gradient not written
  back, mis-scaled, lost bucket) moves a tensor by about lr x steps (3e-3 with AdamW defaults),
  far outside both.

The figures are reported with the verdict (max abs difference, tensors differing). A failed
check does not stop the timing (the numbers come out anyway) but the exit code is then 1.

**Timing.** ``--rounds`` rounds (default 3) alternate the variants' order (torch first in even
rounds, ours first in odd ones); each runs ``--steps`` (default 50) timed steps per variant in
a row. On CUDA every step is bracketed by a ``torch.cuda.Event(enable_timing=True)`` pair on the
current stream and ``torch.cuda.synchronize()`` runs once after each step's end event, only to
read it (``--sync step``, the default: the event time covers the whole step, including any time
the GPU waited for the host to launch kernels). ``--sync round`` records the same event pairs but
synchronizes only at the end of the round, so the host may run ahead into the next step as in real
training; the events then still bracket each step on the GPU's timeline. The host wall-clock time
per step (``time.perf_counter``, through the synchronize in ``--sync step``) is recorded as well
and written to the JSON. On CPU a step is timed with ``time.perf_counter``.

Reported per model: per variant the median step time (ms) over all timed steps of all rounds,
the ratio ours/torch of those medians (< 1: ours is faster), and the per-round ratios (median of
that round's steps, ours/torch); the last lines of stdout are a table of model, torch ms, ours ms,
ratio and check. ``--json PATH`` writes every figure (per-step times, losses, the check's
differences, peak memory). Exit code 0 if it ran and every check passed, 1 if a check failed, 2
if a model raised (its traceback is printed, the other models still run; the table says ERROR).

Usage::

    .venv/bin/python scripts/bench_gpu_step.py [--device cuda|cpu] [--models gpt2,small_tensors]
        [--batch 8] [--precision bf16-mixed|32] [--optimizer adamw|sgd] [--warmup 10] [--steps 50]
        [--rounds 3] [--sync step|round] [--ours-group torch|ddptrain] [--timeout-s 300]
        [--json PATH]
    .venv/bin/python scripts/bench_gpu_step.py --device cpu --tiny     # the dry run, well under a minute

``--tiny`` shrinks everything (gpt2: 2 layers, d_model 64, 4 heads, vocab 512, context 64, batch 2;
small_tensors: 20 blocks; warmup 2, steps 5, rounds 2); explicit flags still override it.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

VARIANTS = ("torch DDP", "ours")
BUCKET_CAP_MB = 25.0
N_BATCHES = 4  # distinct pre-generated batches, cycled
ALLCLOSE = {"rtol": 1e-3, "atol": 1e-5}
NOISE_FACTOR = 2.0  # a tensor outside allclose passes if within this multiple of torch's own run-to-run spread


# -- models -------------------------------------------------------------------------------------
class CausalSelfAttention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class GPTBlock(nn.Module):
    def __init__(self, d, heads, mlp):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(d), CausalSelfAttention(d, heads)
        self.ln2, self.fc, self.fc_proj = nn.LayerNorm(d), nn.Linear(d, mlp), nn.Linear(mlp, d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    """GPT-2-shaped decoder; the LM head shares the token embedding's weight (tied)."""

    def __init__(self, vocab, ctx, d, heads, mlp, layers):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(GPTBlock(d, heads, mlp) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        for name, p in self.named_parameters():  # GPT-2's init (scaled residual projections)
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class SmallBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


def _model_and_batches(name, args):
    """(module on the CPU, [(input, target)] * N_BATCHES on the CPU, loss_fn, description).
    The weights depend on the name and sizes only; the batches on a fixed seed."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1234)
    if name == "gpt2":
        if args.tiny:
            cfg = {"vocab": 512, "ctx": 64, "d": 64, "heads": 4, "mlp": 256, "layers": 2}
        else:
            cfg = {"vocab": 50257, "ctx": 1024, "d": 768, "heads": 12, "mlp": 3072, "layers": 12}
        model = GPT(**cfg)
        vocab, ctx = cfg["vocab"], cfg["ctx"]
        batches = []
        for _ in range(N_BATCHES):
            t = torch.randint(0, vocab, (args.batch, ctx + 1), generator=g)
            batches.append((t[:, :-1].contiguous(), t[:, 1:].contiguous()))

        def loss_fn(logits, y):
            return F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1))

        desc = f"{cfg['layers']}L d{cfg['d']} h{cfg['heads']} vocab {vocab}, batch {args.batch} x {ctx} tokens, tied"
        return model, batches, loss_fn, desc
    if name == "small_tensors":
        blocks, d, rows = (20 if args.tiny else 200), 64, 16
        model = nn.Sequential(*[SmallBlock(d) for _ in range(blocks)])
        batches = [(torch.randn(rows, d, generator=g), torch.randn(rows, d, generator=g)) for _ in range(N_BATCHES)]
        return model, batches, F.mse_loss, f"{blocks} blocks of LayerNorm({d}) + 2 Linear({d},{d}), batch {rows} x {d}"
    raise SystemExit(f"unknown model {name!r} (gpt2, small_tensors)")


# -- process groups -------------------------------------------------------------------------------
def _init_groups(backend, timeout_s, device):
    """ddptrain's comm group and torch.distributed's default group, both of size 1, on one store."""
    import torch.distributed as tdist

    import ddptrain.comm as dist
    from ddptrain.comm.store import Store

    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=timeout_s)
    hash_store = tdist.HashStore()
    hash_store.set_timeout(timeout)
    # torch's group first: both DDPs use it by default, so a failure of ddptrain's own group below
    # (only needed for --ours-group ddptrain) must not cost the run
    tdist.init_process_group(
        backend, store=tdist.PrefixStore("torch", hash_store), rank=0, world_size=1, timeout=timeout
    )
    ours_pg, ours_err = None, None
    try:
        ours_pg = dist.init_process_group(
            backend, store=Store(hash_store, "in-process store"), rank=0, world_size=1, timeout=timeout_s
        )
    except Exception as exc:  # noqa: BLE001 - reported; fatal only with --ours-group ddptrain
        ours_err = f"{type(exc).__name__}: {exc}"
    return ours_pg, ours_err


def _destroy_groups():
    import torch.distributed as tdist

    import ddptrain.comm as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    if tdist.is_initialized():
        tdist.destroy_process_group()


# -- one step -------------------------------------------------------------------------------------
def _autocast(device, precision):
    if precision == "bf16-mixed":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _make_step(model, opt, loss_fn, device, precision):
    def step(x, y):
        opt.zero_grad(set_to_none=True)
        with _autocast(device, precision):
            loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return step


def _optimizer(params, kind):
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=3e-4, weight_decay=0.1)
    return torch.optim.SGD(params, lr=1e-3)


# -- the check ------------------------------------------------------------------------------------
def _compare(a_params, b_params):
    """Per tensor: bitwise equal, allclose, max |a - b|."""
    out = []
    for a, b in zip(a_params, b_params):
        a, b = a.detach(), b.detach()
        equal = torch.equal(a, b)
        out.append(
            {
                "equal": equal,
                "allclose": equal or torch.allclose(a, b, **ALLCLOSE),
                "max_abs": 0.0 if equal else (a.float() - b.float()).abs().max().item(),
            }
        )
    return out


def _verdict(ours_vs_torch, ref_vs_torch, device):
    n = len(ours_vs_torch)
    n_equal = sum(c["equal"] for c in ours_vs_torch)
    torch_deterministic = all(c["equal"] for c in ref_vs_torch)
    max_abs = max(c["max_abs"] for c in ours_vs_torch)
    ref_max_abs = max(c["max_abs"] for c in ref_vs_torch)
    facts = (
        f"{n - n_equal}/{n} tensors differ, max |ours - torch| {max_abs:.3g}; torch DDP vs its re-run: "
        f"{'bitwise equal' if torch_deterministic else f'max {ref_max_abs:.3g}'}"
    )
    if n_equal == n:
        return True, "pass (bitwise)", facts
    if device.type == "cpu":
        return False, "FAIL (not bitwise on CPU)", facts
    if torch_deterministic:
        return False, "FAIL (torch deterministic, ours not bitwise)", facts
    bad = [
        i
        for i, (o, r) in enumerate(zip(ours_vs_torch, ref_vs_torch))
        if not o["allclose"] and o["max_abs"] > NOISE_FACTOR * r["max_abs"]
    ]
    if bad:
        return False, f"FAIL ({len(bad)} tensors off)", facts + f"; off: tensor indices {bad[:10]}"
    return True, "pass (allclose)", facts


# -- timing ---------------------------------------------------------------------------------------
def _timed_steps(step, batches, n, start_index, device, sync):
    """n steps; (event ms per step or None on CPU, host wall ms per step, losses)."""
    wall, losses = [], []
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        torch.cuda.synchronize()
        for i in range(n):
            x, y = batches[(start_index + i) % len(batches)]
            t0 = time.perf_counter()
            events[i][0].record()
            loss = step(x, y)
            events[i][1].record()
            if sync == "step":
                torch.cuda.synchronize()  # only to read this step's events (and the wall clock)
            wall.append((time.perf_counter() - t0) * 1e3)
            losses.append(loss.detach())
        torch.cuda.synchronize()
        event_ms = [a.elapsed_time(b) for a, b in events]
        return event_ms, wall, [float(v) for v in losses]
    for i in range(n):
        x, y = batches[(start_index + i) % len(batches)]
        t0 = time.perf_counter()
        loss = step(x, y)
        wall.append((time.perf_counter() - t0) * 1e3)
        losses.append(float(loss.detach()))
    return None, wall, losses


def _bench_model(name, args, device, ours_pg):
    import torch.distributed as tdist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from ddptrain.ddp import DistributedDataParallel as OurDDP

    base, cpu_batches, loss_fn, desc = _model_and_batches(name, args)
    n_tensors = len(list(base.parameters()))
    n_params = sum(p.numel() for p in base.parameters())
    print(f"\n[{name}] {desc}: {n_params / 1e6:.2f}M parameters in {n_tensors} tensors", flush=True)
    batches = [(x.to(device), y.to(device)) for x, y in cpu_batches]
    init = [p.detach().clone() for p in base.parameters()]
    device_ids = [device.index] if device.type == "cuda" else None
    ours_group = tdist.group.WORLD if args.ours_group == "torch" else ours_pg

    def build(kind):
        module = copy.deepcopy(base).to(device)
        if kind == "ours":
            return OurDDP(module, device_ids=device_ids, bucket_cap_mb=BUCKET_CAP_MB, process_group=ours_group)
        return TorchDDP(module, device_ids=device_ids, bucket_cap_mb=BUCKET_CAP_MB)

    models = {"torch DDP": build("torch"), "ours": build("ours"), "reference": build("torch")}
    opts = {k: _optimizer(m.parameters(), args.optimizer) for k, m in models.items()}
    steps = {k: _make_step(models[k], opts[k], loss_fn, device, args.precision) for k in models}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()

    # warm-up (untimed), then the check
    t0 = time.perf_counter()
    warm_losses = {}
    for key in ("torch DDP", "ours", "reference"):
        _, _, warm_losses[key] = _timed_steps(steps[key], batches, args.warmup, 0, device, "round")
    warm_s = time.perf_counter() - t0
    params = {k: list(m.module.parameters()) for k, m in models.items()}
    ours_vs_torch = _compare(params["ours"], params["torch DDP"])
    ref_vs_torch = _compare(params["reference"], params["torch DDP"])
    moved = max(
        (p.detach().float() - q.to(device).float()).abs().max().item() for p, q in zip(params["torch DDP"], init)
    )
    ok, verdict, facts = _verdict(ours_vs_torch, ref_vs_torch, device)
    torch_losses = [round(v, 4) for v in warm_losses["torch DDP"]]
    print(f"  warm-up: {args.warmup} steps x 3 replicas in {warm_s:.1f} s; losses torch {torch_losses}", flush=True)
    print(f"  check after warm-up: {verdict}; {facts}; largest parameter move since init {moved:.3g}", flush=True)
    del models["reference"], opts["reference"], steps["reference"], params
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

    # timed rounds, alternating the order
    event_ms = {k: [] for k in VARIANTS}  # per round, per step
    wall_ms = {k: [] for k in VARIANTS}
    losses = {k: [] for k in VARIANTS}
    next_batch = {k: args.warmup for k in VARIANTS}  # both see the same batch sequence
    for rnd in range(args.rounds):
        order = VARIANTS if rnd % 2 == 0 else VARIANTS[::-1]
        for key in order:
            ev, wall, ls = _timed_steps(steps[key], batches, args.steps, next_batch[key], device, args.sync)
            next_batch[key] += args.steps
            event_ms[key].append(ev if ev is not None else wall)
            wall_ms[key].append(wall)
            losses[key].append(ls)
        r = {k: statistics.median(event_ms[k][-1]) for k in VARIANTS}
        print(
            f"  round {rnd} ({' then '.join(order)}): torch {r['torch DDP']:.3f} ms, ours {r['ours']:.3f} ms, "
            f"ours/torch {_ratio(r['ours'], r['torch DDP']):.3f}",
            flush=True,
        )

    median_ms = {k: statistics.median([t for rnd in event_ms[k] for t in rnd]) for k in VARIANTS}
    median_wall = {k: statistics.median([t for rnd in wall_ms[k] for t in rnd]) for k in VARIANTS}
    round_ratios = [
        _ratio(statistics.median(o), statistics.median(t)) for t, o in zip(event_ms["torch DDP"], event_ms["ours"])
    ]
    result = {
        "model": name,
        "description": desc,
        "params": n_params,
        "tensors": n_tensors,
        "timer": "cuda events" if device.type == "cuda" else "perf_counter",
        "median_ms": median_ms,
        "ratio": _ratio(median_ms["ours"], median_ms["torch DDP"]),
        "round_ratios": round_ratios,
        "median_wall_ms": median_wall,
        "wall_ratio": _ratio(median_wall["ours"], median_wall["torch DDP"]),
        "check": {
            "ok": ok,
            "verdict": verdict,
            "facts": facts,
            "max_param_move": moved,
            "ours_vs_torch": ours_vs_torch,
            "reference_vs_torch": ref_vs_torch,
            "tolerances": {**ALLCLOSE, "noise_factor": NOISE_FACTOR},
        },
        "warmup_losses": warm_losses,
        "round_losses": losses,
        "steps_ms": event_ms,
        "steps_wall_ms": wall_ms,
    }
    if name == "gpt2":
        tokens = batches[0][0].numel()
        result["tokens_per_s"] = {k: tokens / (v / 1e3) for k, v in median_ms.items()}
    if device.type == "cuda":
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    del models, opts, steps
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def _ratio(a, b):
    return a / b if b > 0 else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--models", default="gpt2,small_tensors")
    ap.add_argument("--batch", type=int, default=None, help="gpt2 sequences per step (default 8; --tiny 2)")
    ap.add_argument(
        "--precision", choices=["bf16-mixed", "32"], default=None, help="default bf16-mixed on cuda, 32 on cpu"
    )
    ap.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps per variant before the check (default 10)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per variant per round (default 50)")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds, alternating the order (default 3)")
    ap.add_argument(
        "--sync", choices=["step", "round"], default="step", help="CUDA: synchronize after every step or per round"
    )
    ap.add_argument(
        "--ours-group", choices=["torch", "ddptrain"], default="torch", help="the group ours all-reduces over"
    )
    ap.add_argument("--timeout-s", type=float, default=300.0, help="timeout of the process groups (every collective)")
    ap.add_argument("--tiny", action="store_true", help="shrink everything for a CPU dry run")
    ap.add_argument("--json", metavar="PATH", help="write every figure here")
    args = ap.parse_args()
    small = args.tiny
    for key, full, tiny in (("batch", 8, 2), ("warmup", 10, 2), ("steps", 50, 5), ("rounds", 3, 2)):
        if getattr(args, key) is None:
            setattr(args, key, tiny if small else full)
    if args.warmup < 2:
        raise SystemExit("--warmup must be at least 2 (ours rebuilds its buckets at the second step)")
    if args.precision is None:
        args.precision = "bf16-mixed" if args.device == "cuda" else "32"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch.cuda.is_available() is False; use --device cpu")
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in ("gpt2", "small_tensors")]
    if unknown or not models:
        raise SystemExit(f"--models: unknown {unknown} (choose from gpt2, small_tensors)")

    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)  # light on a shared machine, and bitwise-reproducible
    backend = "nccl" if device.type == "cuda" else "gloo"
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"device: {device_name}; torch {torch.__version__}; backend {backend}, W=1, timeout {args.timeout_s:g} s; "
        f"precision {args.precision}; optimizer {args.optimizer}; bucket_cap_mb {BUCKET_CAP_MB:g}; "
        f"ours over {args.ours_group}'s group; warmup {args.warmup}, {args.rounds} rounds x {args.steps} steps; "
        f"timer {'cuda events, sync per ' + args.sync if device.type == 'cuda' else 'perf_counter'}",
        flush=True,
    )
    t_start = time.perf_counter()
    ours_pg, ours_err = _init_groups(backend, args.timeout_s, device)
    if ours_err:
        print(f"ddptrain's own {backend} group could not be made: {ours_err}", flush=True)
        if args.ours_group == "ddptrain":
            _destroy_groups()
            return 2
    results = []
    for name in models:
        try:
            results.append(_bench_model(name, args, device, ours_pg))
        except Exception as exc:  # noqa: BLE001 - the other models still run; the exit code says so
            traceback.print_exc()
            print(f"[{name}] ERROR: {type(exc).__name__}: {exc}", flush=True)
            results.append({"model": name, "error": f"{type(exc).__name__}: {exc}"})
        gc.collect()
        if device.type == "cuda":
            with contextlib.suppress(Exception):
                torch.cuda.empty_cache()
    total_s = time.perf_counter() - t_start
    done = [r for r in results if "error" not in r]

    if args.json:  # before the groups are destroyed: nothing that happens there can cost the figures
        raw = {
            "args": vars(args),
            "device": device_name,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "backend": backend,
            "ours_group_error": ours_err,
            "total_s": total_s,
            "results": results,
        }
        with open(args.json, "w") as f:
            json.dump(raw, f, indent=1)
        print(f"\nall figures: {args.json}")
    print(f"\nper-round ratios ours/torch (median step of each round); total {total_s:.1f} s:")
    for r in done:
        print(f"  {r['model']}: {', '.join(f'{v:.3f}' for v in r['round_ratios'])}")
    try:
        _destroy_groups()
    except Exception as exc:  # noqa: BLE001 - the figures are out; say so and go on to the table
        print(f"destroying the process groups failed: {type(exc).__name__}: {exc}", flush=True)
    timer = "cuda events" if device.type == "cuda" else "perf_counter"
    print(
        f"\ndevice: {device_name}; median step ms over {args.rounds} x {args.steps} steps ({timer}, {args.precision})"
    )
    print("| model | torch ms | ours ms | ratio ours/torch | check |")
    print("|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['model']} | - | - | - | ERROR ({r['error'][:80]}) |")
            continue
        ms = r["median_ms"]
        print(
            f"| {r['model']} | {ms['torch DDP']:.3f} | {ms['ours']:.3f} | {r['ratio']:.3f} | {r['check']['verdict']} |"
        )
    if len(done) < len(results):
        return 2
    return 0 if all(r["check"]["ok"] for r in done) else 1


if __name__ == "__main__":
    sys.exit(main())
