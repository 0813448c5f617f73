"""Per-step, per-rank phase timings of a training run, recorded only while ``ddptrain doctor`` is on.

The recorder listens to the phases the trainer's loop announces (``trainer.phases``: ``data``,
``data_end``, ``forward_backward``, ``optimizer_step`` and their ends), times the DDP module's forward
with torch's module hooks, and asks the reducer to note when each bucket completed
(``reducer.track_completion``). It replaces no method: while the doctor is off nothing listens,
so a normal run pays one check per phase; the listener and the hooks are removed when the window
is measured.

One step, on one rank, from the moment the loop asks for its batch to the moment it asks for the
next one:

- ``data_s``: waiting for the batch (the iterator's ``next``); ``data_core_wait_s`` is the part of
  it the thread spent ready to run without a core (where a host's ranks outnumber its cores, the
  host's cost, not the loading's);
- ``forward_s``: from the start of ``forward_backward`` to the end of the model's forward (user code
  before the model call counts here), plus the forwards of further micro-batches (the hooks see
  calls of the DDP module, ``model(x)``);
- ``backward_s``: the rest of ``forward_backward`` that is not waiting for communication (the loss,
  backward, ``.item()``);
- ``comm_s``: the reducer's wait after backward (``finalize_wait_s``), without the all-reduce of
  ``find_unused_parameters``; under ZeRO also the parameters' all-gather after the shards' step
  (``param_all_gather``: as exposed as the wait after backward); split later into the link's time
  and the wait for the slowest rank;
- ``find_unused_s``: finding unused parameters (graph walk and its all-reduce);
- ``optimizer_s``: ``optimizer_step``, without ZeRO's all-gather;
- ``other_s``: the rest (callbacks, logging, the sampler).

On a GPU the moments inside a step (forward, backward, each bucket's launch and completion, the
optimizer) are CUDA events on the current stream (:class:`~ddptrain.ddp.timing.DeviceClock`): the
GPU's timeline, not the moments the host queued the work. They are resolved to ``perf_counter``
seconds when the step closes (one device synchronisation per measured step, in the window only);
the wait for the batch stays a host time, which it is.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ..ddp.buckets import FlatRun
from ..ddp.timing import DeviceClock

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
    """Listens to a trainer's step phases to time steps ``first < step <= first + count`` (1-based steps).

    The loop announces each phase (``trainer.phases``, :class:`~ddptrain.trainer.profiling.StepPhases`)
    and the DDP module's forward is timed by torch's module hooks: the trainer and the model keep
    their own methods. A step's record opens when its micro-batches arrive (``data_end``) and closes
    at the next ``data`` mark (the loop asks for the next step's, or finds the epoch over) or at
    :meth:`finish`.
    """

    def __init__(self, trainer, first: int, count: int):
        self.trainer, self.first, self.last = trainer, first, first + count
        self.records: list[StepRecord] = []
        self._open: StepRecord | None = None
        self._cpu0 = 0.0
        self._core_wait0 = 0.0
        self._core_wait: CoreWait | None = None  # opened by the training thread, at the window's start
        self._asked: tuple[int, float, float] | None = None  # (step, asked at, core wait then): a measured batch
        self._forward_started: Any = 0.0
        self._forwards: list[tuple[Any, Any]] = []  # the open step's forwards, (start, end), resolved at its close
        self._stats: Any = None  # the reducer's stats of the open step's backward (at forward_backward_end)
        self._clock = DeviceClock(trainer.device)
        self._hooks: list[Any] = []  # the forward hooks' handles while attached
        self._listening = False
        self.last_step: Any = None  # a step of the window (the compute probe reruns one of its micro-batches)

    # -- listening -----------------------------------------------------------------------------
    def attach(self) -> None:
        """Listen to the trainer's phases and its DDP module's forward; ask the reducer for bucket completions."""
        model = self.trainer.model
        self.trainer.phases.add_listener(self._on_phase)
        self._listening = True
        self._hooks = [
            model.register_forward_pre_hook(self._before_forward),
            model.register_forward_hook(self._after_forward),
        ]
        model.reducer.track_completion = True
        model.reducer.clock = self._clock.now

    def detach(self) -> None:
        """Stop listening (no cost after the window); safe to call twice."""
        if self._listening:
            self.trainer.phases.remove_listener(self._on_phase)
            self._listening = False
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self.trainer.model.reducer.track_completion = False
        self.trainer.model.reducer.clock = time.perf_counter
        if self._core_wait is not None:
            self._core_wait.close()
            self._core_wait = None

    @property
    def recording(self) -> bool:
        return self._open is not None

    def _on_phase(self, phase: str, now: float, payload: Any) -> None:
        handler = self._handlers.get(phase)
        if handler is not None:
            if self._clock.cuda and phase not in ("data", "data_end"):  # the GPU's moment (module doc)
                now = self._clock.now()
            handler(self, now, payload)

    def _on_data(self, now: float, _payload) -> None:
        self._close(now)  # asking for the next step's batch ends the previous step
        step = self.trainer.state.step + 1  # the step this batch is for
        self._asked = None
        if self.first < step <= self.last:
            self._core_wait = self._core_wait or CoreWait()
            self._asked = (step, now, self._core_wait.seconds())

    def _on_data_end(self, now: float, micro_batches) -> None:
        if self._asked is None:
            return
        step, asked, data_wait0 = self._asked
        self._asked = None
        self._cpu0 = time.process_time()
        self._core_wait0 = self._core_wait.seconds()
        self._open = StepRecord(step, asked, data_s=now - asked, data_core_wait_s=self._core_wait0 - data_wait0)
        self._open.marks["data_end"] = now
        self.last_step = micro_batches

    def _on_forward_backward(self, now: float, _payload) -> None:
        if self._open is not None:
            self._open.marks["train_start"] = now

    def _on_forward_backward_end(self, now: float, _payload) -> None:
        rec = self._open
        if rec is not None and "train_start" in rec.marks:
            rec.marks["train_end"] = now
            self._stats = self.trainer.model.last_iteration_stats  # read when the step closes

    def _on_optimizer_step(self, now: float, _payload) -> None:
        if self._open is not None:
            self._open.marks["optimizer_start"] = now

    def _on_optimizer_step_end(self, now: float, _payload) -> None:
        rec = self._open
        if rec is not None and "optimizer_start" in rec.marks:
            rec.marks["optimizer_end"] = now

    def _on_param_all_gather(self, now: float, _payload) -> None:
        if self._open is not None:
            self._open.marks["all_gather_start"] = now

    def _on_param_all_gather_end(self, now: float, _payload) -> None:
        if self._open is not None and "all_gather_start" in self._open.marks:
            self._open.marks["all_gather_end"] = now

    _handlers = {
        "data": _on_data,
        "data_end": _on_data_end,
        "forward_backward": _on_forward_backward,
        "forward_backward_end": _on_forward_backward_end,
        "optimizer_step": _on_optimizer_step,
        "optimizer_step_end": _on_optimizer_step_end,
        "param_all_gather": _on_param_all_gather,
        "param_all_gather_end": _on_param_all_gather_end,
    }

    def _before_forward(self, _module, _args) -> None:
        rec = self._open
        if rec is None:
            return
        self._forward_started = started = self._clock.now()
        if "forward_start" not in rec.marks:  # user code before the model call counts as forward
            rec.marks["forward_start"] = started

    def _after_forward(self, _module, _args, _output) -> None:
        rec = self._open
        if rec is None:
            return
        rec.marks["forward_end"] = ended = self._clock.now()
        self._forwards.append((self._forward_started, ended))

    def _settle(self, rec: StepRecord) -> None:
        """Resolve the step's moments (module doc) and work out its phases from them."""
        resolve = self._clock.resolver()
        rec.marks = {name: resolve(moment) for name, moment in rec.marks.items()}
        forwards, self._forwards = [(resolve(a), resolve(b)) for a, b in self._forwards], []
        marks = rec.marks
        if "forward_start" in marks:  # user code before the model call counts as forward
            rec.forward_s = marks["forward_start"] - marks.get("train_start", marks["forward_start"])
        for start, end in forwards:
            rec.forward_s += end - start
        stats, self._stats = self._stats, None
        if "train_end" in marks:  # first: backward_s is what is left of forward_backward after comm_s
            self._take_reducer_stats(rec, stats, resolve, marks["train_start"], marks["train_end"])
        if "optimizer_end" in marks:
            end = marks["optimizer_end"]
            gathered = marks.get("all_gather_end", end) - marks.get("all_gather_start", end)
            rec.optimizer_s = end - marks["optimizer_start"] - gathered
            rec.comm_s += gathered

    def _take_reducer_stats(self, rec: StepRecord, stats, resolve, started: float, ended: float) -> None:
        backward_end = resolve(stats.backward_end) if stats is not None else None
        fresh = backward_end is not None and backward_end >= started
        if fresh:
            rec.find_unused_s = stats.find_unused_s
            rec.find_unused_comm_s = stats.find_unused_comm_s
            rec.unused_params = stats.unused_on_rank
            finalize_wait_s = resolve(stats.finalize_end) - backward_end
            rec.comm_s = max(0.0, finalize_wait_s - stats.find_unused_comm_s)
            rec.marks["backward_end"] = backward_end
            reducer = self.trainer.model.reducer
            sizes = collective_bytes(reducer.plan, reducer.comm_hook is not None)
            done = stats.done_times or [None] * len(sizes)
            rec.buckets = [
                {"bytes": sum(s), "collectives": len(s), "launch": resolve(launch), "done": resolve(d)}
                for s, launch, d in zip(sizes, stats.launch_times, done)
            ]
            ready = [(i, resolve(t)) for i, t in stats.ready_times]
            rec.ready_curve = ready_curve(ready, reducer.params, rec.marks.get("forward_end"), backward_end)
        walk = rec.find_unused_s - (stats.find_unused_comm_s if fresh else 0.0)
        rec.forward_s = max(0.0, rec.forward_s - walk)
        rec.backward_s = max(0.0, (ended - started) - rec.forward_s - rec.comm_s - rec.find_unused_s)

    def _close(self, now: float) -> None:
        """End the open step at ``now`` (the next batch request, or the end of the window)."""
        rec = self._open
        if rec is None:
            return
        self._settle(rec)
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
