#!/usr/bin/env python
"""DDP host overhead per step: ddptrain's DistributedDataParallel against torch's where compute is negligible.

Two models with many small parameter tensors, so a step's time is mostly Python/C++ host work
(hooks, bucket bookkeeping, launching all-reduces) rather than arithmetic:

* ``blocks``      — 48 residual blocks of 2 LayerNorms and 4 Linears (widths 32-128), 576 parameter
  tensors, batch 4, MSE loss;
* ``transformer`` — token + position embeddings, 12 ``nn.TransformerEncoderLayer`` (d_model 64,
  4 heads, MLP 256, no dropout), a final LayerNorm and a vocabulary head (150 tensors), batch 2 x 16
  tokens, cross-entropy.

For each model and world size W (gloo, one thread per process; W=1 runs one process with a group of
size 1) three variants train from identical weights, SGD lr 1e-4, alternating round by round (the
order rotates each round) in the same processes: ``no DDP`` (the bare module, no communication),
``torch DDP`` (torch.nn.parallel.DistributedDataParallel) and ``ours`` (ddptrain's), both DDPs with
the same ``bucket_cap_mb`` (torch's default, 25). A step is zero_grad, forward, loss, backward,
optimizer.step. Both DDPs all-reduce over one gloo group, torch's default: on this VM a gloo
connection's latency is bimodal (a 1 MB all-reduce between two local ranks takes 0.9 or 2.4 ms,
and a connection keeps its mode for many seconds, whichever group it belongs to), so two groups
would compare their connections' luck, not the DDPs. Round 0 (``--warmup`` steps) is not timed.
Each rank feeds its own inputs; before timing, both DDPs' gradients are checked against the
all-reduced average of the bare module's, and after it their parameters are checked bitwise equal
across ranks (so the gradients were synchronised).

Prints, per model and W, rank 0's median step time per round, the median over rounds, the ratio
ours/torch of the step and of the time added over ``no DDP`` ("added" = variant - no DDP), and the
per-round ratios; then the host's CPU: the main thread's CPU time per step (``time.thread_time``,
which waiting for the all-reduce does not count), the same way — the host cost itself, less
disturbed by the machine's noise than wall time. Usage::

    .venv/bin/python scripts/bench_host_overhead.py [--steps 200] [--rounds 5] [--warmup 30]
        [--models blocks,transformer] [--world-sizes 1,2] [--json PATH]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

VARIANTS = ("no DDP", "torch DDP", "ours")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(32), nn.LayerNorm(32)
        self.fc1, self.fc2 = nn.Linear(32, 128), nn.Linear(128, 32)
        self.fc3, self.fc4 = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        x = x + self.fc2(F.gelu(self.fc1(self.ln1(x))))
        return x + self.fc4(F.gelu(self.fc3(self.ln2(x))))


class Transformer(nn.Module):
    def __init__(self, vocab=256, seq=16, d=64, heads=4, mlp=256, layers=12):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.layers = nn.Sequential(
            *[nn.TransformerEncoderLayer(d, heads, mlp, dropout=0.0, batch_first=True) for _ in range(layers)]
        )
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, t):
        x = self.tok(t) + self.pos(torch.arange(t.shape[1]))
        return self.head(self.norm(self.layers(x)))


def _model_and_data(name, rank):
    """(module, inputs, loss_fn(output, target), target); the weights depend on nothing but the name."""
    torch.manual_seed(0)
    if name == "blocks":
        model = nn.Sequential(*[Block() for _ in range(48)])
        g = torch.Generator().manual_seed(1000 + rank)
        return model, torch.randn(4, 32, generator=g), F.mse_loss, torch.randn(4, 32, generator=g)
    if name == "transformer":
        model = Transformer()
        g = torch.Generator().manual_seed(1000 + rank)
        t = torch.randint(0, 256, (2, 17), generator=g)
        return model, t[:, :-1], lambda out, y: F.cross_entropy(out.reshape(-1, 256), y.reshape(-1)), t[:, 1:]
    raise SystemExit(f"unknown model {name!r} (blocks, transformer)")


def _check_grads_synced(variants, x, y, loss_fn, world_size, tdist):
    """One backward each from the identical initial weights: both DDPs' gradients must equal the
    all-reduced average of the bare module's (each rank has its own inputs)."""
    expected = []
    for key, model in variants.items():
        model.zero_grad()
        loss_fn(model(x), y).backward()
        grads = [p.grad.detach().clone() for p in model.parameters()]
        if key == "no DDP":
            for gr in grads:
                tdist.all_reduce(gr)
                gr /= world_size
            expected = grads
        else:
            bad = [i for i, (a, b) in enumerate(zip(grads, expected)) if not torch.allclose(a, b, atol=1e-6, rtol=1e-4)]
            if bad or len(grads) != len(expected):
                raise RuntimeError(f"{key}: gradients of {len(bad)} parameters differ from the all-reduced average")
        model.zero_grad()


def _check_params_equal_across_ranks(model, key, tdist):
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    lo, hi = flat.clone(), flat.clone()
    tdist.all_reduce(lo, op=tdist.ReduceOp.MIN)
    tdist.all_reduce(hi, op=tdist.ReduceOp.MAX)
    spread = (hi - lo).abs().max().item()
    if spread > 0:  # synchronised replicas stay bitwise equal (the all-reduce gives every rank the same sum)
        raise RuntimeError(f"{key}: parameters differ across ranks by {spread:.3g}: gradients not synchronised")


def _bench(rank, world_size, model_names, steps, rounds, warmup, bucket_cap_mb):
    import torch.distributed as tdist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import ddptrain.comm as dist
    from ddptrain.ddp import DistributedDataParallel as OurDDP

    torch.set_num_threads(1)
    tdist.init_process_group(
        "gloo", store=tdist.PrefixStore("torch", dist.get_store().c10d), rank=rank, world_size=world_size
    )
    results = {}
    for name in model_names:
        base, x, loss_fn, y = _model_and_data(name, rank)
        variants = {
            "no DDP": copy.deepcopy(base),
            "torch DDP": TorchDDP(copy.deepcopy(base), bucket_cap_mb=bucket_cap_mb),
            # the same gloo group as torch's (see the module doc): the same connections for both
            "ours": OurDDP(copy.deepcopy(base), bucket_cap_mb=bucket_cap_mb, process_group=tdist.group.WORLD),
        }
        _check_grads_synced(variants, x, y, loss_fn, world_size, tdist)
        opts = {k: torch.optim.SGD(m.parameters(), lr=1e-4) for k, m in variants.items()}
        times = {k: [] for k in VARIANTS}  # per round, the list of step times (s)
        cpu = {k: [] for k in VARIANTS}  # per round, the main thread's CPU seconds per step
        for rnd in range(rounds + 1):  # round 0 warms up (and lets both DDPs rebuild their buckets)
            order = VARIANTS[rnd % 3 :] + VARIANTS[: rnd % 3]
            for key in order:
                model, opt, step_times = variants[key], opts[key], []
                tdist.barrier()
                cpu0 = time.thread_time()
                for _ in range(steps if rnd else warmup):
                    t0 = time.perf_counter()
                    opt.zero_grad()
                    loss_fn(model(x), y).backward()
                    opt.step()
                    step_times.append(time.perf_counter() - t0)
                if rnd:
                    times[key].append(step_times)
                    cpu[key].append((time.thread_time() - cpu0) / steps)
        for key in ("torch DDP", "ours"):
            _check_params_equal_across_ranks(variants[key], key, tdist)
        results[name] = {
            "params": len(list(base.parameters())),
            "round_median_ms": {k: [statistics.median(r) * 1e3 for r in v] for k, v in times.items()},
            "steps_ms": {k: [[t * 1e3 for t in r] for r in v] for k, v in times.items()},
            "round_cpu_ms": {k: [c * 1e3 for c in v] for k, v in cpu.items()},
        }
    tdist.destroy_process_group()
    return results


def _ratio(a, b):
    return a / b if b > 0 else float("nan")


def _rows(all_results, models, world_sizes, reduce):
    rows = []
    for name in models:
        for w in world_sizes:
            med = all_results[w][0][name]["round_median_ms"]
            per_round = list(zip(*(med[k] for k in VARIANTS)))  # [(none, torch, ours) per round]
            none, tor, ours = (reduce(med[k]) for k in VARIANTS)
            cpu = all_results[w][0][name]["round_cpu_ms"]
            cpu_rounds = list(zip(*(cpu[k] for k in VARIANTS)))
            cpu_none, cpu_torch, cpu_ours = (reduce(cpu[k]) for k in VARIANTS)
            rows.append(
                {
                    "model": name,
                    "W": w,
                    "params": all_results[w][0][name]["params"],
                    "ms": dict(zip(VARIANTS, (none, tor, ours))),
                    "step_ratio": _ratio(ours, tor),
                    "added_ratio": _ratio(ours - none, tor - none),
                    "round_step_ratios": [_ratio(o, t) for _, t, o in per_round],
                    "round_added_ratios": [_ratio(o - n, t - n) for n, t, o in per_round],
                    "cpu_ms": dict(zip(VARIANTS, (cpu_none, cpu_torch, cpu_ours))),
                    "cpu_added_ratio": _ratio(cpu_ours - cpu_none, cpu_torch - cpu_none),
                    "round_cpu_added_ratios": [_ratio(o - n, t - n) for n, t, o in cpu_rounds],
                }
            )
    return rows


def main() -> None:
    from ddptrain.testing import run_distributed

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="blocks,transformer")
    ap.add_argument("--world-sizes", default="1,2")
    ap.add_argument("--steps", type=int, default=200, help="timed steps per variant per round")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds (after one warm-up round)")
    ap.add_argument("--warmup", type=int, default=30, help="steps per variant in the untimed round 0")
    ap.add_argument("--bucket-cap-mb", type=float, default=25.0, help="for both DDPs (torch's default)")
    ap.add_argument("--over-rounds", choices=["min", "median"], default="median", help="how rounds' medians combine")
    ap.add_argument("--json", metavar="PATH", help="write the raw numbers (every rank, round and step) here")
    args = ap.parse_args()
    models = args.models.split(",")
    world_sizes = [int(w) for w in args.world_sizes.split(",")]
    all_results = {}
    for w in world_sizes:
        all_results[w] = run_distributed(
            _bench,
            w,
            models,
            args.steps,
            args.rounds,
            args.warmup,
            args.bucket_cap_mb,
            timeout_s=3600,
            comm_timeout_s=600,
            threads_per_worker=1,
        )
    reduce = min if args.over_rounds == "min" else statistics.median
    rows = _rows(all_results, models, world_sizes, reduce)
    print(
        f"DDP host overhead, gloo, 1 thread per process, bucket_cap_mb {args.bucket_cap_mb:g}; rank 0's median ms "
        f"per step in each of {args.rounds} rounds x {args.steps} steps, {args.over_rounds} over rounds\n"
    )
    print("| model | W | no DDP ms | torch DDP ms | ours ms | ours/torch step | ours/torch added |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        ms = r["ms"]
        print(
            f"| {r['model']} ({r['params']} tensors) | {r['W']} | {ms['no DDP']:.2f} | {ms['torch DDP']:.2f} | "
            f"{ms['ours']:.2f} | {r['step_ratio']:.3f} | {r['added_ratio']:.3f} |"
        )
    print("\nPer round (ours/torch step; ours/torch added):")
    for r in rows:
        steps_ = ", ".join(f"{v:.3f}" for v in r["round_step_ratios"])
        added = ", ".join(f"{v:.3f}" for v in r["round_added_ratios"])
        print(
            f"  {r['model']} W={r['W']}: step {steps_} (median {statistics.median(r['round_step_ratios']):.3f}); "
            f"added {added} (median {statistics.median(r['round_added_ratios']):.3f})"
        )
    print(
        "\nHost CPU: the main thread's CPU time per step (time.thread_time; waiting for the wire costs "
        "none), ms, median over rounds:\n"
    )
    print("| model | W | no DDP | torch DDP | ours | ours/torch added CPU | per round |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        c = r["cpu_ms"]
        rounds_ = ", ".join(f"{v:.3f}" for v in r["round_cpu_added_ratios"])
        print(
            f"| {r['model']} | {r['W']} | {c['no DDP']:.2f} | {c['torch DDP']:.2f} | {c['ours']:.2f} | "
            f"{r['cpu_added_ratio']:.3f} | {rounds_} |"
        )
    if args.json:
        raw = {"args": vars(args), "rows": rows, "per_rank": {str(w): res for w, res in all_results.items()}}
        with open(args.json, "w") as f:
            json.dump(raw, f, indent=1)
        print(f"\nraw numbers: {args.json}")


if __name__ == "__main__":
    main()
