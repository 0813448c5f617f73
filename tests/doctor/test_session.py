"""A doctored fit on threaded ranks: the window is measured, doctor.json holds what the records
give, the trace holds every rank, and nothing listens after the window (nor at all when off)."""

import json
import os
import statistics

import pytest
import torch

from ddptrain.doctor.diagnose import BREAKDOWN, JobFacts, summarize
from ddptrain.doctor.link import LinkModel
from ddptrain.doctor.measure import PHASES
from ddptrain.doctor.session import _probe
from ddptrain.testing import run_threaded
from tests.doctor.tasks import DoctorTask, doctor_config

MLP = {"kind": "mlp", "layers": 4, "width": 32}
MLP_BYTES = (4 * (32 * 32 + 32) + 32 * 10 + 10) * 4  # float32 weights and biases: every gradient all-reduced


def _fit(rank, world_size, out, doctor_on, model, batch=64, accum=1):
    cfg = doctor_config(out, model=model, batch=batch, steps=4, warmup_steps=1)
    cfg.trainer.doctor, cfg.trainer.grad_accum_steps = doctor_on, accum
    trainer = DoctorTask(cfg)
    trainer.fit()
    recorder_left = [c for c in trainer.callbacks if getattr(c, "recorder", None) is not None]
    records = [r for c in trainer.callbacks for r in getattr(c, "records", [])]
    for r in records:  # every step is fully accounted for: the phases add up to it
        assert sum(r[p] for p in PHASES) == pytest.approx(r["end"] - r["start"], abs=1e-9)
        assert all(r[p] >= 0 for p in PHASES) and r["buckets"] and r["buckets"][0]["done"] >= r["buckets"][0]["launch"]
    # the doctor listens, it replaces nothing: no method on the instances, no listener or hook left
    replaced = sorted(k for k in ("forward_backward", "optimizer_step") if k in vars(trainer))
    replaced += ["forward"] if "forward" in vars(trainer.model) else []
    listening = trainer.phases.listeners + list(trainer.model._forward_hooks.values())
    listening += list(trainer.model._forward_pre_hooks.values())
    return {
        "wrapped": replaced + listening,
        "tracking": trainer.model.reducer.track_completion,
        "recorder_left": len(recorder_left),
        "doctors": sum(type(c).__name__ == "DoctorCallback" for c in trainer.callbacks),
        "records": records,
    }


def _left(results, doctors: int) -> None:
    for r in results:
        assert {k: v for k, v in r.items() if k != "records"} == {
            "wrapped": [],
            "tracking": False,
            "recorder_left": 0,
            "doctors": doctors,
        }


@pytest.mark.timeout(120)
def test_doctored_fit_writes_the_report_its_records_give_and_stops_listening(tmp_path):
    results = run_threaded(_fit, 2, tmp_path, True, MLP, timeout_s=100)
    _left(results, doctors=1)
    per_rank = [r["records"] for r in results]
    assert [[rec["step"] for rec in recs] for recs in per_rank] == [[2, 3, 4, 5]] * 2  # after 1 warm-up step
    report = json.loads((tmp_path / "doctor.json").read_text())
    job = report["job"]
    assert (job["gradient_bytes"], job["buckets"], job["bucket_cap_mb"], job["ranks_per_host"]) == (MLP_BYTES, 1, 25, 2)
    for recs in per_rank:  # one 25 MB bucket holds every gradient
        assert all(sum(b["bytes"] for b in rec["buckets"]) == MLP_BYTES for rec in recs)

    # the breakdown and the per-rank rows are the summary of the ranks' records
    shared = job["ranks_per_host"] * job["threads"] > job["cores"]
    breakdown, ranks = summarize(per_rank, shared)
    assert report["step_s"] == pytest.approx(breakdown["step_s"], rel=1e-12)
    assert report["breakdown"] == pytest.approx({k: breakdown[k] for k in (*BREAKDOWN, "data_core_wait_s", "steps")})
    assert report["breakdown"]["steps"] == 4
    assert len(report["per_rank"]) == 2
    for got, want in zip(report["per_rank"], ranks):
        assert got == pytest.approx(want, rel=1e-12)

    # the link: nccl-tests' figures of the sweep (2 ranks: busbw = algbw) and the model fitted to it
    link, sweep = report["link"], report["link"]["sweep"]
    for row in sweep:
        assert row["algbw_GBps"] == pytest.approx(row["bytes"] / row["time_s"] / 1e9)
        assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"])
    assert link["busbw_GBps"] == sweep[-1]["busbw_GBps"] > 0
    assert link["latency_s"] == pytest.approx(LinkModel.fit(sweep, 2).alpha_s)

    causes, step = report["causes"], report["step_s"]
    if [c["cause"] for c in causes] == ["healthy"]:
        b = report["breakdown"]
        assert causes[0]["predicted_step_s"] == pytest.approx(step)
        assert causes[0]["share"] == round((b["forward_s"] + b["backward_s"] + b["optimizer_s"]) / step, 4)
    else:  # a loaded host can slow a rank for the window: whatever is found is ranked and sized
        assert all(0 < c["share"] <= 1 and c["predicted_step_s"] > 0 for c in causes), causes
        assert [c["share"] for c in causes if c["cause"] != "straggler"] == sorted(
            (c["share"] for c in causes if c["cause"] != "straggler"), reverse=True
        )

    # weak scaling from the measured point: 2 ranks predict the measured step; efficiency is one
    # rank's compute (here on a host of its own) over the predicted step
    assert [s["world_size"] for s in report["scaling"]] == [2, 4, 8, 64]
    assert report["scaling"][0]["predicted_step_s"] == pytest.approx(step, rel=1e-6)
    b = report["breakdown"]
    load = lambda ranks: max(1.0, ranks * job["threads"] / job["cores"])  # noqa: E731
    single = (step - b["comm_exposed_s"] - b["sync_wait_s"]) * load(1) / load(2)
    for s in report["scaling"]:
        assert s["efficiency"] == pytest.approx(single / s["predicted_step_s"], rel=1e-9)
    # each rank keeps its 32 samples (a global batch of 64 over 2 ranks)
    assert report["scaling_mode"]["samples_per_rank"] == 32
    assert [s["global_batch_size"] for s in report["scaling"]] == [64, 128, 256, 2048]

    trace = json.loads((tmp_path / "doctor_trace.json").read_text())["traceEvents"]
    spans = [e for e in trace if e["ph"] == "X"]
    for rank, recs in enumerate(per_rank):
        mine = [e for e in spans if e["pid"] == rank]
        steps = {e["name"]: e["dur"] for e in mine if e["name"].startswith("step ")}
        assert steps == pytest.approx({f"step {r['step']}": (r["end"] - r["start"]) * 1e6 for r in recs})
        for name in ("data", "forward", "backward", "comm wait", "optimizer", "bucket 0"):
            assert sum(e["name"] == name for e in mine) == 4, name


@pytest.mark.timeout(120)
def test_the_phases_measure_what_they_name(tmp_path):
    # each sample takes 3 ms to load (8 a rank per step: >= 24 ms of data); rank 1 sleeps 30 ms in
    # each of its 2 micro-batches' training_step before the model call, and rank 0 waits for it
    # after its last backward (comm)
    model = {**MLP, "sleep_s": 0.003, "slow_rank": 1, "slow_s": 0.03}
    results = run_threaded(_fit, 2, tmp_path, True, model, batch=16, accum=2, timeout_s=100)
    _left(results, doctors=1)
    for rank, result in enumerate(results):
        recs = result["records"]
        assert [r["step"] for r in recs] == [2, 3, 4, 5]
        for r in recs:
            m = r["marks"]
            order = [r["start"], m["data_end"], m["train_start"], m["forward_start"], m["forward_end"]]
            order += [m["backward_end"], m["train_end"], m["optimizer_start"], m["optimizer_end"], r["end"]]
            assert order == sorted(order), r
            assert r["data_s"] >= 8 * 0.003 and r["data_s"] == pytest.approx(m["data_end"] - r["start"])
            assert r["optimizer_s"] == pytest.approx(m["optimizer_end"] - m["optimizer_start"]) and r["optimizer_s"] > 0
            assert r["find_unused_s"] == 0.0 and r["unused_params"] == 0 and r["cpu_s"] > 0
            if rank == 1:  # the sleep before the first forward is forward's; later ones land in backward
                assert r["forward_s"] >= 0.03 and r["forward_s"] + r["backward_s"] >= 2 * 0.03, r
        if rank == 0:
            assert statistics.median(r["comm_s"] for r in recs) >= 0.03, recs


@pytest.mark.timeout(120)
def test_a_one_rank_doctored_fit_reports(tmp_path):
    # one process, nothing to communicate: the rules that model the link have nothing to divide by
    results = run_threaded(_fit, 1, tmp_path, True, MLP, timeout_s=100)
    assert len(results[0]["records"]) == 4
    report = json.loads((tmp_path / "doctor.json").read_text())
    assert (
        report["world_size"] == 1 and report["causes"] and "slow_network" not in {c["cause"] for c in report["causes"]}
    )


@pytest.mark.timeout(120)
def test_doctor_off_listens_to_nothing_and_writes_nothing(tmp_path):
    results = run_threaded(_fit, 2, tmp_path, False, {"kind": "mlp", "layers": 2, "width": 16}, timeout_s=100)
    _left(results, doctors=0)
    assert all(r["records"] == [] for r in results)
    assert not (tmp_path / "doctor.json").exists()


def _mlp_facts(world_size: int) -> JobFacts:
    """The job facts the probe needs, for MLP on ``world_size`` ranks of this machine."""
    return JobFacts(
        world_size=world_size,
        ranks_per_host=world_size,
        threads=1,
        cores=len(os.sched_getaffinity(0)),
        num_workers=0,
        bucket_cap_mb=25.0,
        find_unused=False,
        bucket_sizes=((MLP_BYTES,),),
    )


def _probe_fit(rank, world_size, out):
    cfg = doctor_config(out, model={**MLP, "slow_rank": 1, "slow_s": 0.03}, batch=8)
    cfg.trainer.doctor, cfg.trainer.max_steps = False, 1
    trainer = DoctorTask(cfg)
    trainer.fit()
    facts = _mlp_facts(world_size)
    batch = (torch.randn(4, 32), torch.randint(0, 10, (4,)))
    return _probe(trainer, batch, facts)


@pytest.mark.timeout(120)
def test_every_rank_gets_every_ranks_unhurried_compute_time(tmp_path):
    # rank 1 sleeps 30 ms in each pass; the straggler's prediction on rank 0 reads the other ranks'
    # back-to-back passes (warm_s), so each rank's own time must reach every rank
    probes = run_threaded(_probe_fit, 2, tmp_path, timeout_s=100)
    assert probes[0] == probes[1]
    warm = probes[0]["warm_s"]
    assert 0 < warm[0] < 0.03 <= warm[1], warm
    assert probes[0]["now_s"] >= 0.03  # all ranks computing at once: the slowest rank's time


class _AutocastSeen(DoctorTask):
    """Records, at each training_step, whether autocast is on (what the step computes in)."""

    def __init__(self, config):
        super().__init__(config)
        self.autocast_seen: list[bool] = []

    def training_step(self, model, batch):
        self.autocast_seen.append(torch.is_autocast_enabled("cpu"))
        return super().training_step(model, batch)


def _autocast_probe(rank, world_size, out):
    cfg = doctor_config(out, model=MLP, batch=8)
    cfg.trainer.doctor, cfg.trainer.max_steps, cfg.trainer.precision = False, 1, "bf16-mixed"
    trainer = _AutocastSeen(cfg)
    trainer.fit()
    trained = list(trainer.autocast_seen)
    facts = _mlp_facts(world_size)
    _probe(trainer, (torch.randn(4, 32), torch.randint(0, 10, (4,))), facts, repeats=1)
    return trained, trainer.autocast_seen[len(trained) :]


@pytest.mark.timeout(120)
def test_the_compute_probe_computes_in_the_trainings_precision(tmp_path):
    """Under bf16-mixed the training step runs in autocast; the probe must time the same
    computation (it once ran float32 while training ran bf16: the local-step predictions of a
    bf16 recipe were 22-27% high)."""
    trained, probed = run_threaded(_autocast_probe, 1, tmp_path, timeout_s=100)[0]
    assert trained and all(trained), trained
    assert probed and all(probed), probed


def _zero_fit(rank, world_size, out, stage):
    cfg = doctor_config(out, model=MLP, dist={"zero_stage": stage, "bucket_cap_mb": 0.002}, batch=16, steps=4)
    trainer = DoctorTask(cfg)
    trainer.fit()
    return [r for c in trainer.callbacks for r in getattr(c, "records", [])]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [1, 2])
def test_under_zero_the_parameters_all_gather_counts_as_communication_not_optimizer_time(tmp_path, stage):
    """ZeRO's step ends with an all-gather of the updated parameters: the doctor times it apart
    from the shards' optimizer step and counts it with the reduce-scatter's wait as communication;
    the phases still add up to the step, and the trace draws it."""
    per_rank = run_threaded(_zero_fit, 2, tmp_path, stage, timeout_s=100)
    for records in per_rank:
        assert len(records) == 4
        for r in records:
            gathered = r["marks"]["all_gather_end"] - r["marks"]["all_gather_start"]
            assert 0 < gathered and r["comm_s"] >= gathered, r
            whole = r["marks"]["optimizer_end"] - r["marks"]["optimizer_start"]
            assert r["optimizer_s"] == pytest.approx(whole - gathered, abs=1e-9), r
            assert sum(r[p] for p in PHASES) == pytest.approx(r["end"] - r["start"], abs=1e-9)
    report = json.loads((tmp_path / "doctor.json").read_text())
    assert report["world_size"] == 2 and report["breakdown"]["comm_exposed_s"] > 0
    trace = json.loads((tmp_path / "doctor_trace.json").read_text())["traceEvents"]
    assert sum(e["name"] == "parameter all-gather" for e in trace) == 8  # 4 steps on each of 2 ranks
