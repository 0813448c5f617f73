"""Per-step, per-rank phase timings of a training run, recorded only while ``ddptrain doctor`` is on.

The recorder wraps the trainer's seams on the *instance* (``step_batches``, ``train_step``,
``optimizer_step``) and the DDP module's ``forward``, and asks the reducer to note when each
bucket completed. Nothing is wrapped while the doctor is off, so a normal run pays nothing; the
wrappers are removed when the window is measured.

One step, on one rank, from the moment the loop asks for its batch to the moment it asks for the
next one:

- ``data_s``: waiting for the batch (the iterator's ``next``); ``data_core_wait_s`` is the part of
  it the thread spent ready to run without a core (where a host's ranks outnumber its cores, the
  host's cost, not the loading's);
- ``forward_s``: from the start of ``train_step`` to the end of the model's forward (user code
  before the model call counts here), plus the forwards of further micro-batches;
- ``backward_s``: the rest of ``train_step`` that is not waiting for communication (the loss,
  backward, ``.item()``);
- ``comm_s``: the reducer's wait after backward (``finalize_wait_s``), without the all-reduce of
  ``find_unused_parameters``; split later into the link's time and the wait for the slowest rank;
- ``find_unused_s``: finding unused parameters (graph walk and its all-reduce);
- ``optimizer_s``: ``optimizer_step``;
- ``other_s``: the rest (callbacks, logging, the sampler).
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ..ddp.buckets import FlatRun

PHASES = ("data_s", "forward_s", "backward_s", "comm_s", "find_unused_s", "optimizer_s", "other_s")


@dataclass
class StepRecord:
    """One optimizer step of one rank; times are this rank's ``perf_counter`` seconds."""

    step: int
    start: float
    end: float = 0.0
    data_s: float = 0.0
    forward_s: float = 0.0
    backward_s: float = 0.0
    comm_s: float = 0.0
    find_unused_s: float = 0.0
    find_unused_comm_s: float = 0.0  # the used flags' all-reduce, inside find_unused_s (with its wait)
    optimizer_s: float = 0.0
    other_s: float = 0.0
    cpu_s: float = 0.0
    core_wait_s: float = 0.0  # the training thread was ready to run but had no core (Linux only), after data_s
    data_core_wait_s: float = 0.0  # ... and during data_s
    unused_params: int = 0  # parameters without a gradient on this rank (find_unused_parameters)
    marks: dict[str, float] = field(default_factory=dict)  # phase boundaries, for the timeline
    buckets: list[dict[str, Any]] = field(default_factory=list)  # bytes, launch, done
    # [share of backward elapsed, share of gradient bytes ready], one point per gradient, in order
    ready_curve: list[tuple[float, float]] = field(default_factory=list)

    @property
    def step_s(self) -> float:
        return self.end - self.start

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class CoreWait:
    """Seconds the thread that made it has waited, ready to run, for a core since it started.

    Linux's scheduler statistics (``/proc/thread-self/schedstat``, second field); 0 where they
    are not kept. This tells a rank that the OS kept off the cores (its host runs more threads
    than it has cores) from one that is slow by its own work. The file stays open (``close()``):
    opening it at every step cost 3-4% of a 5 ms step, reading it again costs a microsecond.
    """

    def __init__(self):
        try:
            self._fd: int | None = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            self._fd = None

    def seconds(self) -> float:
        if self._fd is None:
            return 0.0
        try:
            return int(os.pread(self._fd, 256, 0).split()[1]) / 1e9
        except (OSError, ValueError, IndexError):
            return 0.0

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def collective_bytes(plan, whole_buckets: bool) -> list[list[int]]:
    """Bytes of each all-reduce of a bucket ``plan``, per bucket (a comm hook sends whole buckets)."""
    out = []
    for bucket in plan.buckets:
        item = bucket.dtype.itemsize
        if whole_buckets:
            out.append([bucket.nbytes])
            continue
        sizes = []
        for t in bucket.transfers:
            if isinstance(t, FlatRun):
                sizes.append((t.stop - t.start) * item)
            else:
                shape = bucket.shapes[t.position]
                numel = 1
                for d in shape:
                    numel *= d
                sizes.append(numel * item)
        out.append(sizes)
    return out


def ready_curve(ready_times, params, backward_start: float | None, backward_end: float) -> list[tuple[float, float]]:
    """When gradients became ready during backward: ``(share of backward elapsed, share of the
    gradient bytes ready)`` after each one. Backward starts at the end of forward (else at the
    first gradient) and ends when the reducer's last hook ran."""
    if not ready_times:
        return []
    start = backward_start if backward_start is not None else ready_times[0][1]
    length = max(backward_end - start, 1e-9)
    sizes = [params[i].numel() * params[i].element_size() for i, _ in ready_times]
    total, done, out = sum(sizes) or 1, 0, []
    for (_, t), n in zip(ready_times, sizes):
        done += n
        out.append((min(max((t - start) / length, 0.0), 1.0), done / total))
    return out


class StepRecorder:
    """Wraps a trainer's seams to time steps ``first < step <= first + count`` (1-based steps)."""

    def __init__(self, trainer, first: int, count: int):
        self.trainer, self.first, self.last = trainer, first, first + count
        self.records: list[StepRecord] = []
        self._open: StepRecord | None = None
        self._cpu0 = 0.0
        self._core_wait0 = 0.0
        self._core_wait: CoreWait | None = None  # opened by the training thread, at the window's start
        self._saved: dict[str, Any] = {}
        self.last_batch: Any = None  # a micro-batch of the window (the compute probe reruns it)

    # -- wrapping ------------------------------------------------------------------------------
    def attach(self) -> None:
        """Install the timing wrappers on the trainer instance and its DDP module."""
        t, model = self.trainer, self.trainer.model
        self._saved = {"step_batches": t.step_batches, "train_step": t.train_step, "optimizer_step": t.optimizer_step}
        self._forward = model.forward
        t.step_batches = self._wrap_batches(t.step_batches)
        t.train_step = self._wrap_train_step(t.train_step)
        t.optimizer_step = self._wrap_optimizer(t.optimizer_step)
        model.forward = self._wrap_forward(model.forward)
        model.reducer.track_completion = True

    def detach(self) -> None:
        """Put the trainer back as it was (the wrappers vanish: no cost after the window)."""
        for name in self._saved:
            self.trainer.__dict__.pop(name, None)
        self.trainer.model.__dict__.pop("forward", None)
        self.trainer.model.reducer.track_completion = False
        self._saved = {}
        if self._core_wait is not None:
            self._core_wait.close()
            self._core_wait = None

    @property
    def recording(self) -> bool:
        return self._open is not None

    def _wrap_batches(self, step_batches):
        def timed():
            return self._timed(step_batches())

        return timed

    def _timed(self, batches):
        it = iter(batches)
        while True:
            started = time.perf_counter()
            self._close(started)
            step = self.trainer.state.step + 1  # the step this batch is for
            measured = self.first < step <= self.last
            if measured:
                self._core_wait = self._core_wait or CoreWait()
                data_wait0 = self._core_wait.seconds()
            try:
                item = next(it)
            except StopIteration:
                return
            if measured:
                self._cpu0 = time.process_time()
                self._core_wait0 = self._core_wait.seconds()
                self._open = StepRecord(
                    step,
                    started,
                    data_s=time.perf_counter() - started,
                    data_core_wait_s=self._core_wait0 - data_wait0,
                )
                self._open.marks["data_end"] = time.perf_counter()
            yield item

    def _wrap_train_step(self, train_step):
        def timed(micro_batches):
            rec = self._open
            if rec is None:
                return train_step(micro_batches)
            self.last_batch = micro_batches[-1]
            rec.marks["train_start"] = started = time.perf_counter()
            loss = train_step(micro_batches)
            rec.marks["train_end"] = ended = time.perf_counter()
            self._take_reducer_stats(rec, started, ended)
            return loss

        return timed

    def _wrap_forward(self, forward):
        def timed(*args, **kwargs):
            rec = self._open
            if rec is None:
                return forward(*args, **kwargs)
            started = time.perf_counter()
            if "forward_start" not in rec.marks:
                rec.marks["forward_start"] = started
                rec.forward_s += started - rec.marks.get("train_start", started)
            out = forward(*args, **kwargs)
            rec.marks["forward_end"] = ended = time.perf_counter()
            rec.forward_s += ended - started
            return out

        return timed

    def _wrap_optimizer(self, optimizer_step):
        def timed():
            rec = self._open
            started = time.perf_counter()
            optimizer_step()
            if rec is not None:
                rec.marks["optimizer_start"], rec.marks["optimizer_end"] = started, time.perf_counter()
                rec.optimizer_s = rec.marks["optimizer_end"] - started

        return timed

    def _take_reducer_stats(self, rec: StepRecord, started: float, ended: float) -> None:
        stats = self.trainer.model.last_iteration_stats
        fresh = stats is not None and stats.backward_end >= started
        if fresh:
            rec.find_unused_s = stats.find_unused_s
            rec.find_unused_comm_s = stats.find_unused_comm_s
            rec.unused_params = stats.unused_on_rank
            rec.comm_s = max(0.0, stats.finalize_wait_s - stats.find_unused_comm_s)
            rec.marks["backward_end"] = stats.backward_end
            reducer = self.trainer.model.reducer
            sizes = collective_bytes(reducer.plan, reducer.comm_hook is not None)
            done = stats.done_times or [None] * len(sizes)
            rec.buckets = [
                {"bytes": sum(s), "collectives": len(s), "launch": launch, "done": d}
                for s, launch, d in zip(sizes, stats.launch_times, done)
            ]
            rec.ready_curve = ready_curve(
                stats.ready_times, reducer.params, rec.marks.get("forward_end"), stats.backward_end
            )
        walk = rec.find_unused_s - (stats.find_unused_comm_s if fresh else 0.0)
        rec.forward_s = max(0.0, rec.forward_s - walk)
        rec.backward_s = max(0.0, (ended - started) - rec.forward_s - rec.comm_s - rec.find_unused_s)

    def _close(self, now: float) -> None:
        """End the open step at ``now`` (the next batch request, or the end of the window)."""
        rec = self._open
        if rec is None:
            return
        rec.end = now
        rec.cpu_s = time.process_time() - self._cpu0
        rec.core_wait_s = (self._core_wait.seconds() if self._core_wait else self._core_wait0) - self._core_wait0
        busy = sum(getattr(rec, p) for p in PHASES if p != "other_s")
        rec.other_s = max(0.0, rec.step_s - busy)
        self.records.append(rec)
        self._open = None

    def finish(self) -> list[StepRecord]:
        """Close the last step (called after it, from ``on_train_batch_end``) and detach."""
        self._close(time.perf_counter())
        self.detach()
        return self.records
