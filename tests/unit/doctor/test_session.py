"""A doctored fit on threaded ranks: the window is measured, doctor.json has the documented shape,
the trace holds every rank, and nothing stays wrapped (nor is wrapped at all when off)."""

import json

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
def test_a_one_rank_doctored_fit_reports(tmp_path):
    # one process, nothing to communicate: the rules that model the link have nothing to divide by
    results = run_threaded(_fit, 1, tmp_path, True, {"kind": "mlp", "layers": 4, "width": 32}, timeout_s=100)
    assert results[0]["records"] == 4
    report = json.loads((tmp_path / "doctor.json").read_text())
    assert (
        report["world_size"] == 1 and report["causes"] and "slow_network" not in {c["cause"] for c in report["causes"]}
    )


@pytest.mark.timeout(120)
def test_doctor_off_wraps_nothing_and_writes_nothing(tmp_path):
    results = run_threaded(_fit, 2, tmp_path, False, {"kind": "mlp", "layers": 2, "width": 16}, timeout_s=100)
    assert all(r == {"wrapped": [], "tracking": False, "recorder_left": 0, "doctors": 0, "records": 0} for r in results)
    assert not (tmp_path / "doctor.json").exists()


def test_phases_are_the_documented_ones():
    assert PHASES == ("data_s", "forward_s", "backward_s", "comm_s", "find_unused_s", "optimizer_s", "other_s")
