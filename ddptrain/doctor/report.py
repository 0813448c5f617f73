"""``doctor.json`` in the documented shape, and the short report printed to the console.

Shape (tools read it; keys beyond these may be added, none removed)::

    {"world_size", "step_s", "breakdown": {...}, "per_rank": [...],
     "link": {"latency_s", "busbw_GBps", ...},
     "causes": [{"cause", "rank"?, "share", "advice", "predicted_step_s",
                 "sync_options"? (slow_network: [{"sync", "sync_every", "predicted_step_s", "speedup",
                                  "bytes_per_sample"}])}],
     "scaling": [{"world_size", "predicted_step_s", "efficiency", "global_batch_size"}],
     "scaling_mode": {"kind": "weak", "samples_per_rank", "meaning"},
     "job": {"ranks_per_host", "threads", "cores", ..., "compute_probe": {"now_s", ...} or null},
     "balance"? (trainer.balance.shares set; written at the end of fit):
         {"shares", "changes": [{"step", "kind", "shares", "predicted_gain", "measured_gain"}],
          "measured_step_s"}}

The scaling prediction is weak scaling: every rank keeps this run's samples per step, so the global
batch grows with the world size (``global_batch_size`` of each row).
"""

from __future__ import annotations

from pathlib import Path

from .diagnose import BREAKDOWN, JobFacts


def doctor_json(
    facts: JobFacts, breakdown: dict, ranks: list[dict], link: dict, causes: list, scaling: list, samples_per_rank: int
) -> dict:
    """The report as a JSON-ready dict; ``samples_per_rank``: each rank's samples per optimizer step."""
    return {
        "world_size": facts.world_size,
        "step_s": breakdown["step_s"],
        # data_core_wait_s: the part of data_s without a core (where ranks outnumber cores, not the loading's cost)
        "breakdown": {k: breakdown[k] for k in (*BREAKDOWN, "data_core_wait_s", "steps")},
        "per_rank": ranks,
        "link": link,
        "causes": causes,
        "scaling": [{**s, "global_batch_size": s["world_size"] * samples_per_rank} for s in scaling],
        "scaling_mode": {
            "kind": "weak",
            "samples_per_rank": samples_per_rank,
            "meaning": "each rank keeps its samples per step: the global batch grows with the world size",
        },
        "job": {
            "ranks_per_host": facts.ranks_per_host,
            "threads": facts.threads,
            "cores": facts.cores,
            "bucket_cap_mb": facts.bucket_cap_mb,
            "buckets": len(facts.bucket_sizes),
            "allreduces_per_step": sum(len(b) for b in facts.bucket_sizes),
            "gradient_bytes": sum(sum(b) for b in facts.bucket_sizes),
            "compute_probe": facts.compute_probe,
        },
    }


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def format_report(report: dict, written: list[tuple[Path, str]] = ()) -> str:
    """A few lines: the breakdown (median and per rank, ms), the causes, the scaling, and each
    ``(path, what it holds)`` of ``written``."""
    b, phases = report["breakdown"], [k for k in BREAKDOWN]
    names = [p.removesuffix("_s") for p in phases]
    lines = [
        f"ddptrain doctor: {report['world_size']} rank(s), step {_ms(report['step_s'])} ms "
        f"(median of {b['steps']} steps); link {report['link']['latency_s'] * 1e6:.0f} us latency, "
        f"{report['link']['busbw_GBps']:.3g} GB/s busbw",
        "  ms      " + " ".join(f"{n:>12}" for n in ["step", *names]),
        "  median  " + " ".join(f"{_ms(v):>12}" for v in [report["step_s"], *(b[p] for p in phases)]),
    ]
    for r in report["per_rank"]:
        values = [r["step_s"], *(r[p] for p in phases)]
        lines.append(f"  rank {r['rank']:<3}" + " ".join(f"{_ms(v):>12}" for v in values))
    lines.append("causes (largest first):")
    for c in report["causes"]:
        who = f" (rank {c['rank']})" if "rank" in c else ""
        lines.append(
            f"  {c['cause']}{who}: {c['share']:.0%} of the step -> {c['advice']} "
            f"[predicted step {_ms(c['predicted_step_s'])} ms]"
        )
        for o in c.get("sync_options", ()):
            how = "dist.sync=every_step (now)" if o["sync"] == "every_step" else f"dist.sync_every={o['sync_every']}"
            per_sample = "" if o["bytes_per_sample"] is None else f", {o['bytes_per_sample']:.4g} B/sample"
            lines.append(f"    {how}: {_ms(o['predicted_step_s'])} ms/step ({o['speedup']:.2f}x){per_sample}")
    scaling = ", ".join(
        f"{s['world_size']}: {_ms(s['predicted_step_s'])} ms ({s['efficiency']:.0%})" for s in report["scaling"]
    )
    mode = report["scaling_mode"]
    lines.append(
        f"scaling ({mode['kind']}: {mode['samples_per_rank']} samples per rank, global batch grows with the world "
        f"size; world size: predicted step, efficiency): {scaling}"
    )
    for i, (path, what) in enumerate(written):
        lines.append(f"{'written:' if i == 0 else '':<8} {path}{'/' if path.is_dir() else ''} ({what})")
    return "\n".join(lines)


def balance_outcome(balance: dict) -> dict:
    """The doctor's ``balance`` entry from ``metrics.json``'s (``trainer.balance``): the shares at
    the end, each change with its predicted and measured gain (a step's time in the window before
    it over the window after; ``None`` when no window ended after it), and the median step time of
    the last window measured."""
    changes = balance["changes"]
    return {
        "shares": balance["shares"],
        "changes": [
            {
                "step": c["step"],
                "kind": c["kind"],
                "shares": c["shares"],
                "predicted_gain": c["predicted_gain"],
                "measured_gain": c["measured_gain"],
            }
            for c in changes
        ],
        "measured_step_s": balance.get("measured_step_s"),
    }


def format_balance(outcome: dict) -> str:
    """One line: the shares ``trainer.balance`` chose and what they gained."""
    shares = ", ".join(f"{w:.3f}" for w in outcome["shares"])
    if outcome["measured_step_s"] is None:
        return f"balance: the fixed shares {shares} (trainer.balance.shares=auto would measure and choose)"
    if not outcome["changes"]:
        return f"balance kept the shares {shares}: no change was predicted to gain enough (trainer.balance.min_gain)"
    gains = "; ".join(_describe(c) for c in outcome["changes"])
    return f"balance chose the shares {shares} in {len(outcome['changes'])} change(s) ({gains})"


def _describe(change: dict) -> str:
    """One change of :func:`format_balance`'s line."""
    if change["kind"] == "taken back":
        return f"step {change['step']}: taken back"
    measured = "(no window after it)" if change["measured_gain"] is None else f"{change['measured_gain']:.2f}x"
    return f"step {change['step']}: predicted {change['predicted_gain']:.2f}x, measured {measured}"
