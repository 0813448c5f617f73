"""The rules: synthetic step records of known shape give the cause they were built to show."""

import math
import re

import pytest

from ddptrain.doctor.diagnose import JobFacts, _comm_in_backward, diagnose, step_model, summarize
from ddptrain.doctor.link import LinkModel

LINK = LinkModel(alpha_s=50e-6, bandwidth_Bps=1e9)


def _records(ranks=2, steps=5, **phases_by_rank):
    """``phases_by_rank[name]``: a value for every rank, or a list with one per rank."""
    out = []
    for r in range(ranks):
        recs, t = [], 0.0
        for s in range(steps):
            values = {
                k: (v[r] if isinstance(v, list) else v)
                for k, v in {
                    "data_s": 0.001,
                    "forward_s": 0.01,
                    "backward_s": 0.02,
                    "comm_s": 0.0005,
                    "find_unused_s": 0.0,
                    "optimizer_s": 0.002,
                    "other_s": 0.001,
                    **phases_by_rank,
                }.items()
            }
            step_s = sum(values.values())
            recs.append(
                {
                    "step": s + 1,
                    "start": t,
                    "end": t + step_s,
                    "cpu_s": step_s,
                    "core_wait_s": 0.0,
                    "find_unused_comm_s": 0.0,
                    "unused_params": 0,
                    **values,
                }
            )
            t += step_s
        out.append(recs)
    return out


def _split(total: int):
    """``buckets_at`` of a model of ``total`` bytes in many small gradients: ``cap`` MB buckets."""

    def buckets_at(cap_mb: float):
        cap = int(cap_mb * (1 << 20))
        full, rest = divmod(total, cap)
        return ((cap,),) * full + (((rest,),) if rest else ())

    return buckets_at


def _facts(**kw):
    base = dict(
        world_size=2,
        ranks_per_host=2,
        threads=1,
        cores=2,
        num_workers=0,
        bucket_cap_mb=25.0,
        find_unused=False,
        bucket_sizes=((400_000,),),
        buckets_at=_split(400_000),
    )
    base.update(kw)
    return JobFacts(**base)


def _first(records, facts=None, link=LINK):
    facts = facts or _facts()
    breakdown, ranks = summarize(records, facts.shares_cores)
    causes = diagnose(breakdown, ranks, facts, link)
    return causes[0], breakdown


def test_healthy_compute_bound_step():
    cause, b = _first(_records())
    assert cause["cause"] == "healthy"
    assert cause["predicted_step_s"] == pytest.approx(b["step_s"])


def test_data_wait_is_data_loading_with_more_workers_and_a_prediction():
    cause, b = _first(_records(data_s=0.3))
    assert cause["cause"] == "data_loading" and cause["share"] > 0.8
    # enough loader processes to deliver a batch per step, and half as many again (batches come in order)
    rest = b["step_s"] - b["data_s"]
    assert f"data.num_workers={math.ceil(1.5 * b['data_s'] / rest) + 1}:" in cause["advice"], cause["advice"]
    assert cause["predicted_step_s"] == pytest.approx(b["step_s"] - 0.3, rel=0.05)


@pytest.mark.parametrize("slow", [0, 1, 2])
def test_the_others_waiting_is_a_straggler_and_names_the_slow_rank(slow):
    # the slow rank computes 0.2 s longer; the others wait that long for its buckets
    forward = [0.21 if r == slow else 0.01 for r in range(3)]
    comm = [0.0005 if r == slow else 0.2005 for r in range(3)]
    cause, b = _first(_records(ranks=3, forward_s=forward, comm_s=comm), _facts(world_size=3))
    assert (cause["cause"], cause["rank"]) == ("straggler", slow)
    assert cause["predicted_step_s"] == pytest.approx(b["step_s"] - 0.2, rel=0.05)
    balanced = re.search(r"trainer.balance.shares=auto \(predicted step ([\d.e-]+) s\)", cause["advice"])
    assert balanced and float(balanced.group(1)) < b["step_s"], cause["advice"]  # shares by speed: faster


def _waiting_for_a_core(slow: int, extra_s: float, core_wait_s: float):
    """3 ranks; rank ``slow`` takes ``extra_s`` longer in forward, of which its thread spent
    ``core_wait_s`` ready to run but without a core; the others wait for it."""
    forward = [0.01 + extra_s if r == slow else 0.01 for r in range(3)]
    comm = [0.0005 if r == slow else 0.0005 + extra_s for r in range(3)]
    records = _records(ranks=3, forward_s=forward, comm_s=comm)
    for r, recs in enumerate(records):
        for rec in recs:
            rec["core_wait_s"] = core_wait_s if r == slow else 0.0
    return records


def test_a_rank_kept_off_shared_cores_is_not_a_straggler():
    # 3 single-thread ranks on 2 cores: the OS keeps one waiting for a core, step after step
    # (seen: 4.5 vs 7.6 ms of work, 3.3 ms of it waiting), which says nothing about that rank
    cause, _ = _first(_waiting_for_a_core(2, 0.02, 0.02), _facts(world_size=3, ranks_per_host=3, cores=2))
    assert cause["cause"] == "healthy", cause


def test_a_rank_kept_off_cores_it_should_have_is_a_straggler():
    # the same on a host with a core per rank: something else (another job) keeps it waiting
    cause, _ = _first(_waiting_for_a_core(2, 0.02, 0.02), _facts(world_size=3, ranks_per_host=3, cores=4))
    assert (cause["cause"], cause["rank"]) == ("straggler", 2)


def test_a_rank_slower_than_its_wait_for_a_core_explains_is_a_straggler():
    facts = _facts(world_size=3, ranks_per_host=3, cores=2)
    cause, b = _first(_waiting_for_a_core(1, 0.2, 0.005), facts)
    assert (cause["cause"], cause["rank"]) == ("straggler", 1)
    assert cause["share"] == pytest.approx(0.195 / b["step_s"], rel=0.05)


def test_exposed_bytes_on_a_slow_link_are_slow_network():
    link = LinkModel(alpha_s=50e-6, bandwidth_Bps=50e6 / 8)  # 50 Mbit/s: 25 MB take seconds
    sizes = ((25 << 20,),)
    exposed = link.allreduce_s(25 << 20, 2)
    cause, _ = _first(_records(comm_s=exposed), _facts(bucket_sizes=sizes, buckets_at=_split(25 << 20)), link)
    assert cause["cause"] == "slow_network" and cause["share"] > 0.9


def test_a_slow_link_predicts_local_steps_from_the_link_model_and_the_compute():
    """Each H's step: this step without its exposed communication, plus one all-reduce of every
    gradient byte over the fitted link every H steps; the advice names the smallest H within 10% of
    the largest H's step, with the override to type."""
    link = LinkModel(alpha_s=50e-6, bandwidth_Bps=20e6 / 8)  # 20 Mbit/s
    nbytes = 4 << 20
    outer = link.allreduce_s(nbytes, 2)  # ~3.4 s
    facts = _facts(bucket_sizes=((nbytes,),), buckets_at=_split(nbytes), samples_per_step=256)
    cause, b = _first(_records(comm_s=outer, backward_s=0.5), facts, link)
    assert cause["cause"] == "slow_network"
    compute = b["step_s"] - b["comm_exposed_s"]
    by_h = {o["sync_every"]: o for o in cause["sync_options"]}
    assert by_h[1]["sync"] == "every_step" and by_h[1]["predicted_step_s"] == b["step_s"]
    for h in (4, 16, 64):
        assert by_h[h]["predicted_step_s"] == pytest.approx(compute + outer / h)
        assert by_h[h]["bytes_per_sample"] == pytest.approx(nbytes / h / 256)
        assert by_h[h]["speedup"] == pytest.approx(b["step_s"] / by_h[h]["predicted_step_s"])
    # an outer all-reduce of ~3.4 s against ~0.5 s of compute: only H=64 comes within 10% of H=64
    assert by_h[16]["predicted_step_s"] > 1.1 * by_h[64]["predicted_step_s"]
    assert "dist.sync=diloco dist.sync_every=64" in cause["advice"]
    assert cause["predicted_step_s"] == by_h[64]["predicted_step_s"]
    assert "Convergence per sample differs" in cause["advice"]


def test_a_local_step_computes_at_the_speed_the_probe_measured_without_communication():
    """Under every_step a step's forward holds the wait for rank 0's buffers and its backward
    shares the cores with the transport; between outer steps neither happens, so a local step's
    forward and backward are the probe's (no_sync, every rank at once), the rest of the step kept."""
    link = LinkModel(alpha_s=50e-6, bandwidth_Bps=20e6 / 8)
    nbytes = 320_000
    outer = link.allreduce_s(nbytes, 2)
    probe = {"threads_now": 1, "now_s": 0.02, "threads_fit": 1, "fit_s": 0.02, "warm_s": [0.02, 0.02]}
    facts = _facts(bucket_sizes=((nbytes,),), buckets_at=_split(nbytes), compute_probe=probe)
    cause, b = _first(_records(comm_s=[outer + 0.01, outer], forward_s=[0.04, 0.05], backward_s=0.03), facts, link)
    assert b["sync_wait_s"] > 0.004  # rank 0 waits for rank 1 every step: not between outer steps
    assert cause["cause"] == "slow_network"
    rest = b["data_s"] + b["find_unused_s"] + b["optimizer_s"] + b["other_s"]
    by_h = {o["sync_every"]: o for o in cause["sync_options"]}
    for h in (4, 16, 64):
        assert by_h[h]["predicted_step_s"] == pytest.approx(rest + 0.02 + outer / h)


def test_the_smallest_sync_every_that_gets_most_of_the_saving_is_advised():
    link = LinkModel(alpha_s=50e-6, bandwidth_Bps=20e6 / 8)
    nbytes = 320_000  # mnist_fast's gradients: 0.26 s per all-reduce at 20 Mbit/s
    outer = link.allreduce_s(nbytes, 2)
    facts = _facts(bucket_sizes=((nbytes // 4,),) * 4, buckets_at=_split(nbytes))  # four buckets: overlap is fine
    cause, b = _first(_records(comm_s=outer, backward_s=0.1), facts, link)
    assert cause["cause"] == "slow_network"
    compute = b["step_s"] - b["comm_exposed_s"]
    expected = next(h for h in (4, 16, 64) if compute + outer / h <= 1.1 * (compute + outer / 64))
    assert expected == 16
    assert f"dist.sync_every={expected} predicts" in cause["advice"]
    assert all(o["bytes_per_sample"] is None for o in cause["sync_options"])  # the global batch is unknown


def test_many_tiny_all_reduces_are_small_buckets_and_25_mb_predicts_the_saving():
    tiny = ((50_000,),) * 60
    facts = _facts(bucket_cap_mb=0.05, bucket_sizes=tiny, buckets_at=_split(3_000_000))
    cause, b = _first(_records(comm_s=0.06), facts)  # 1 ms per all-reduce, far above the link's latency
    assert cause["cause"] == "small_buckets"
    assert "dist.bucket_cap_mb=25" in cause["advice"]
    assert cause["predicted_step_s"] < b["step_s"] - 0.04


def test_one_huge_bucket_after_backward_is_no_overlap_when_the_link_would_hide_it():
    link = LinkModel(alpha_s=1e-6, bandwidth_Bps=100e6)
    sizes = ((10_000_000,),)
    facts = _facts(bucket_cap_mb=1000.0, bucket_sizes=sizes, buckets_at=_split(10_000_000))
    cause, b = _first(_records(backward_s=0.2, comm_s=link.allreduce_s(10_000_000, 2)), facts, link)
    assert cause["cause"] == "no_overlap" and "dist.bucket_cap_mb=" in cause["advice"]
    assert cause["predicted_step_s"] < b["step_s"]


def test_find_unused_when_every_parameter_is_used():
    facts = _facts(find_unused=True)
    cause, b = _first(_records(find_unused_s=0.02), facts)
    assert cause["cause"] == "find_unused_overhead"
    assert "dist.find_unused_parameters=false" in cause["advice"]
    assert cause["predicted_step_s"] == pytest.approx(b["step_s"] - 0.02)
    facts.find_unused = False  # off: nothing to save
    assert _first(_records(find_unused_s=0.02), facts)[0]["cause"] == "healthy"


def test_more_threads_than_cores_with_a_faster_probe_is_cpu_oversubscribed():
    probe = {"threads_now": 4, "now_s": 0.09, "threads_fit": 1, "fit_s": 0.03}
    facts = _facts(threads=4, compute_probe=probe)
    cause, b = _first(_records(forward_s=0.03, backward_s=0.06), facts)
    assert cause["cause"] == "cpu_oversubscribed" and "dist.threads_per_worker=1" in cause["advice"]
    # every phase but the data wait speeds up as the probe did (3x): spinning threads slow them all
    assert cause["predicted_step_s"] == pytest.approx(b["data_s"] + (b["step_s"] - b["data_s"]) / 3)
    facts.threads = 1  # threads that fit the cores: not this cause, whatever the probe says
    assert _first(_records(forward_s=0.03, backward_s=0.06), facts)[0]["cause"] == "healthy"


def test_waiting_in_the_used_flags_all_reduce_is_the_stragglers_not_find_unused_overhead():
    # rank 1 computes 0.2 s longer; with find_unused_parameters the others wait for it in the used
    # flags' all-reduce (inside find_unused_s), the first collective after backward
    slow, flags = 1, 0.0005
    forward = [0.21 if r == slow else 0.01 for r in range(3)]
    search = [0.002 + (flags if r == slow else flags + 0.2) for r in range(3)]
    records = _records(ranks=3, forward_s=forward, find_unused_s=search)
    for r, recs in enumerate(records):
        for rec in recs:
            rec["find_unused_comm_s"] = flags if r == slow else flags + 0.2
    breakdown, ranks = summarize(records)
    causes = diagnose(breakdown, ranks, _facts(world_size=3, find_unused=True), LINK)
    assert (causes[0]["cause"], causes[0]["rank"]) == ("straggler", slow)
    assert breakdown["find_unused_s"] == pytest.approx(0.0025)
    assert breakdown["sync_wait_s"] == pytest.approx(0.4 / 3)


def test_a_few_percent_of_needless_find_unused_is_reported_but_not_a_few_percent_of_data():
    facts = _facts(find_unused=True)
    cause, _ = _first(_records(find_unused_s=0.002), facts)  # ~5% of the step
    assert cause["cause"] == "find_unused_overhead" and cause["share"] < 0.1
    assert _first(_records(data_s=0.002))[0]["cause"] == "healthy"


def test_only_communication_that_ran_beside_backward_can_have_slowed_it():
    # buckets in flight from 1.0 to 1.5 and 1.2 to 1.8 (once: 0.8 s), one launched at backward's end
    record = {
        "marks": {"backward_end": 2.0},
        "buckets": [
            {"launch": 1.0, "done": 1.5},
            {"launch": 1.2, "done": 1.8},
            {"launch": 2.0, "done": 2.5},
            {"launch": None, "done": None},  # never launched
        ],
    }
    assert _comm_in_backward(record) == pytest.approx(0.8)
    probe = {"threads_now": 1, "now_s": 0.05, "threads_fit": 1, "fit_s": 0.05}
    facts = _facts(compute_probe=probe)
    base = dict(step_s=0.1, data_s=0.0, forward_s=0.02, backward_s=0.04, comm_exposed_s=0.03, sync_wait_s=0.0)
    base.update(find_unused_s=0.0, optimizer_s=0.0, other_s=0.01)
    # forward+backward 10 ms slower than the probe, all-reduces beside them for 20 ms: 10 ms stolen
    assert step_model({**base, "in_backward_s": 0.02}, facts, LINK).stolen_s == pytest.approx(0.01)
    # the same 10 ms, but only 0.4 ms of communication ran beside backward: noise, not stealing
    assert step_model({**base, "in_backward_s": 0.0004}, facts, LINK).stolen_s == 0.0


def test_the_straggler_prediction_takes_the_waiting_ranks_work_at_its_unhurried_speed():
    """Ranks that idle for a straggler every step compute slower after each wait: their forward and
    backward, run back to back by the probe (``warm_s``), take half as long as in the window, so
    once the straggler is gone their work is predicted to take half as long too (never longer)."""
    slow = 2
    forward = [0.21 if r == slow else 0.01 for r in range(3)]
    comm = [0.0005 if r == slow else 0.2005 for r in range(3)]
    records = _records(ranks=3, forward_s=forward, comm_s=comm)
    plain, b = _first(records, _facts(world_size=3))
    window = 0.01 + 0.02  # the waiting ranks' forward and backward (_records' defaults)
    probe = {"threads_now": 1, "now_s": 0.3, "threads_fit": 1, "fit_s": 0.3, "warm_s": [window / 2] * 3}
    warm, _ = _first(records, _facts(world_size=3, compute_probe=probe))
    assert (warm["cause"], warm["rank"]) == ("straggler", slow)
    saved = plain["predicted_step_s"] - warm["predicted_step_s"]
    busy = plain["predicted_step_s"] - b["comm_exposed_s"]
    assert saved == pytest.approx(busy / 2, rel=0.05)
    probe["warm_s"] = [window * 2] * 3  # slower back to back than in the window: no slower prediction
    assert _first(records, _facts(world_size=3, compute_probe=probe))[0]["predicted_step_s"] == pytest.approx(
        plain["predicted_step_s"]
    )


def test_one_rank_has_no_link_to_blame():
    # nothing crosses a link: no slow_network (it once divided by the link's zero time)
    cause, _ = _first(_records(ranks=1), _facts(world_size=1, ranks_per_host=1))
    assert cause["cause"] == "healthy", cause


def _loading_beside_busy_cores(data_core_wait_s: float):
    """2 ranks; each waits 12 ms for its batch in a 44 ms step, ``data_core_wait_s`` of it ready
    to run but without a core."""
    records = _records(data_s=0.012)
    for recs in records:
        for rec in recs:
            rec["data_core_wait_s"] = data_core_wait_s
    return records


def test_waiting_for_a_core_while_the_batch_loads_is_not_data_loading():
    facts = _facts(ranks_per_host=2, cores=1)
    cause, b = _first(_loading_beside_busy_cores(0.0), facts)
    assert cause["cause"] == "data_loading" and cause["share"] == pytest.approx(0.012 / b["step_s"], abs=1e-4)
    # the same wait, 10 of its 12 ms spent without a core: 2 ms of loading (5%) is no cause
    cause, b = _first(_loading_beside_busy_cores(0.010), facts)
    assert cause["cause"] == "healthy", cause
    assert b["data_core_wait_s"] == pytest.approx(0.010)
    # with a core per rank that wait is the wake-up after each read: loader processes remove it
    cause, b = _first(_loading_beside_busy_cores(0.010), _facts(ranks_per_host=2, cores=2))
    assert cause["cause"] == "data_loading" and cause["share"] == pytest.approx(0.012 / b["step_s"], abs=1e-4)


def _causes(records, facts=None, link=LINK):
    facts = facts or _facts()
    breakdown, ranks = summarize(records, facts.shares_cores)
    return diagnose(breakdown, ranks, facts, link), breakdown


def _straggling(share: float, slow: int = 2, slow_steps=range(5), data_s: float = 0.001):
    """3 ranks, 5 steps; in ``slow_steps`` rank ``slow`` works longer by ``share`` of the step
    (in its forward) and the others wait that long after backward."""
    rest = 0.0345 - 0.001 + data_s  # _records' step without the straggler's extra
    extra = rest * share / (1 - share)
    records = _records(ranks=3, steps=5, data_s=data_s)
    for r, recs in enumerate(records):
        t = 0.0
        for rec in recs:
            if rec["step"] - 1 in slow_steps:
                rec["forward_s" if r == slow else "comm_s"] += extra
            step_s = sum(rec[k] for k in ("data_s", "forward_s", "backward_s", "comm_s", "optimizer_s", "other_s"))
            rec["start"], rec["end"], t = t, t + step_s, t + step_s
    return records, extra


@pytest.mark.parametrize("share,straggler", [(0.27, False), (0.33, True)])
def test_a_straggler_works_at_least_30_percent_of_the_step_longer(share, straggler):
    # below 30% ranks that take turns on busy cores look the same: not named
    records, extra = _straggling(share)
    causes, b = _causes(records, _facts(world_size=3))
    assert [c["cause"] for c in causes] == (["straggler"] if straggler else ["healthy"]), causes
    if straggler:
        assert causes[0]["rank"] == 2 and causes[0]["share"] == pytest.approx(share, abs=1e-3)
        assert b["sync_wait_s"] == pytest.approx(2 * extra / 3)


@pytest.mark.parametrize("slow_steps,straggler", [((0, 1, 3), False), ((0, 1, 3, 4), True)])
def test_a_straggler_is_the_busiest_rank_in_at_least_75_percent_of_the_steps(slow_steps, straggler):
    # a rank far behind in 3 of 5 steps (60%): its median is late, but ranks that take turns are too
    records, _ = _straggling(0.6, slow_steps=slow_steps)
    _, ranks = summarize(records)
    assert ranks[2]["busiest_share"] == pytest.approx(len(slow_steps) / 5)
    causes, _ = _causes(records, _facts(world_size=3))
    assert [c["cause"] for c in causes] == (["straggler"] if straggler else ["healthy"]), causes


def test_a_straggler_beside_slow_loading_lists_the_loading_first():
    # the straggler costs more (~50% against ~13%) but a rank starved of data is its likely root
    records, _ = _straggling(0.5, data_s=0.012)
    causes, b = _causes(records, _facts(world_size=3))
    assert [c["cause"] for c in causes] == ["data_loading", "straggler"], causes
    assert causes[0]["share"] < causes[1]["share"]
    assert causes[0]["share"] == pytest.approx(0.012 / b["step_s"], abs=1e-4)


def test_causes_are_ranked_largest_first():
    # find_unused_overhead (~42%) comes before data_loading (~11%), whose rule runs first
    facts = _facts(find_unused=True)
    causes, b = _causes(_records(data_s=0.008, find_unused_s=0.03), facts)
    assert [c["cause"] for c in causes] == ["find_unused_overhead", "data_loading"], causes
    assert [c["share"] for c in causes] == [round(0.03 / b["step_s"], 4), round(0.008 / b["step_s"], 4)]


def test_find_unused_parameters_is_needed_while_a_parameter_goes_unused():
    facts = _facts(find_unused=True)
    records = _records(find_unused_s=0.02)
    assert _first(records, facts)[0]["cause"] == "find_unused_overhead"
    records[1][2]["unused_params"] = 3  # one rank, one step: a parameter without a gradient
    causes, b = _causes(records, facts)
    assert b["unused_params"] == 3 and [c["cause"] for c in causes] == ["healthy"], causes


@pytest.mark.parametrize("find_unused_s,reported", [(0.0009, False), (0.0013, True)])
def test_needless_find_unused_is_reported_from_3_percent_of_the_step(find_unused_s, reported):
    causes, b = _causes(_records(find_unused_s=find_unused_s), _facts(find_unused=True))
    share = find_unused_s / b["step_s"]  # 2.5% and 3.6% of a 36 ms step
    assert [c["cause"] for c in causes] == (["find_unused_overhead"] if reported else ["healthy"]), (share, causes)


@pytest.mark.parametrize("data_s,reported", [(0.0033, False), (0.0042, True)])
def test_data_loading_is_reported_from_10_percent_of_the_step(data_s, reported):
    causes, b = _causes(_records(data_s=data_s))
    assert [c["cause"] for c in causes] == (["data_loading"] if reported else ["healthy"]), causes
    if reported:
        assert causes[0]["share"] == pytest.approx(data_s / b["step_s"], abs=1e-4)
