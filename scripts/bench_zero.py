"""What ZeRO saves and costs: memory and step time per rank of an MLP trained with AdamW on gloo.

Four setups, each in a job of its own (so each rank's peak RSS is its own), at each world size:

- ``ddptrain DDP``: our DDP, plain (``dist.zero_stage=0``): the anchor every ratio is against;
- ``ZeRO-1`` / ``ZeRO-2``: our DDP with :class:`ddptrain.ddp.ZeroOptimizer` (``--algorithm``:
  ``native``, the default, or ``ring``);
- ``torch DDP + ZeRO``: ``torch.nn.parallel.DistributedDataParallel`` with
  ``torch.distributed.optim.ZeroRedundancyOptimizer`` (whole parameters assigned to ranks).

Per rank (rank 0's figures; the ranks differ by at most one bucket's chunk):

- ``optim MB``: bytes of optimizer state the rank holds after the first step;
- ``grad MB``: bytes of gradient the rank holds after a backward — ``.grad`` tensors plus our
  DDP's bucket buffers (ZeRO-2's two reused ones included) and shard gradients that are not views
  of them (torch DDP's own buckets are not visible: its figure is a lower bound);
- ``peak RSS MB``: the process's peak resident memory (``ru_maxrss``), start-up included;
- ``step ms``: median wall time of one step (forward, backward, optimizer step, zero_grad) after
  ``--warmup`` steps; ``fwd``/``bwd``/``opt ms`` its parts (``bwd`` includes the gradients'
  all-reduce or reduce-scatter; ``opt``, ZeRO's parameter all-gather).

With ``--rounds N`` the four jobs run N times, interleaved (all four, then all four again), and
each figure is the median over the rounds; each ratio is the median of the rounds' own ratios
(each against the plain DDP job of its round), so a slow minute on this shared machine moves one
round, not the anchor of all.

    .venv/bin/python scripts/bench_zero.py                                   # ~50M parameters, W=2 and 4
    .venv/bin/python scripts/bench_zero.py --layers 4 --steps 10 --rounds 5  # ~17M: the speed run

Measured figures go to benchmarks/README.md with the command and the date.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SETUPS = ("ddptrain DDP", "ZeRO-1", "ZeRO-2", "torch DDP + ZeRO")
MB = 1024 * 1024
PHASES = ("fwd", "bwd", "opt")  # forward; backward (with the reduction); step + zero_grad (with ZeRO's all-gather)


def _model(width: int, layers: int):
    import torch
    from torch import nn

    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*blocks)


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _state_bytes(state) -> int:
    import torch

    return sum(_tensor_bytes(v for v in s.values() if torch.is_tensor(v)) for s in state.values())


def _measure(
    rank: int, world_size: int, setup: str, width: int, layers: int, steps: int, warmup: int, algorithm: str
) -> dict:
    import torch

    from ddptrain.ddp import DistributedDataParallel, ZeroOptimizer

    model = _model(width, layers)
    if setup == "torch DDP + ZeRO":
        import torch.distributed as tdist
        from torch.distributed.optim import ZeroRedundancyOptimizer

        import ddptrain.comm as dist

        if not tdist.is_initialized():  # torch's own group, on the store our gloo group joined through
            store = tdist.PrefixStore("torch", dist.get_store().c10d)
            tdist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4)
        state_bytes = lambda: _state_bytes(opt.optim.state)  # noqa: E731 - this rank's local optimizer
        step, zero_grad = opt.step, lambda: opt.zero_grad(set_to_none=True)
    else:
        ddp = DistributedDataParallel(model)
        adamw = torch.optim.AdamW(model.parameters(), lr=1e-4)
        if setup == "ddptrain DDP":
            opt, state_bytes = adamw, (lambda: _state_bytes(adamw.state))
        else:
            opt = ZeroOptimizer(ddp, adamw, stage=1 if setup == "ZeRO-1" else 2, algorithm=algorithm)
            state_bytes = opt.state_bytes
        step, zero_grad = opt.step, lambda: opt.zero_grad(set_to_none=True)

    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(32, width, generator=g), torch.randn(32, width, generator=g)
    times, phases, grad_bytes = [], [], 0
    for i in range(warmup + steps):
        started = time.perf_counter()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        forward_done = time.perf_counter()
        loss.backward()
        backward_done = time.perf_counter()
        if i == 0:
            grad_bytes = _tensor_bytes(p.grad for p in model.parameters())
            reducer = getattr(ddp, "reducer", None)
            if reducer is not None and hasattr(reducer, "shard_grads"):
                buffers = [f.buffer for f in reducer.flat if f is not None]
                buffers += [t for ts in reducer.spare_buffers.values() for t in ts]  # ZeRO-2's reused buckets
                grad_bytes += _tensor_bytes(buffers)
                held = {b.untyped_storage().data_ptr() for b in buffers}  # ZeRO-1: its shards are views of them
                shards = [s for s in reducer.shard_grads if s.untyped_storage().data_ptr() not in held]
                grad_bytes += _tensor_bytes(shards)
        step()
        zero_grad()
        if i >= warmup:
            ended = time.perf_counter()
            times.append(ended - started)
            phases.append((forward_done - started, backward_done - forward_done, ended - backward_done))
    return {
        "optim MB": state_bytes() / MB,
        "grad MB": grad_bytes / MB,
        "peak RSS MB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "step ms": 1000 * statistics.median(times),
        **{f"{name} ms": 1000 * statistics.median(p[k] for p in phases) for k, name in enumerate(PHASES)},
        "params M": sum(p.numel() for p in model.parameters()) / 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=12, help="12 x 2048^2: ~50M parameters; 4: ~17M")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--algorithm", choices=("native", "ring"), default="native", help="ZeRO's collectives")
    parser.add_argument("--rounds", type=int, default=1, help="run the four jobs this many times, interleaved")
    parser.add_argument("--timeout-s", type=float, default=900)
    args = parser.parse_args()

    from ddptrain.testing import run_distributed

    keys = ("optim MB", "grad MB", "peak RSS MB", "step ms") + tuple(f"{name} ms" for name in PHASES)
    for world_size in args.world_sizes:
        rounds = []  # per round: {setup: rank 0's figures}
        for _ in range(args.rounds):
            rows = {}
            for setup in SETUPS:
                results = run_distributed(
                    _measure,
                    world_size,
                    setup,
                    args.width,
                    args.layers,
                    args.steps,
                    args.warmup,
                    args.algorithm,
                    backend="gloo",
                    timeout_s=args.timeout_s,
                )
                rows[setup] = results[0]
            rounds.append(rows)
        params_m = rounds[0]["ddptrain DDP"]["params M"]
        print(
            f"\nW={world_size}, MLP {args.layers}x{args.width}^2 ({params_m:.1f}M parameters), AdamW, gloo; "
            f"median of {args.rounds} round(s), ratios the median of each round's own"
        )
        print(f"{'setup':<18}" + "".join(f"{k:>22}" for k in keys))
        for setup in SETUPS:
            cells = ""
            for k in keys:
                value = statistics.median(r[setup][k] for r in rounds)
                ratio = statistics.median(r[setup][k] / r["ddptrain DDP"][k] for r in rounds)
                cells += f"{value:>12.1f} ({ratio:>5.2f}x)"
            print(f"{setup:<18}{cells}")
        if args.rounds > 1:
            for setup in SETUPS[1:]:
                ratios = ", ".join(f"{r[setup]['step ms'] / r['ddptrain DDP']['step ms']:.2f}" for r in rounds)
                print(f"{setup}: step time against plain DDP's, round by round: {ratios}")


if __name__ == "__main__":
    main()
