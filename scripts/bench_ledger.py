#!/usr/bin/env python
"""What the collective ledger costs: the MNIST recipe's step with the ledger on and off.

Two gloo processes x 1 thread train the tutorial's MNIST ``Net`` with ddptrain's DDP, batch 64 per
rank, SGD, plus the one small all-reduce per step by which the Trainer agrees on stopping: the
collectives of one ``python -m ddptrain recipe=mnist`` step. Steps alternate ledger on / off
(``ddptrain.comm.process_group.LEDGER_ON``; the ledger is always on otherwise) step by step, so
machine noise hits both alike. Also reported: the cost of one record (frame walk + ``struct.pack_into`` into the
memory-mapped file) measured in a loop, and from it the ledger's share of a step, which is the
figure to trust on a noisy machine (the step-time difference is far below the noise).

Usage::

    .venv/bin/python scripts/bench_ledger.py [--steps 40] [--rounds 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def record_cost_us(n: int = 20000) -> float:
    """Microseconds per ledger record, called 12 frames below user code (as from DDP's hook)."""
    from ddptrain.comm.ledger import Ledger, call_site

    with tempfile.TemporaryDirectory() as tmp:
        led = Ledger(0, 2, tmp)
        t = torch.ones(1000)

        def deep(k):
            if k:
                return deep(k - 1)
            start = time.perf_counter()
            for i in range(n):
                led.record(i, "world", "all_reduce", t, 0, call_site(1))
            return time.perf_counter() - start

        elapsed = deep(12)
        led.close()
    return elapsed / n * 1e6


def check_cost_us(every: int = 16, n: int = 500) -> float:
    """Microseconds per collective of the default ledger check (2 ranks, one check per ``every``)."""
    from types import SimpleNamespace

    from ddptrain.comm.ledger import Ledger
    from ddptrain.comm.ledger_check import PeerCheck

    with tempfile.TemporaryDirectory() as tmp:
        leds = [Ledger(r, 2, tmp) for r in range(2)]
        for seq in range(1, 200):
            for led in leds:
                led.record(seq, "world", "all_reduce", torch.ones(10), 0, b"x.py:1 in f")
        group = SimpleNamespace(name="world", global_ranks=[0, 1], size=lambda: 2)
        check = PeerCheck(tmp, every)
        check.check(group, 199)
        start = time.perf_counter()
        for _ in range(n):
            check._checked["world"] = 199 - every  # the last ``every`` records are new
            check.check(group, 199)
        elapsed = time.perf_counter() - start
        for led in leds:
            led.close()
    return elapsed / n / every * 1e6


def _bench(rank, world_size, steps, rounds):
    import ddptrain.comm as dist
    from ddptrain.comm import process_group
    from ddptrain.ddp import DistributedDataParallel
    from tests.models import MODELS

    torch.manual_seed(0)
    model = DistributedDataParallel(MODELS["net"]())
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
    x, y = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
    pg = dist.get_process_group()
    times = {True: [], False: []}
    before = pg.ledger.count
    for rnd in range(rounds + 1):  # round 0 warms up
        dist.barrier()
        for step in range(2 * steps):  # on and off alternate step by step: noise hits both alike
            on = step % 2 == 0
            process_group.LEDGER_ON = on
            t0 = time.perf_counter()
            opt.zero_grad()
            F.nll_loss(model(x), y).backward()
            opt.step()
            stop = torch.zeros(1)
            pg.all_reduce(stop).wait()  # the Trainer's per-step agreement on stopping
            if rnd:
                times[on].append(time.perf_counter() - t0)
    process_group.LEDGER_ON = True
    records = (pg.ledger.count - before) / ((rounds + 1) * steps)  # only the "on" steps record
    return {"on": statistics.median(times[True]) * 1e3, "off": statistics.median(times[False]) * 1e3, "rec": records}


def main() -> None:
    from ddptrain.testing import run_distributed

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    per_record = record_cost_us() + check_cost_us()
    res = run_distributed(_bench, 2, args.steps, args.rounds, timeout_s=1800, threads_per_worker=1)
    r0 = res[0]
    share = r0["rec"] * per_record / 1e3 / r0["off"] * 100
    print(
        f"MNIST Net, ddptrain DDP, 2 gloo processes x 1 thread, batch 64/rank; median of {args.rounds}x"
        f"{args.steps} steps per setting, rank 0 (rank 1 in brackets); load average {os.getloadavg()[0]:.2f}\n"
    )
    print("| ledger | step ms |\n|---|---|")
    for key in ("on", "off"):
        print(f"| {key} | {r0[key]:.2f} [{res[1][key]:.2f}] |")
    print(
        f"\nstep time on/off: {r0['on'] / r0['off']:.3f}; one record costs {per_record:.1f} us "
        "(with the ledger check's share), "
        f"{r0['rec']:.1f} records per step: {share:.3f}% of the step"
    )


if __name__ == "__main__":
    main()
