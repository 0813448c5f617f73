"""The doctor inside a run: a callback that measures a window of steps and writes the diagnosis.

``trainer.doctor=true`` adds :class:`DoctorCallback` to the trainer's callbacks. At the start of
fit it listens to the trainer's step phases (:class:`~.measure.StepRecorder`); after ``doctor.warmup_steps
+ doctor.steps`` steps it stops listening, gathers every rank's records, sweeps the link, and rank 0
writes ``doctor.json``, ``doctor_trace.json`` and the TensorBoard scalars, and prints the
report. Training then goes on unmeasured (``python -m ddptrain.doctor`` stops there).

Collectives (every rank reaches them at the same step): one all-reduce at fit start (a common
time origin for the timeline), and at the end of the window two all-gathers, the link sweep and a
few forward/backward passes under ``no_sync`` (the probe: compute without communication, also
with fewer threads when threads outnumber cores; they consume random numbers, so a doctored run
is not bitwise the same as an undoctored one).

With ``trainer.balance.shares`` set, the report gets a ``balance`` entry at the end of fit: what
the shares became and what each change gained, measured (:func:`.report.balance_outcome`).

In an elastic job (``trainer.elastic``) the window measures one group of ranks. A membership
change before the report is written starts the window again on the new group, from the step
the members agreed on; a change after it leaves the report as it is. Rank 0 (always a member
that was there before the change) tells the members which, so a newcomer follows along.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from typing import NamedTuple

import torch

from ..comm.objects import all_gather_object, broadcast_object
from ..comm.types import ReduceOp
from ..ddp.buckets import MB
from ..ddp.timing import finish_queued_work
from ..trainer.callbacks.base import Callback
from .autotune import BucketAutotune
from .diagnose import JobFacts, diagnose, step_model, summarize
from .link import LinkModel, link_summary, sweep
from .measure import StepRecorder, collective_bytes
from .report import balance_outcome, doctor_json, format_balance, format_report
from .timeline import chrome_trace

log = logging.getLogger("ddptrain.doctor")
TRACE_NOTE = "every rank's phases on one time axis: open it in https://ui.perfetto.dev or chrome://tracing"


class DoctorCallback(Callback):
    """Measure steps ``warmup_steps < n <= warmup_steps + steps`` of this fit and diagnose them."""

    implements = ("trainer.doctor",)

    def __init__(self, doctor_config):
        self.config = doctor_config
        self.recorder: StepRecorder | None = None
        self.origin = 0.0
        self.report: dict | None = None
        self.records: list[dict] = []  # this rank's measured steps (StepRecord.to_dict)
        self.window_started = False  # by on_fit_start, or (a newcomer to an elastic job) by a change
        self.finished = False  # the window's collectives are done (the report written, or nothing measured)

    def on_fit_start(self, trainer) -> None:
        if not self.window_started:
            self._start_window(trainer)

    def _start_window(self, trainer) -> None:
        """Measure from ``doctor.warmup_steps`` steps after the current one (collective: the time origin)."""
        pg = trainer.process_group
        pg.all_reduce(torch.zeros(1, device=pg.device), ReduceOp.SUM).wait()  # a common time origin
        self.origin = time.perf_counter()
        self.window_started = True
        first = trainer.state.step + self.config.warmup_steps
        self.recorder = StepRecorder(trainer, first, self.config.steps)
        self.recorder.attach()
        window = doctor_window(trainer)  # a fit that is only the window (python -m ddptrain.doctor): say so
        if window is not None and trainer.is_main:
            log.info("%s on %d rank(s)", window, trainer.world_size)

    def on_membership_change(self, trainer, change) -> None:
        """An elastic job's new group: unless the report is done, measure again on it (collective)."""
        if self.recorder is not None:
            self.recorder.detach()  # it listens to the old group's DDP wrapper
            self.recorder = None
        self.finished = broadcast_object(trainer.process_group, self.finished)  # rank 0 was a member before
        self.window_started = True  # a newcomer's on_fit_start, after this, must not start one alone
        if not self.finished:
            if trainer.is_main:
                log.info(
                    "doctor: the membership changed before its report; measuring again on the %d rank(s) present",
                    trainer.world_size,
                )
            self._start_window(trainer)

    def on_train_batch_end(self, trainer, loss: float) -> None:
        if self.recorder is not None and trainer.state.step >= self.recorder.last:
            self._complete(trainer)

    def on_fit_end(self, trainer, metrics) -> None:
        if self.recorder is not None:  # the run ended inside the window: diagnose what was measured
            self._complete(trainer)
        if self.report is not None and "balance" in metrics:  # rank 0, its report written
            self.report["balance"] = balance_outcome(metrics["balance"])
            trainer.run_dir.doctor_report.write_text(json.dumps(self.report, indent=2) + "\n")
            log.info("doctor: %s", format_balance(self.report["balance"]))

    def on_exception(self, trainer, exc: BaseException) -> None:
        if self.recorder is not None:
            self.recorder.detach()
            self.recorder = None

    def _complete(self, trainer) -> None:
        recorder, self.recorder = self.recorder, None
        records = self.records = [r.to_dict() for r in recorder.finish()]
        pg = trainer.process_group
        mine = {
            "records": records,
            "host": socket.gethostname(),
            "threads": torch.get_num_threads(),
            "origin": self.origin,
        }
        everyone = all_gather_object(pg, mine)
        if not all(e["records"] for e in everyone):
            self.finished = True
            if trainer.is_main:
                log.warning("doctor: no step was measured (the run ended within doctor.warmup_steps)")
            return
        link_rows = sweep(pg)
        facts = self._facts(trainer, everyone, records)
        facts.compute_probe = _probe(trainer, trainer.strategy.one_micro_batch(recorder.last_step), facts)
        self.finished = True  # every collective of the window is done
        if trainer.is_main:
            self.report = self._write(trainer, everyone, facts, link_rows)

    def _facts(self, trainer, everyone: list[dict], records: list[dict]) -> JobFacts:
        hosts = [e["host"] for e in everyone]
        reducer, dist = trainer.model.reducer, trainer.config.dist
        hooked = reducer.comm_hook is not None

        def buckets_at(cap_mb: float) -> tuple[tuple[int, ...], ...]:
            return tuple(tuple(s) for s in collective_bytes(reducer.plan_at(int(cap_mb * MB)), hooked))

        return JobFacts(
            world_size=trainer.world_size,
            ranks_per_host=max(hosts.count(h) for h in hosts),
            threads=max(e["threads"] for e in everyone),
            cores=len(os.sched_getaffinity(0)),
            num_workers=trainer.config.data.num_workers,
            bucket_cap_mb=reducer.bucket_cap_bytes / MB,
            find_unused=dist.find_unused_parameters,
            bucket_sizes=tuple(tuple(s) for s in collective_bytes(reducer.plan, hooked)),
            buckets_at=buckets_at,
            samples_per_step=trainer.config.data.global_batch_size,
        )

    def _write(self, trainer, everyone: list[dict], facts: JobFacts, link_rows: list[dict]) -> dict:
        per_rank_records = [e["records"] for e in everyone]
        breakdown, ranks = summarize(per_rank_records, facts.shares_cores)
        link = LinkModel.fit(link_rows, facts.world_size)
        causes = diagnose(breakdown, ranks, facts, link)
        model = step_model(breakdown, facts, link)
        target = model.link.with_gbps(self.config.link_gbps) if self.config.link_gbps else None
        scaling = model.scaling(self.config.world_sizes, target, self.config.hosts)
        samples_per_rank = trainer.config.data.global_batch_size // facts.world_size
        report = doctor_json(facts, breakdown, ranks, link_summary(link_rows, link), causes, scaling, samples_per_rank)
        run_dir = trainer.run_dir
        run_dir.doctor_report.write_text(json.dumps(report, indent=2) + "\n")
        trace = chrome_trace(per_rank_records, [e["origin"] for e in everyone])
        run_dir.doctor_trace.write_text(json.dumps(trace) + "\n")
        tensorboard = _tensorboard(trainer, breakdown)
        written = [(run_dir.doctor_report, "this report"), (run_dir.doctor_trace, TRACE_NOTE)]
        if tensorboard is not None:
            written.append((tensorboard, "TensorBoard scalars doctor/*"))
        # named only once on disk: the report must not point at a file that is not there
        text = format_report(report, [(path, note) for path, note in written if path.exists()])
        log.info("doctor report:\n%s", text)
        return report


def _probe(trainer, batch, facts: JobFacts, repeats: int = 5) -> dict:
    """Forward+backward seconds without communication (``no_sync``) with this run's threads and,
    when threads outnumber the cores, with threads that fit them; every rank computing at once
    (as in training), the slowest rank's median (collective). Set against the window's forward
    and backward, it shows how much communication slowed them (CPU ranks: the same cores).

    ``warm_s``: each rank's median of passes run back to back (no wait for the others between
    them). A rank that waits long for a straggler every step computes slower after each wait than
    it does once nobody waits (measured: all its phases ~30% slower after 0.4 s idle)."""
    fit = max(1, facts.cores // max(facts.ranks_per_host, 1))
    if not facts.shares_cores or facts.threads <= 1:
        fit = facts.threads  # nothing to try
    pg = trainer.process_group
    counts = (facts.threads, fit) if fit != facts.threads else (facts.threads,)
    times = torch.tensor([_time_compute(trainer, batch, t, repeats) for t in counts], dtype=torch.float64)
    times = times.to(pg.device)
    pg.all_reduce(times, ReduceOp.MAX).wait()
    fit_s = float(times[-1])
    warm = torch.zeros(facts.world_size, dtype=torch.float64)
    warm[pg.rank()] = _time_compute(trainer, batch, facts.threads, repeats, each_together=False)
    warm = warm.to(pg.device)
    pg.all_reduce(warm, ReduceOp.SUM).wait()
    return {
        "threads_now": facts.threads,
        "now_s": float(times[0]),
        "threads_fit": fit,
        "fit_s": fit_s,
        "warm_s": warm.cpu().tolist(),
    }


def _time_compute(trainer, batch, threads: int, repeats: int, each_together: bool = True) -> float:
    """The median of ``repeats`` passes after a first one; ``each_together``: every rank starts
    each pass together (else only the first)."""
    from ..trainer.data import move_to

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    model, pg, times = trainer.model, trainer.process_group, []
    try:
        for i in range(repeats + 1):
            if each_together or i == 0:
                pg.all_reduce(torch.zeros(1, device=pg.device), ReduceOp.SUM).wait()  # all ranks compute together
            finish_queued_work(trainer.device)
            started = time.perf_counter()
            with model.no_sync():
                with trainer.precision.autocast():  # trainer.precision: forward as training computes it
                    loss = trainer.training_step(model, move_to(batch, trainer.device))
                loss.backward()
            finish_queued_work(trainer.device)  # on a GPU: the pass's kernels, not their queueing
            times.append(time.perf_counter() - started)
    finally:
        torch.set_num_threads(previous)
        trainer.optimizer.zero_grad(set_to_none=True)
    return sorted(times[1:])[len(times[1:]) // 2]


def _tensorboard(trainer, breakdown: dict):
    """The breakdown as TensorBoard scalars ``doctor/<phase>`` (when the run writes TensorBoard);
    the directory written to, or ``None``."""
    if not trainer.config.trainer.loggers.tensorboard:
        return None
    from torch.utils.tensorboard import SummaryWriter

    directory = trainer.run_dir.tensorboard
    with SummaryWriter(str(directory)) as writer:
        for key, value in breakdown.items():
            if isinstance(value, float):
                writer.add_scalar(f"doctor/{key}", value, trainer.state.step)
    return directory


class DoctorWindow(NamedTuple):
    """A fit that is the doctor's window and nothing more: its steps and the step it ends at."""

    warmup: int
    measured: int
    last_step: int

    def __str__(self) -> str:
        return f"doctor window: {self.warmup + self.measured} steps ({self.warmup} warm-up + {self.measured} measured)"


def doctor_window(trainer) -> DoctorWindow | None:
    """The window when this fit ends within it (``trainer.doctor`` on and the fit's end, by
    ``trainer.max_steps``, ``trainer.stop_after_steps`` or the epochs, at most ``doctor.warmup_steps
    + doctor.steps`` steps ahead, as under ``python -m ddptrain.doctor``), else ``None``; the
    doctor then names the window when the fit starts."""
    cfg = trainer.config
    if not cfg.trainer.doctor:
        return None
    limits = [n for n in (cfg.trainer.max_steps, cfg.trainer.stop_after_steps) if n is not None]
    last = min([trainer.steps_per_epoch * cfg.trainer.epochs, *limits])
    steps = last - trainer.state.step
    if steps > cfg.doctor.warmup_steps + cfg.doctor.steps:
        return None
    warmup = max(0, min(cfg.doctor.warmup_steps, steps))
    return DoctorWindow(warmup, max(0, steps - warmup), last)


def doctor_callbacks(config) -> list[Callback]:
    """The bucket autotune for ``dist.bucket_cap_mb=auto`` (first: the doctor then measures the
    chosen layout) and ``DoctorCallback`` when ``trainer.doctor`` is on."""
    callbacks: list[Callback] = [BucketAutotune()] if config.dist.bucket_cap_mb == "auto" else []
    return callbacks + ([DoctorCallback(config.doctor)] if config.trainer.doctor else [])
