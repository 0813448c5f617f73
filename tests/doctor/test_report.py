"""What the report says of itself: which scaling it predicts, which files it wrote, and, for a
fit that is only the doctor's window, the window rather than epochs it never reaches."""

from types import SimpleNamespace

from ddptrain import Config
from ddptrain.doctor.diagnose import JobFacts, summarize
from ddptrain.doctor.report import balance_outcome, doctor_json, format_balance, format_report
from ddptrain.doctor.session import doctor_window
from tests.doctor.test_diagnose import _records

FACTS = JobFacts(2, 2, 1, 2, 0, 25.0, False, ((1000,),))
SCALING = [{"world_size": p, "predicted_step_s": 0.01 * p, "efficiency": 1 / p} for p in (2, 8)]


def _report(samples_per_rank=64):
    breakdown, ranks = summarize(_records())
    link = {"latency_s": 50e-6, "busbw_GBps": 1.0}
    return doctor_json(FACTS, breakdown, ranks, link, [], SCALING, samples_per_rank)


def test_the_scaling_says_it_is_weak_scaling_with_the_samples_per_rank():
    report = _report(samples_per_rank=64)
    assert report["scaling_mode"]["kind"] == "weak" and report["scaling_mode"]["samples_per_rank"] == 64
    assert [s["global_batch_size"] for s in report["scaling"]] == [128, 512]
    line = next(ln for ln in format_report(report).splitlines() if ln.startswith("scaling"))
    assert line.startswith("scaling (weak: 64 samples per rank, global batch grows with the world size;"), line


def test_the_report_names_every_file_written(tmp_path):
    (tmp_path / "doctor.json").write_text("{}")
    (tmp_path / "doctor_trace.json").write_text("{}")
    (tmp_path / "tensorboard").mkdir()
    written = [(tmp_path / "doctor.json", "this report"), (tmp_path / "doctor_trace.json", "the trace")]
    text = format_report(_report(), [*written, (tmp_path / "tensorboard", "scalars")])
    tail = text.splitlines()[-3:]
    assert tail[0] == f"written: {tmp_path / 'doctor.json'} (this report)", tail
    assert tail[1].split() == [str(tmp_path / "doctor_trace.json"), "(the", "trace)"], tail
    assert tail[2].split()[0] == f"{tmp_path / 'tensorboard'}/", tail


def _trainer(step=0, steps_per_epoch=469, **trainer):
    config = Config.from_dict({"trainer": {"doctor": True, **trainer}})
    return SimpleNamespace(config=config, steps_per_epoch=steps_per_epoch, state=SimpleNamespace(step=step))


def test_a_fit_that_is_only_the_window_is_described_as_the_window():
    # python -m ddptrain.doctor: max_steps = doctor.warmup_steps + doctor.steps
    window = doctor_window(_trainer(max_steps=13))
    assert str(window) == "doctor window: 13 steps (3 warm-up + 10 measured)" and window.last_step == 13
    short = doctor_window(_trainer(steps_per_epoch=5, epochs=1))  # the data ends the fit inside the window
    assert str(short) == "doctor window: 5 steps (3 warm-up + 2 measured)" and short.last_step == 5
    # a run that goes on after the window, or has no doctor: its epochs are what it runs
    assert doctor_window(_trainer()) is None and doctor_window(_trainer(max_steps=14)) is None
    assert doctor_window(_trainer(max_steps=13, doctor=False)) is None


def _change(step, shares, measured_gain, kind="faster"):
    return {
        "step": step,
        "kind": kind,
        "shares": shares,
        "predicted_gain": 1.2,
        "measured_gain": measured_gain,
    }


def test_the_balance_line_says_what_the_shares_became_and_gained_or_why_they_did_not_change():
    fixed = balance_outcome({"shares": [0.75, 0.25], "changes": []})
    assert format_balance(fixed) == (
        "balance: the fixed shares 0.750, 0.250 (trainer.balance.shares=auto would measure and choose)"
    )
    kept = balance_outcome({"shares": [0.5, 0.5], "changes": [], "measured_step_s": 0.1})
    assert format_balance(kept) == (
        "balance kept the shares 0.500, 0.500: no change was predicted to gain enough (trainer.balance.min_gain)"
    )
    two = [_change(20, [0.6, 0.4], 1.4), _change(40, [0.7, 0.3], None)]  # no window ended after the second
    changed = balance_outcome({"shares": [0.7, 0.3], "changes": two, "measured_step_s": 0.1})
    assert changed["changes"][1] == {
        "step": 40,
        "kind": "faster",
        "shares": [0.7, 0.3],
        "predicted_gain": 1.2,
        "measured_gain": None,
    }
    assert format_balance(changed) == (
        "balance chose the shares 0.700, 0.300 in 2 change(s) (step 20: predicted 1.20x, measured 1.40x; "
        "step 40: predicted 1.20x, measured (no window after it))"
    )
    back = [_change(20, [0.6, 0.4], 1.05), _change(40, [0.5, 0.5], None, kind="taken back")]
    taken = balance_outcome({"shares": [0.5, 0.5], "changes": back, "measured_step_s": 0.1})
    assert format_balance(taken) == (
        "balance chose the shares 0.500, 0.500 in 2 change(s) (step 20: predicted 1.20x, measured 1.05x; "
        "step 40: taken back)"
    )
