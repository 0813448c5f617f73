#!/usr/bin/env python
"""All-reduce latency and bandwidth: ddptrain's gloo paths against torch.distributed's gloo.

Methods, all in the same worker processes (ddptrain's groups and torch.distributed's default group
coexist), float32 tensors, SUM:

  torch          torch.distributed.all_reduce(t) on torch's own gloo group (the baseline)
  ddp-pg         dist.get_process_group().all_reduce(t).wait()   (the ProcessGroup interface, as DDP uses it)
  ddp-api        dist.all_reduce(t)                              (functional API, default: the ledger check)
  ddp-api-sync   dist.all_reduce(t), DDPTRAIN_CHECK_COLLECTIVES=sync (one small all-reduce agrees first)
  ddp-api-nochk  dist.all_reduce(t) with no check at all          (= DDPTRAIN_CHECK_COLLECTIVES=0)
  ddp-ring       dist.ring_all_reduce(t)                         (ddptrain's ring over gloo send/recv)

For each size the methods are interleaved round by round (the order rotates every round), so slow
drifts of a shared machine hit all methods alike. A round syncs the ranks with a barrier, then
times ``--reps`` back-to-back operations on rank 0; the table reports the median over rounds of the
per-operation time. algbw = bytes / time; busbw = algbw * 2(p-1)/p (what each link carries).

Usage::

    .venv/bin/python scripts/bench_comm.py                 # 4 KiB .. 64 MiB, 2 processes
    .venv/bin/python scripts/bench_comm.py --quick         # a fast sanity run
    .venv/bin/python scripts/bench_comm.py --sizes 1M,4M --iters 30 --world-size 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import ddptrain.comm as dist  # noqa: E402
from ddptrain.comm import api as _api  # noqa: E402  (to toggle the shape check in place)
from ddptrain.launch import find_free_port, launch  # noqa: E402

METHODS = ["torch", "ddp-pg", "ddp-api", "ddp-api-sync", "ddp-api-nochk", "ddp-ring"]
DEFAULT_SIZES = "4K,16K,64K,256K,1M,4M,16M,64M"
QUICK_SIZES = "4K,1M,4M"


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if text[-1:] in "KMG" else text) * mult)


def human(nbytes: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= div and nbytes % div == 0:
            return f"{nbytes // div} {unit}"
    return f"{nbytes} B"


def _op(method: str):
    pg = dist.get_process_group()
    if method == "torch":
        return lambda t: torch.distributed.all_reduce(t)
    if method == "ddp-pg":
        return lambda t: pg.all_reduce(t).wait()
    if method in ("ddp-api", "ddp-api-sync", "ddp-api-nochk"):
        return lambda t: dist.all_reduce(t)
    if method == "ddp-ring":
        return lambda t: dist.ring_all_reduce(t)
    raise ValueError(method)


_HOOK: list = []  # the world group's ledger check, as init_process_group installed it


def _set_check(method: str) -> None:
    # What init_process_group sets from DDPTRAIN_CHECK_COLLECTIVES; flipped here so that the
    # three settings interleave in one job.
    pg = dist.get_process_group()
    if not _HOOK:
        _HOOK.append(pg._ledger_hook)
    _api._state.check_collectives = {"ddp-api-sync": "sync", "ddp-api-nochk": False}.get(method, True)
    pg._ledger_hook = None if method == "ddp-api-nochk" else _HOOK[0]


def _async_return_ms(rank: int, late_s: float = 0.5) -> dict:
    """How long ``all_reduce(async_op=True)`` takes to return on rank 0 while rank 1 calls it
    ``late_s`` later, with the default check and with the synchronous one."""
    out = {}
    for mode in ("ddp-api", "ddp-api-sync"):
        _set_check(mode)
        torch.distributed.barrier()
        t = torch.ones(1024)
        if rank == 1:
            time.sleep(late_s)
        start = time.perf_counter()
        work = dist.all_reduce(t, async_op=True)
        out[mode] = (time.perf_counter() - start) * 1e3
        work.wait()
    return out


def _reps_for(nbytes: int, reps: int | None) -> int:
    if reps:
        return reps
    return max(1, min(20, (1 << 20) // max(nbytes, 1)))  # ~1 MiB of traffic per timed block, at least 1 op


def _worker(
    rank: int,
    ws: int,
    torch_port: int,
    sizes: list[int],
    iters: int,
    warmup: int,
    reps_opt: int | None,
    methods: list[str],
) -> dict:
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{torch_port}", rank=rank, world_size=ws, timeout=timedelta(seconds=300)
    )
    try:
        ops = {m: _op(m) for m in methods}
        # correctness first: every method must compute the same sum
        for m in methods:
            _set_check(m)
            t = torch.full((1000,), float(rank + 1))
            ops[m](t)
            want = ws * (ws + 1) / 2
            if not torch.all(t == want):
                raise AssertionError(f"{m}: all-reduce gave {t[:3].tolist()}, expected {want}")
        results: dict = {}
        for nbytes in sizes:
            t = torch.zeros(nbytes // 4, dtype=torch.float32)  # zeros stay zeros under SUM
            reps = _reps_for(nbytes, reps_opt)
            for m in methods:
                _set_check(m)
                for _ in range(warmup):
                    ops[m](t)
            times = {m: [] for m in methods}
            for it in range(iters):
                order = methods[it % len(methods) :] + methods[: it % len(methods)]
                for m in order:
                    _set_check(m)
                    torch.distributed.barrier()
                    start = time.perf_counter()
                    for _ in range(reps):
                        ops[m](t)
                    times[m].append((time.perf_counter() - start) / reps)
            results[nbytes] = times
        if "ddp-api" in methods and ws > 1:
            results["async"] = _async_return_ms(rank)
        return results
    finally:
        _set_check("ddp-api")
        torch.distributed.destroy_process_group()


def run(sizes, iters, warmup, reps, world_size, methods, timeout_s):
    torch_port = find_free_port()
    # Each library picks its gloo device as it would for a user (ddptrain: 127.0.0.1 for a local job;
    # torch: the hostname's address); set GLOO_SOCKET_IFNAME to force one interface for both.
    results = launch(
        _worker,
        world_size,
        (torch_port, sizes, iters, warmup, reps, methods),
        backend="gloo",
        timeout_s=timeout_s,
        comm_timeout_s=300,
    )
    return results[0]  # rank 0's clock


def table(results, world_size, methods) -> str:
    factor = 2 * (world_size - 1) / world_size
    lines = ["| size | method | median ms | algbw GB/s | busbw GB/s | vs torch |", "|---:|:---|---:|---:|---:|---:|"]
    for nbytes, times in results.items():
        if nbytes == "async":
            continue
        base = statistics.median(times["torch"]) if "torch" in times else None
        for m in methods:
            med = statistics.median(times[m])
            algbw = nbytes / med / 1e9
            ratio = f"{med / base:.2f}x" if base else "-"
            lines.append(f"| {human(nbytes)} | {m} | {med * 1e3:.3f} | {algbw:.3f} | {algbw * factor:.3f} | {ratio} |")
    if "async" in results:
        a = results["async"]
        lines.append(
            f"\nall_reduce(async_op=True) on rank 0 while rank 1 calls it 500 ms later: returned after "
            f"{a['ddp-api']:.2f} ms with the default check, {a['ddp-api-sync']:.1f} ms with "
            "DDPTRAIN_CHECK_COLLECTIVES=sync"
        )
    return "\n".join(lines)


def _mpi_child(args, sizes, iters, warmup, methods) -> int:
    """One rank under mpiexec: ddptrain on mpi, torch.distributed on gloo, same processes."""
    from mpi4py import MPI

    torch.set_num_threads(1)
    dist.init_process_group("mpi", timeout=600)
    rank, ws = dist.get_rank(), dist.get_world_size()
    port = MPI.COMM_WORLD.bcast(find_free_port() if rank == 0 else None, root=0)
    t0 = time.monotonic()
    results = _worker(rank, ws, port, sizes, iters, warmup, args.reps, methods)
    if rank == 0:
        print(
            f"all_reduce float32 SUM, {ws} processes on one machine: ddptrain on mpi (Open MPI through "
            f"mpi4py), torch.distributed on gloo; {os.cpu_count()} CPUs; median of {iters} rounds; "
            f"took {time.monotonic() - t0:.0f} s\n"
        )
        print(table(results, ws, methods))
    dist.destroy_process_group()
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default=None, help=f"comma-separated sizes (default {DEFAULT_SIZES})")
    ap.add_argument("--iters", type=int, default=None, help="timed rounds per method and size (default 25)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed operations per method and size")
    ap.add_argument(
        "--reps", type=int, default=None, help="operations per timed round (default: about 1 MiB of traffic, 1..20)"
    )
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--methods", default=",".join(METHODS), help=f"subset of {','.join(METHODS)}")
    ap.add_argument("--quick", action="store_true", help=f"sizes {QUICK_SIZES}, 5 rounds: a sanity run")
    ap.add_argument("--timeout", type=float, default=1800, help="overall limit in seconds")
    ap.add_argument(
        "--backend",
        choices=["gloo", "mpi"],
        default="gloo",
        help="ddptrain's backend (mpi: the script re-runs itself under mpiexec; torch stays on gloo)",
    )
    ap.add_argument("--mpi-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.backend == "mpi" and args.methods == ",".join(METHODS):
        args.methods = "torch,ddp-pg,ddp-ring"

    sizes = [parse_size(s) for s in (args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES)).split(",")]
    for s in sizes:
        if s % 4:
            ap.error(f"size {s} bytes is not a whole number of float32 elements")
    iters = args.iters or (5 if args.quick else 25)
    warmup = 1 if args.quick and args.warmup == 3 else args.warmup
    methods = [m.strip() for m in args.methods.split(",")]
    unknown = set(methods) - set(METHODS)
    if unknown:
        ap.error(f"unknown methods {sorted(unknown)}; choose from {METHODS}")

    if args.mpi_child:
        return _mpi_child(args, sizes, iters, warmup, methods)
    if args.backend == "mpi":
        import shutil
        import subprocess

        mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or "mpiexec"
        env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        child = [a for a in (argv if argv is not None else sys.argv[1:])] + ["--mpi-child", "--methods", args.methods]
        return subprocess.call(
            [mpiexec, "-n", str(args.world_size), "--oversubscribe", sys.executable, os.path.abspath(__file__), *child],
            env=env,
            timeout=args.timeout,
        )

    t0 = time.monotonic()
    results = run(sizes, iters, warmup, args.reps, args.world_size, methods, args.timeout)
    load = os.getloadavg() if hasattr(os, "getloadavg") else ("?",)
    print(
        f"all_reduce float32 SUM, {args.world_size} processes on one machine over loopback gloo; torch "
        f"{torch.__version__}; {os.cpu_count()} CPUs; median of {iters} rounds; "
        f"load average {load[0]:.2f}; took {time.monotonic() - t0:.0f} s\n"
    )
    print(table(results, args.world_size, methods))
    return 0


if __name__ == "__main__":
    sys.exit(main())
