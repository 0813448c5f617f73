#!/usr/bin/env python
"""DDP step time: ddptrain's DistributedDataParallel against torch's, in the same processes.

Two gloo processes with one thread each train (a) the tutorial's MNIST ``Net`` and (b) an MLP
784-2048x5-10 (~18M parameters), batch 64 per rank, SGD. Per model four variants run
interleaved, round after round, so machine noise hits them alike:

* ``no sync``          — local steps only (the floor: compute without communication);
* ``average_gradients``— the tutorial's per-parameter all-reduce after backward (torch.distributed);
* ``torch DDP``        — torch.nn.parallel.DistributedDataParallel;
* ``ddptrain DDP``     — ours (optionally ``--algorithm ring``).

Prints median ms per step and the ratio ddptrain/torch. Usage::

    .venv/bin/python scripts/bench_ddp.py [--steps 30] [--rounds 5] [--models net,mlp]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def _bench(rank, world_size, model_names, steps, rounds, bucket_cap_mb, gloo_group=None):
    import torch.distributed as tdist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import ddptrain.comm as dist
    from ddptrain.ddp import DistributedDataParallel as OurDDP
    from tests.models import MODELS

    if dist.get_backend() == "mpi":  # torch's gloo needs a store: rank 0 picks a port, MPI shares it
        from mpi4py import MPI

        from ddptrain.launch import find_free_port

        port = MPI.COMM_WORLD.bcast(find_free_port() if rank == 0 else None, root=0)
        tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    else:
        tdist.init_process_group(
            "gloo", store=tdist.PrefixStore("torch", dist.get_store().c10d), rank=rank, world_size=world_size
        )

    def average_gradients(model):
        for p in model.parameters():
            tdist.all_reduce(p.grad.data, op=tdist.ReduceOp.SUM)
            p.grad.data /= world_size

    results = {}
    for name in model_names:
        torch.manual_seed(0)
        base = MODELS[name]()
        variants = {
            "no sync": (base, lambda m: None),
            "average_gradients": (MODELS[name](), average_gradients),
            "torch DDP": (TorchDDP(MODELS[name](), bucket_cap_mb=bucket_cap_mb), lambda m: None),
            "ddptrain DDP": (OurDDP(MODELS[name](), bucket_cap_mb=bucket_cap_mb), lambda m: None),
        }
        opts = {k: torch.optim.SGD(m.parameters(), lr=0.01) for k, (m, _) in variants.items()}
        x = torch.randn(64, 1, 28, 28)
        y = torch.randint(0, 10, (64,))
        times = {k: [] for k in variants}
        for rnd in range(rounds + 1):  # round 0 warms up (and lets both DDPs rebuild buckets)
            for key, (model, after_backward) in variants.items():
                tdist.barrier()
                for _ in range(steps):
                    t0 = time.perf_counter()
                    opts[key].zero_grad()
                    F.nll_loss(model(x), y).backward()
                    after_backward(model)
                    opts[key].step()
                    if rnd:
                        times[key].append(time.perf_counter() - t0)
        results[name] = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    tdist.destroy_process_group()
    return results


def _mpi_main(args) -> None:
    """Runs on every rank under mpiexec: ddptrain's DDP on mpi, torch's on gloo."""
    import ddptrain.comm as dist

    torch.set_num_threads(1)
    dist.init_process_group("mpi", timeout=600)
    res = _bench(
        dist.get_rank(), dist.get_world_size(), args.models.split(","), args.steps, args.rounds, args.bucket_cap_mb
    )
    from ddptrain.comm.objects import all_gather_object

    per_rank = all_gather_object(dist.get_process_group(), res)
    if dist.get_rank() == 0:
        _print(per_rank, args, "ddptrain DDP on mpi (torch DDP and average_gradients on gloo)")


def _print(per_rank, args, title) -> None:
    models = args.models.split(",")
    print(
        f"DDP step time, {args.world_size} processes x 1 thread, batch 64/rank, {title}; "
        f"median over {args.rounds}x{args.steps} steps (rank 0; rank 1 in brackets)\n"
    )
    print("| model | no sync ms | average_gradients ms | torch DDP ms | ddptrain DDP ms | ddptrain/torch |")
    print("|---|---|---|---|---|---|")
    for name in models:
        r0, r1 = per_rank[0][name], per_rank[1][name]
        cells = [f"{r0[k]:.1f} [{r1[k]:.1f}]" for k in ("no sync", "average_gradients", "torch DDP", "ddptrain DDP")]
        ratio = r0["ddptrain DDP"] / r0["torch DDP"]
        print(f"| {name} | " + " | ".join(cells) + f" | {ratio:.3f} |")


def main() -> None:
    from ddptrain.testing import run_distributed

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="net,mlp")
    ap.add_argument("--steps", type=int, default=20, help="steps per variant per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--bucket-cap-mb", type=float, default=25.0)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument(
        "--backend",
        choices=["gloo", "mpi"],
        default="gloo",
        help="backend of ddptrain's DDP (torch DDP always runs on gloo)",
    )
    ap.add_argument("--mpi-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mpi_child:
        return _mpi_main(args)
    if args.backend == "mpi":
        import shutil
        import subprocess

        mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or "mpiexec"
        env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1")
        cmd = [
            mpiexec,
            "-n",
            str(args.world_size),
            "--oversubscribe",
            sys.executable,
            __file__,
            "--mpi-child",
            "--models",
            args.models,
            "--steps",
            str(args.steps),
            "--rounds",
            str(args.rounds),
            "--bucket-cap-mb",
            str(args.bucket_cap_mb),
            "--world-size",
            str(args.world_size),
        ]
        raise SystemExit(subprocess.call(cmd, env=env))
    per_rank = run_distributed(
        _bench,
        args.world_size,
        args.models.split(","),
        args.steps,
        args.rounds,
        args.bucket_cap_mb,
        timeout_s=3600,
        comm_timeout_s=600,
        threads_per_worker=1,
    )
    _print(per_rank, args, "all on gloo")


if __name__ == "__main__":
    main()
