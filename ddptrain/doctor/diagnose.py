"""From every rank's step timings to a ranked list of causes, each with advice and a prediction.

:func:`summarize` turns the records into the step-time breakdown: per step, the rank that
waited least after backward shows the link's own time (``comm_exposed_s``); what the other
ranks waited beyond it is the wait for the slowest rank (``sync_wait_s``). :func:`diagnose`
applies one rule per cause; a cause is reported when it costs at least ``MIN_SHARE`` of the
step, ranked by that share, each with the config key that removes it and the step time
predicted after the change. Nothing found: ``healthy`` (compute-bound).

Cause names are stable (tools read them): ``data_loading``, ``straggler`` (with ``rank``),
``slow_network``, ``small_buckets``, ``no_overlap``, ``find_unused_overhead``,
``cpu_oversubscribed``, ``healthy``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from ..config import DEFAULT_BUCKET_CAP_MB
from .link import LinkModel
from .predict import StepModel

MIN_SHARE = 0.10
STRAGGLER_MIN_SHARE = 0.30  # ranks sharing busy cores take turns being late; a straggler is steady and large
STRAGGLER_STEADY = 0.75  # ... and the busiest rank in at least this share of the steps
# Looking for unused parameters when every one is used is pure overhead: worth saying from a few %.
FIND_UNUSED_MIN_SHARE = 0.03
# Forward+backward this much slower in the window than alone (the probe): communication ran inside
# them, on the same cores (CPU ranks), so it does not overlap.
STOLEN_MIN = 0.10
MAX_WORKERS = 16  # data.num_workers advised at most (loading that waits on I/O uses few cores)
# A straggler found beside one of these is likely its consequence (a rank starved of cores or of
# data): the root cause is listed first.
ROOT_CAUSES_OF = {"straggler": ("cpu_oversubscribed", "data_loading")}
BREAKDOWN = (
    "data_s",
    "forward_s",
    "backward_s",
    "comm_exposed_s",
    "sync_wait_s",
    "find_unused_s",
    "optimizer_s",
    "other_s",
)
MB = 1 << 20


@dataclass
class JobFacts:
    """What the rules need to know about the job besides its timings.

    ``buckets_at(cap_mb)`` gives the bucket layout (bytes of each all-reduce, per bucket) the
    reducer would use at another ``dist.bucket_cap_mb``. ``compute_probe``: forward+backward
    seconds without communication, timed with this run's threads (``now_s``) and, when they
    outnumber the cores, with ``cores // ranks_per_host`` (``fit_s``; else the same), and each
    rank's passes run back to back (``warm_s``, by rank); ``None``: not measured.
    """

    world_size: int
    ranks_per_host: int
    threads: int
    cores: int
    num_workers: int
    bucket_cap_mb: float
    find_unused: bool
    bucket_sizes: tuple[tuple[int, ...], ...]
    buckets_at: Callable[[float], tuple[tuple[int, ...], ...]] = field(repr=False, default=None)
    compute_probe: dict | None = None
    samples_per_step: int = 0  # the global batch (0: unknown; no bytes per sample then)

    @property
    def shares_cores(self) -> bool:
        """This host's ranks run more threads than it has cores: they take turns on them."""
        return self.ranks_per_host * self.threads > self.cores


def summarize(per_rank: list[list[dict]], shared_cores: bool = False) -> tuple[dict, list[dict]]:
    """``(breakdown, per_rank)``: medians over the window's steps (breakdown: of the rank mean).

    Waiting for the slowest rank counts as ``sync_wait_s``, wherever it happened (the bucket
    all-reduces or, with ``find_unused_parameters``, the used flags' all-reduce before them).
    Per rank also ``busy_s`` (its step without communication and waiting for peers), ``own_s``
    (its own work: ``busy_s``, less the time its thread waited for a core when the host's ranks
    outnumber its cores, ``shared_cores``: which rank the OS keeps waiting says nothing about the
    rank) and ``busiest_share`` (in how many of the steps its ``own_s`` was the largest: a
    straggler is busiest step after step; ranks that take turns on a busy host are not).
    """
    steps = sorted(set.intersection(*(set(r["step"] for r in recs) for recs in per_rank)))
    by_rank = [{r["step"]: r for r in recs} for recs in per_rank]
    rows: list[list[dict]] = [[] for _ in per_rank]
    for s in steps:
        least = min(ranks[s]["comm_s"] for ranks in by_rank)
        # find_unused_parameters: the used flags' all-reduce comes first after backward, so the wait
        # for the slowest rank lands in it: that part is waiting, not the search's cost
        least_flags = min(ranks[s]["find_unused_comm_s"] for ranks in by_rank)
        for rank, ranks in enumerate(by_rank):
            r = ranks[s]
            flags_wait = r["find_unused_comm_s"] - least_flags
            row = {k: r[k] for k in ("data_s", "forward_s", "backward_s", "optimizer_s", "other_s")}
            row.update(comm_exposed_s=least, sync_wait_s=r["comm_s"] - least + flags_wait, step_s=r["end"] - r["start"])
            row.update(cpu_s=r["cpu_s"], core_wait_s=r["core_wait_s"], unused_params=r["unused_params"])
            row["data_core_wait_s"] = r.get("data_core_wait_s", 0.0)
            row["find_unused_s"] = r["find_unused_s"] - flags_wait
            row["busy_s"] = row["step_s"] - r["comm_s"] - flags_wait
            waited = row["core_wait_s"] + row["data_core_wait_s"]  # for a core, over the whole step
            row["own_s"] = row["busy_s"] - (waited if shared_cores else 0.0)
            row["in_backward_s"] = _comm_in_backward(r)
            rows[rank].append(row)
    keys = ("step_s", *BREAKDOWN, "cpu_s", "core_wait_s", "data_core_wait_s", "busy_s", "own_s", "in_backward_s")
    ranks = [{"rank": i, **{k: statistics.median(x[k] for x in rs) for k in keys}} for i, rs in enumerate(rows)]
    for i, rank in enumerate(ranks):
        busiest = sum(max(range(len(rows)), key=lambda r: rows[r][n]["own_s"]) == i for n in range(len(steps)))
        rank["busiest_share"] = busiest / max(len(steps), 1)
    breakdown = {
        k: statistics.median(statistics.fmean(rows[r][i][k] for r in range(len(rows))) for i in range(len(steps)))
        for k in keys
    }
    breakdown["steps"] = len(steps)
    breakdown["ready_curve"] = _median_curve([r.get("ready_curve") or [] for recs in per_rank for r in recs])
    breakdown["unused_params"] = max(x["unused_params"] for rs in rows for x in rs) if steps else 0
    return breakdown, ranks


def _comm_in_backward(record: dict) -> float:
    """Seconds of all-reduces in flight before backward ended (overlapping buckets count once)."""
    end = record.get("marks", {}).get("backward_end")
    spans = sorted((b["launch"], min(b["done"] or end, end)) for b in record.get("buckets", []) if end and b["launch"])
    total, reach = 0.0, float("-inf")
    for start, stop in spans:
        start = max(start, reach)
        if stop > start:
            total += stop - start
            reach = stop
    return total


def _median_curve(curves: list[list]) -> list[tuple[float, float]]:
    """The median gradient-readiness curve (``measure.ready_curve``) of the records whose curves
    have the common length (the same gradients arrived); [] if none."""
    if not curves:
        return []
    length = statistics.mode(len(c) for c in curves)
    same = [c for c in curves if len(c) == length]
    return [(statistics.median(c[i][0] for c in same), same[0][i][1]) for i in range(length)]


def step_model(breakdown: dict, facts: JobFacts, link: LinkModel) -> StepModel:
    """The measured step as the prediction model sees it, calibrated on ``link``."""
    b = breakdown
    compute = b["step_s"] - b["comm_exposed_s"] - b["sync_wait_s"]
    probe = facts.compute_probe
    stolen = 0.0  # communication that ran inside forward/backward and slowed them (shared cores)
    if probe:
        # what compute lost, up to the time all-reduces actually ran beside it (one bucket launched
        # at the end of backward steals nothing, whatever noise the probe has)
        lost = min(b["forward_s"] + b["backward_s"] - probe["now_s"], b.get("in_backward_s", 0.0))
        if lost > STOLEN_MIN * probe["now_s"]:
            stolen = lost
    return StepModel(
        step_s=b["step_s"],
        compute_s=max(compute, 1e-9),
        backward_s=b["backward_s"],
        exposed_s=b["comm_exposed_s"],
        wait_s=b["sync_wait_s"],
        stolen_s=stolen,
        ready_curve=tuple(tuple(p) for p in breakdown.get("ready_curve") or ()),
        bucket_sizes=facts.bucket_sizes,
        world_size=facts.world_size,
        ranks_per_host=facts.ranks_per_host,
        threads=facts.threads,
        cores=facts.cores,
    ).calibrate(link)


def _cause(name: str, share: float, advice: str, predicted: float, **extra) -> dict:
    return {"cause": name, **extra, "share": round(share, 4), "advice": advice, "predicted_step_s": predicted}


def _data_loading(b, ranks, facts, link, model) -> dict | None:
    # On a host whose ranks outnumber its cores, the loading's own time is the wait for the batch
    # without the part the thread spent ready to run but without a core: the ranks take turns on
    # the cores (3 ranks of the tutorial net on 2 cores: a third of a 2 ms wait for 32 samples, in
    # 18 ms steps, at times a whole 5 ms scheduler slice), and loader processes would not shorten
    # that, they need cores too. With a core per rank the wait for a core is the wake-up after
    # each read (a slow disk), which loader processes do take off the rank: it counts.
    waited = b.get("data_core_wait_s", 0.0) if facts.shares_cores else 0.0
    step, data = b["step_s"], max(b["data_s"] - waited, 0.0)
    rest = max(step - data, 1e-6)
    fetch = data if facts.num_workers == 0 else facts.num_workers * step  # one batch's loading time
    # Loader processes that just keep pace leave the rank waiting at every hiccup (batches arrive
    # in order: one late worker holds the rest up): half as many again.
    workers = min(MAX_WORKERS, max(2 * facts.num_workers, math.ceil(1.5 * fetch / rest) + 1))
    return _cause(
        "data_loading",
        data / step,
        f"data.num_workers={workers}: each step spends {data:.3g} s loading its batch (of {step:.3g} s); "
        f"{workers} loader processes per rank prepare batches while the rank computes",
        max(rest, fetch / workers),
    )


def _straggler(b, ranks, facts, link, model) -> dict | None:
    if len(ranks) < 2:
        return None
    slow = max(ranks, key=lambda r: r["own_s"])
    others = statistics.median(r["own_s"] for r in ranks if r is not slow)
    extra = slow["own_s"] - others
    if slow["busiest_share"] < STRAGGLER_STEADY:
        return None
    # Shares by speed: each rank's share of the batch in proportion to 1 / own_s, all done at once.
    balanced = len(ranks) / sum(1 / r["own_s"] for r in ranks if r["own_s"] > 0) + b["comm_exposed_s"]
    return _cause(
        "straggler",
        extra / b["step_s"],
        f"rank {slow['rank']} works {extra:.3g} s longer per step than the others, who wait for it: remove what "
        "slows that rank (rank-dependent work in training_step, another job or a slower host); if its host is "
        "slower, run fewer ranks there (dist.world_size) or give them fewer threads (dist.threads_per_worker); "
        f"or give it less of each batch by its speed, trainer.balance.shares=auto (predicted step {balanced:.3g} s)",
        # the others' own step: their work (and turns on the cores) and the link's time
        statistics.median(_unhurried_busy_s(r, facts) for r in ranks if r is not slow) + b["comm_exposed_s"],
        rank=slow["rank"],
    )


def _unhurried_busy_s(rank: dict, facts: JobFacts) -> float:
    """A waiting rank's work once nobody waits: its busy time, sped up as its forward+backward is
    when run back to back (the probe's ``warm_s``) rather than after each wait; never slowed."""
    probe = facts.compute_probe or {}
    warm = probe.get("warm_s")
    window = rank["forward_s"] + rank["backward_s"]
    if not warm or window <= 0:
        return rank["busy_s"]
    return rank["busy_s"] * min(1.0, warm[rank["rank"]] / window)


def _slow_network(b, ranks, facts, link, model) -> dict | None:
    latency, bandwidth = model.latency_and_bandwidth_s()
    if bandwidth < latency or bandwidth + latency <= 0:  # latency-bound, or nothing crosses a link (one rank)
        return None
    nbytes = sum(sum(x) for x in facts.bucket_sizes)
    step, exposed, p = b["step_s"], b["comm_exposed_s"], facts.world_size
    busbw = model.link.bandwidth_Bps * 2 * (p - 1) / p / 1e9
    overlappable = 0.0  # what smaller buckets would hide: no_overlap's, not the link's
    if facts.buckets_at is not None and nbytes:
        overlappable = max(0.0, step - model.with_buckets(facts.buckets_at(_quarter_mb(nbytes))))
    options = local_sync_options(b, facts, model.link)
    best = recommended_local_sync(options)
    # Below no_overlap's own threshold, the part smaller buckets would hide is still said here: on a
    # slow link it is what a one-bucket layout costs, whichever of the two causes ranks first.
    hidden = (
        f" Smaller buckets would hide {overlappable:.3g} s of it behind backward: "
        f"dist.bucket_cap_mb={_quarter_mb(nbytes):g}."
        if overlappable > 0.02 * step
        else ""
    )
    return _cause(
        "slow_network",
        (exposed - overlappable) * bandwidth / (bandwidth + latency) / step,
        f"bandwidth-bound: {nbytes / MB:.3g} MiB of gradients per step at {busbw:.3g} GB/s busbw leave "
        f"{exposed:.3g} s exposed after backward; talk less often: dist.sync=diloco dist.sync_every="
        f"{best['sync_every']} predicts {best['predicted_step_s']:.3g} s per step ({best['speedup']:.3g}x, "
        f"{best['sync_every']}x fewer bytes; local_sgd costs the same). {LOCAL_SYNC_CONVERGENCE} "
        f"Otherwise a faster link (doctor.link_gbps=... predicts one), or double data.global_batch_size.{hidden}",
        best["predicted_step_s"],
        sync_options=options,
    )


LOCAL_SYNC_EVERY = (4, 16, 64)  # the H of dist.sync_every the doctor predicts
# The doctor predicts time, not convergence: the advice says so.
# The figures: benchmarks/README.md, "Slow links" (scripts/bench_slow_link.py, 2026-12-05).
LOCAL_SYNC_CONVERGENCE = (
    "Convergence per sample differs (fewer, larger updates): on scripts/bench_slow_link.py (recipe=mnist_fast, "
    "H=16) diloco ended 0.23-0.27 points below every_step over 4 epochs (58 outer steps) and 0.30-0.56 over 2 "
    "(its outer momentum 0.9 remembers ~10 outer steps; with dist.outer_momentum=0.5, 0.13), local_sgd 0.03-0.15. "
    "Compare the accuracy after the same samples before keeping it."
)


def local_sync_options(b: dict, facts: JobFacts, link: LinkModel) -> list[dict]:
    """Each way of syncing, predicted: ``every_step`` (this run) and ``dist.sync=local_sgd|diloco``
    at each H of ``LOCAL_SYNC_EVERY``: ``{sync, sync_every, predicted_step_s, speedup,
    bytes_per_sample}``.

    A local step (:func:`local_step_s`), plus one all-reduce of every parameter byte, fully
    exposed, every H steps. Bytes per sample: this rank's payload over the global batch.
    """
    nbytes = sum(sum(x) for x in facts.bucket_sizes)
    local = local_step_s(b, facts)
    outer = link.allreduce_s(nbytes, facts.world_size)
    per_sample = (lambda n: n / facts.samples_per_step) if facts.samples_per_step else (lambda n: None)
    rows = [dict(sync="every_step", sync_every=1, predicted_step_s=b["step_s"], bytes_per_sample=per_sample(nbytes))]
    for h in LOCAL_SYNC_EVERY:
        step = local + outer / h
        rows.append(dict(sync="diloco", sync_every=h, predicted_step_s=step, bytes_per_sample=per_sample(nbytes / h)))
    for row in rows:
        row["speedup"] = b["step_s"] / row["predicted_step_s"] if row["predicted_step_s"] > 0 else 1.0
    return rows


def local_step_s(b: dict, facts: JobFacts) -> float:
    """A step between outer steps: nothing sent (no gradient all-reduce, no buffer broadcast) and
    no wait for the other ranks. Its forward and backward are the compute probe's (``no_sync``,
    every rank computing at once, the slowest rank's median: a slow rank is as slow between outer
    steps); the measured ones are not, because under ``every_step`` they hold the wait for rank 0's
    buffers and share the cores with the transport. The rest of the step (data, optimizer, other)
    stays. Without a probe: this step less its exposed communication."""
    probe = facts.compute_probe
    if not probe:
        return b["step_s"] - b["comm_exposed_s"]
    return b["data_s"] + probe["now_s"] + b["find_unused_s"] + b["optimizer_s"] + b["other_s"]


def recommended_local_sync(options: list[dict]) -> dict:
    """The smallest H whose predicted step is within 10% of the largest H's: talking less often
    than that saves little time and costs convergence. (Every prediction is a sum of non-negative
    phases, so the best one itself is within 10%.)"""
    local = [o for o in options if o["sync"] != "every_step"]
    floor = min(o["predicted_step_s"] for o in local)
    return next(o for o in sorted(local, key=lambda o: o["sync_every"]) if o["predicted_step_s"] <= 1.1 * floor)


def _small_buckets(b, ranks, facts, link, model) -> dict | None:
    latency, bandwidth = model.latency_and_bandwidth_s()
    if latency <= bandwidth or facts.buckets_at is None or facts.bucket_cap_mb >= DEFAULT_BUCKET_CAP_MB:
        return None
    layout = facts.buckets_at(DEFAULT_BUCKET_CAP_MB)
    predicted = model.with_buckets(layout)
    count = sum(len(x) for x in facts.bucket_sizes)
    return _cause(
        "small_buckets",
        (b["step_s"] - predicted) / b["step_s"],
        f"latency-bound: {count} all-reduces per step in {len(facts.bucket_sizes)} buckets of "
        f"dist.bucket_cap_mb={facts.bucket_cap_mb:g}; dist.bucket_cap_mb={DEFAULT_BUCKET_CAP_MB:g} makes it "
        f"{sum(len(x) for x in layout)} all-reduce(s)",
        predicted,
    )


def _quarter_mb(nbytes: int) -> float:
    """A bucket cap that splits ``nbytes`` of gradients into about four buckets (two significant
    digits: 0.021 for the tutorial's 87 kB; a floor of 1 MB would leave a small model one bucket)."""
    return float(f"{nbytes / MB / 4:.2g}")


def _no_overlap(b, ranks, facts, link, model) -> dict | None:
    sizes = facts.bucket_sizes
    nbytes = sum(sum(x) for x in sizes)
    if facts.buckets_at is None or not nbytes or sum(sizes[-1]) < 0.8 * nbytes or b["backward_s"] <= 0:
        return None
    cap = _quarter_mb(nbytes)
    layout = facts.buckets_at(cap)
    predicted = model.with_buckets(layout)
    return _cause(
        "no_overlap",
        (b["step_s"] - predicted) / b["step_s"],
        f"{sum(sizes[-1]) / nbytes:.0%} of the gradient bytes travel in the last bucket, after backward: "
        f"dist.bucket_cap_mb={cap:g} starts their all-reduces while backward runs",
        predicted,
    )


def _find_unused(b, ranks, facts, link, model) -> dict | None:
    if not facts.find_unused or b["unused_params"]:
        return None
    return _cause(
        "find_unused_overhead",
        b["find_unused_s"] / b["step_s"],
        f"dist.find_unused_parameters=false: every parameter got a gradient in every measured step, and "
        f"looking for unused ones costs {b['find_unused_s']:.3g} s per step (a graph walk and an all-reduce)",
        b["step_s"] - b["find_unused_s"],
    )


def _cpu_oversubscribed(b, ranks, facts, link, model) -> dict | None:
    probe = facts.compute_probe
    if not probe or probe["threads_fit"] >= facts.threads or probe["fit_s"] >= probe["now_s"]:
        return None
    # Threads that take turns slow every phase, not only forward and backward (OpenMP's threads
    # spin while they wait, on the cores the transport and the optimizer need): all but the wait for
    # data speed up as the probe's compute did.
    busy = b["step_s"] - b["data_s"]
    saved = busy * (1 - probe["fit_s"] / probe["now_s"])
    fit = probe["threads_fit"]
    return _cause(
        "cpu_oversubscribed",
        saved / b["step_s"],
        f"{facts.ranks_per_host} ranks x {facts.threads} threads on {facts.cores} cores: threads take turns; "
        f"dist.threads_per_worker={fit} (forward+backward measured {probe['now_s']:.3g} s -> {probe['fit_s']:.3g} s)",
        b["step_s"] - saved,
    )


def _min_share(cause: str) -> float:
    return {"straggler": STRAGGLER_MIN_SHARE, "find_unused_overhead": FIND_UNUSED_MIN_SHARE}.get(cause, MIN_SHARE)


RULES = (_data_loading, _straggler, _slow_network, _small_buckets, _no_overlap, _find_unused, _cpu_oversubscribed)


def diagnose(breakdown: dict, ranks: list[dict], facts: JobFacts, link: LinkModel) -> list[dict]:
    """Causes costing at least ``MIN_SHARE`` of the step, largest first; else ``[healthy]``."""
    model = step_model(breakdown, facts, link)
    found = [c for rule in RULES if (c := rule(breakdown, ranks, facts, link, model)) is not None]
    found = [c for c in found if c["share"] >= _min_share(c["cause"])]
    names = {c["cause"] for c in found}
    roots = {c["cause"]: any(r in names for r in ROOT_CAUSES_OF.get(c["cause"], ())) for c in found}
    found.sort(key=lambda c: (roots[c["cause"]], -c["share"]))
    if found:
        return found
    b = breakdown
    compute = (b["forward_s"] + b["backward_s"] + b["optimizer_s"]) / b["step_s"]
    return [
        _cause(
            "healthy",
            compute,
            f"compute-bound ({compute:.0%} of the step is forward, backward and optimizer): nothing to fix; "
            "more ranks (dist.world_size) scale as predicted under 'scaling'",
            b["step_s"],
        )
    ]
