"""The link model: the ring's alpha-beta cost, the fit of a sweep, nccl-tests' busbw."""

import pytest

from ddptrain.doctor.link import LinkModel, link_summary, sweep
from ddptrain.testing import run_threaded


def test_ring_cost_is_2p_minus_1_latencies_and_2p_minus_1_over_p_of_the_bytes():
    link = LinkModel(alpha_s=1e-4, bandwidth_Bps=1e9)
    assert link.allreduce_s(0, 1) == 0.0
    assert link.allreduce_s(1e9, 2) == pytest.approx(2 * 1e-4 + 1.0)
    assert link.allreduce_s(1e9, 4) == pytest.approx(6 * 1e-4 + 1.5)
    assert link.with_gbps(80).bandwidth_Bps == pytest.approx(1e10)
    assert link.with_gbps(None) is link


@pytest.mark.parametrize("p", [2, 3, 8])
def test_fit_recovers_alpha_and_bandwidth_of_a_ring(p):
    truth = LinkModel(alpha_s=3e-5, bandwidth_Bps=2.5e9)
    rows = [{"bytes": n, "time_s": truth.allreduce_s(n, p)} for n in (4096, 65536, 1 << 20, 16 << 20)]
    fitted = LinkModel.fit(rows, p)
    assert fitted.alpha_s == pytest.approx(truth.alpha_s, rel=1e-6)
    assert fitted.bandwidth_Bps == pytest.approx(truth.bandwidth_Bps, rel=1e-6)


def test_one_slow_small_size_does_not_make_the_latency_of_every_collective():
    truth = LinkModel(alpha_s=1e-4, bandwidth_Bps=1e9)
    rows = [{"bytes": n, "time_s": truth.allreduce_s(n, 2)} for n in (4096, 65536, 1 << 20, 16 << 20)]
    rows[0]["time_s"] *= 15  # the machine hiccuped while the 4 KiB all-reduces ran (seen: 3.5 ms for 0.4)
    fitted = LinkModel.fit(rows, 2)
    assert fitted.alpha_s == pytest.approx(truth.alpha_s, rel=0.05)


def test_sweep_reports_algbw_and_busbw_as_nccl_tests_define_them():
    def body(rank, world_size):
        from ddptrain.comm import get_process_group

        return sweep(get_process_group(), sizes=(4096, 65536), repeats=2)

    rows = run_threaded(body, 3, timeout_s=60)
    assert rows[0] == rows[1] == rows[2]  # every rank agrees on the sweep (its max over ranks)
    for row in rows[0]:
        assert row["algbw_GBps"] == pytest.approx(row["bytes"] / row["time_s"] / 1e9)
        assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * 2 * 2 / 3)
    summary = link_summary(rows[0], LinkModel.fit(rows[0], 3))
    assert summary["busbw_GBps"] == rows[0][-1]["busbw_GBps"] and summary["latency_s"] > 0
