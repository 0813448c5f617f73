"""A doctored fit on threaded ranks: the window is measured, doctor.json has the documented shape,
the trace holds every rank, and nothing stays wrapped (nor is wrapped at all when off)."""

import json
import multiprocessing
import os
import time

import pytest

from ddptrain.doctor.measure import PHASES
from ddptrain.testing import run_threaded
from tests.doctor_tasks import DoctorTask, doctor_config


def _fit(rank, world_size, out, doctor_on, model):
    config = doctor_config(out, model=model, steps=4, warmup_steps=1)
    config.trainer.doctor = doctor_on
    trainer = DoctorTask(config)
    trainer.fit()
    recorder_left = [c for c in trainer.callbacks if getattr(c, "recorder", None) is not None]
    records = [r for c in trainer.callbacks for r in getattr(c, "records", [])]
    for r in records:  # every step is fully accounted for: the phases add up to it
        assert sum(r[p] for p in PHASES) == pytest.approx(r["end"] - r["start"], abs=1e-9)
        assert all(r[p] >= 0 for p in PHASES) and r["buckets"] and r["buckets"][0]["done"] >= r["buckets"][0]["launch"]
    wrapped = sorted(k for k in ("step_batches", "train_step", "optimizer_step") if k in vars(trainer))
    return {
        "wrapped": wrapped + (["forward"] if "forward" in vars(trainer.model) else []),
        "tracking": trainer.model.reducer.track_completion,
        "recorder_left": len(recorder_left),
        "doctors": sum(type(c).__name__ == "DoctorCallback" for c in trainer.callbacks),
        "records": len(records),
    }


@pytest.mark.timeout(120)
def test_doctored_fit_writes_the_documented_report_and_unwraps(tmp_path):
    model = {"kind": "mlp", "layers": 4, "width": 32}
    results = run_threaded(_fit, 2, tmp_path, True, model, timeout_s=100)
    assert all(r == {"wrapped": [], "tracking": False, "recorder_left": 0, "doctors": 1, "records": 4} for r in results)
    report = json.loads((tmp_path / "doctor.json").read_text())
    assert set(report) >= {"world_size", "step_s", "breakdown", "per_rank", "link", "causes", "scaling"}
    assert report["world_size"] == 2 and report["breakdown"]["steps"] == 4
    assert [r["rank"] for r in report["per_rank"]] == [0, 1]
    assert set(report["link"]) >= {"latency_s", "busbw_GBps"} and report["link"]["busbw_GBps"] > 0
    for cause in report["causes"]:
        assert set(cause) - {"rank"} == {"cause", "share", "advice", "predicted_step_s"}
    assert [s["world_size"] for s in report["scaling"]] == [2, 4, 8, 64]
    assert all(set(s) == {"world_size", "predicted_step_s", "efficiency"} for s in report["scaling"])
    trace = json.loads((tmp_path / "doctor_trace.json").read_text())["traceEvents"]
    assert {e["pid"] for e in trace} == {0, 1}
    names = {e["name"] for e in trace if e["ph"] == "X"}
    assert {"forward", "backward", "optimizer", "bucket 0"} <= names


@pytest.mark.timeout(120)
def test_doctor_off_wraps_nothing_and_writes_nothing(tmp_path):
    results = run_threaded(_fit, 2, tmp_path, False, {"kind": "mlp", "layers": 2, "width": 16}, timeout_s=100)
    assert all(r == {"wrapped": [], "tracking": False, "recorder_left": 0, "doctors": 0, "records": 0} for r in results)
    assert not (tmp_path / "doctor.json").exists()


def test_phases_are_the_documented_ones():
    assert PHASES == ("data_s", "forward_s", "backward_s", "comm_s", "find_unused_s", "optimizer_s", "other_s")


def _spin(stop_at: float) -> None:
    while time.monotonic() < stop_at:
        pass


def _fit_on_a_shared_core(rank, world_size, out, core):
    os.sched_setaffinity(0, {core})  # this rank's thread only (pid 0: the calling thread)
    # 8 samples a step, each 1.5 ms of this thread's CPU to load: 12 ms of loading work a step
    config = doctor_config(out, model={"kind": "mlp", "layers": 2, "width": 16, "spin_s": 0.0015}, batch=8, steps=4)
    trainer = DoctorTask(config)
    trainer.fit()
    return [r for c in trainer.callbacks for r in getattr(c, "records", [])]


@pytest.mark.timeout(120)
@pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"), reason="needs Linux schedstat")
def test_waiting_for_a_core_while_the_batch_loads_is_not_counted_as_loading(tmp_path):
    # The rank loads its batches on a core another process keeps busy: the kernel gives it about
    # half the core, so about half of each wait for a batch is waiting for the core. Loader
    # processes would not remove that part, so the data_loading cause must not count it.
    core, saved = min(os.sched_getaffinity(0)), os.sched_getaffinity(0)
    rival = multiprocessing.get_context("fork")
    os.sched_setaffinity(0, {core})  # the rival inherits the mask
    try:
        rival = rival.Process(target=_spin, args=(time.monotonic() + 90.0,))
        rival.start()
    finally:
        os.sched_setaffinity(0, saved)
    try:
        records = run_threaded(_fit_on_a_shared_core, 1, tmp_path, core, timeout_s=100)[0]
    finally:
        rival.terminate()
        rival.join(10)
    assert len(records) == 4
    for r in records:  # measured by the kernel beside the rival: a large part of the wait
        assert r["data_core_wait_s"] > 0.25 * r["data_s"], r
        assert r["data_s"] - r["data_core_wait_s"] > 0.010, r  # the loading's own 12 ms of CPU is still there
    report = json.loads((tmp_path / "doctor.json").read_text())
    b = report["breakdown"]
    assert b["data_core_wait_s"] > 0.25 * b["data_s"], b
    cause = next(c for c in report["causes"] if c["cause"] == "data_loading")
    assert cause["share"] == pytest.approx((b["data_s"] - b["data_core_wait_s"]) / report["step_s"], abs=1e-3)
