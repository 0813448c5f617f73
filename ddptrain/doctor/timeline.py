"""Every rank's phases and buckets on one time axis, as Chrome-trace JSON (Perfetto, chrome://tracing).

One process per rank (``pid`` = rank); thread 0 holds the step's phases, thread 1 the buckets
(from launch to completion; a bucket done before backward ended shows as ending there, an upper
bound). Times are microseconds from the barrier every rank left together at fit start, so ranks
line up to within one small all-reduce's latency.
"""

from __future__ import annotations

_PHASES = (  # name, start mark, end mark (StepRecord.marks)
    ("data", "start", "data_end"),
    ("forward", "train_start", "forward_end"),
    ("backward", "forward_end", "backward_end"),
    ("comm wait", "backward_end", "train_end"),
    ("optimizer", "optimizer_start", "optimizer_end"),
    ("parameter all-gather", "all_gather_start", "all_gather_end"),  # ZeRO: inside the optimizer's span
)


def _event(name: str, rank: int, tid: int, start: float, end: float, origin: float, **args) -> dict:
    return {
        "name": name,
        "ph": "X",
        "pid": rank,
        "tid": tid,
        "ts": (start - origin) * 1e6,
        "dur": max(end - start, 0.0) * 1e6,
        "args": args,
    }


def chrome_trace(per_rank_records: list[list[dict]], origins: list[float]) -> dict:
    """The trace of the measured steps: ``{"traceEvents": [...], "displayTimeUnit": "ms"}``."""
    events: list[dict] = []
    for rank, (records, origin) in enumerate(zip(per_rank_records, origins)):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
        events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": "phases"}})
        events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": 1, "args": {"name": "buckets"}})
        for rec in records:
            marks = {**rec["marks"], "start": rec["start"]}
            events.append(_event(f"step {rec['step']}", rank, 2, rec["start"], rec["end"], origin))
            for name, a, b in _PHASES:
                if a in marks and b in marks:
                    events.append(_event(name, rank, 0, marks[a], marks[b], origin, step=rec["step"]))
            for i, bucket in enumerate(rec["buckets"]):
                if bucket["launch"] is not None and bucket["done"] is not None:
                    events.append(
                        _event(f"bucket {i}", rank, 1, bucket["launch"], bucket["done"], origin, bytes=bucket["bytes"])
                    )
    return {"traceEvents": events, "displayTimeUnit": "ms"}
