"""The link between ranks: an all-reduce sweep, and the alpha-beta model fitted to it.

The sweep times ``all_reduce`` of float32 tensors of growing size on the run's own process group
(what DDP's buckets use), reporting nccl-tests' figures: ``algbw = bytes / time`` and, for an
all-reduce, ``busbw = algbw * 2(p-1)/p`` (the bytes each link really carries, comparable across
world sizes). A line ``t(n) = a + b*n`` is put through the fastest small size
and the largest; for a ring all-reduce of ``p`` ranks ``a = 2(p-1) * alpha`` (latency steps) and
``b = 2(p-1)/p / B`` (each rank sends ``2(p-1)/p`` of the bytes at bandwidth ``B``), which is
what lets :class:`LinkModel` answer for other world sizes and link speeds.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from ..comm.types import ReduceOp
from ..ddp.timing import finish_queued_work

SWEEP_BYTES = (4 << 10, 64 << 10, 512 << 10, 4 << 20, 16 << 20)
LATENCY_BYTES = 64 << 10  # sizes up to this one are latency-bound: they give the model's alpha
_SLOW_S = 0.15  # a size that takes longer is the last one swept (a slow link)


@dataclass(frozen=True)
class LinkModel:
    """Ring all-reduce cost: ``2(p-1)*alpha_s + 2(p-1)/p * n / bandwidth_Bps`` for ``n`` bytes."""

    alpha_s: float
    bandwidth_Bps: float

    def allreduce_s(self, nbytes: float, world_size: int) -> float:
        """Seconds for one all-reduce of ``nbytes`` over ``world_size`` ranks (0 for one rank)."""
        p = world_size
        if p <= 1:
            return 0.0
        return 2 * (p - 1) * self.alpha_s + 2 * (p - 1) / p * nbytes / self.bandwidth_Bps

    def with_gbps(self, link_gbps: float | None) -> LinkModel:
        """The same latency on a link of ``link_gbps`` Gbit/s (``None``: unchanged)."""
        if link_gbps is None:
            return self
        return LinkModel(self.alpha_s, link_gbps * 1e9 / 8)

    @classmethod
    def fit(cls, sweep: list[dict], world_size: int) -> LinkModel:
        """``t = a + b*n`` through the fastest latency-bound size (up to 64 KiB: the latency floor,
        which one size slowed by a hiccup of the machine must not set) and the largest size (the
        bandwidth of big buckets): the two regimes DDP's collectives live in."""
        small = [row for row in sweep if row["bytes"] <= LATENCY_BYTES] or sweep[:1]
        first, last = min(small, key=lambda row: row["time_s"]), sweep[-1]
        span = last["bytes"] - first["bytes"]
        b = (last["time_s"] - first["time_s"]) / span if span > 0 else 0.0
        if b <= 0:  # a flat sweep: the largest size's throughput
            b = last["time_s"] / last["bytes"]
        a = max(first["time_s"] - b * first["bytes"], 1e-7)
        p = max(world_size, 2)
        return cls(alpha_s=a / (2 * (p - 1)), bandwidth_Bps=2 * (p - 1) / p / b)


def sweep(process_group, sizes: tuple[int, ...] = SWEEP_BYTES, repeats: int = 5) -> list[dict]:
    """Time all-reduces of each size (collective: every rank calls it); median seconds per size.

    Every rank takes the largest of the ranks' medians (one all-reduce more), so all ranks agree
    on the sweep and stop growing the size at the same point.
    """
    p, device, out = process_group.size(), process_group.device, []
    for nbytes in sizes:
        x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        process_group.all_reduce(x, ReduceOp.SUM).wait()  # warm-up: connections, buffers
        finish_queued_work(x.device)
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            process_group.all_reduce(x, ReduceOp.SUM).wait()
            finish_queued_work(x.device)  # NCCL's wait makes the stream wait, not the host
            times.append(time.perf_counter() - started)
        agreed = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
        process_group.all_reduce(agreed, ReduceOp.MAX).wait()
        t = float(agreed.item())
        algbw = nbytes / t / 1e9
        out.append({"bytes": nbytes, "time_s": t, "algbw_GBps": algbw, "busbw_GBps": algbw * 2 * (p - 1) / p})
        if t > _SLOW_S:
            break
    return out


def link_summary(sweep_rows: list[dict], model: LinkModel) -> dict:
    """The ``link`` object of ``doctor.json``: per-step latency, busbw (largest size), the sweep."""
    return {
        "latency_s": model.alpha_s,
        "busbw_GBps": sweep_rows[-1]["busbw_GBps"],
        "fit_bandwidth_GBps": model.bandwidth_Bps / 1e9,
        "sweep": sweep_rows,
    }
