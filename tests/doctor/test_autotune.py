"""dist.bucket_cap_mb=auto: every rank tries the same sizes, agrees on the fastest, and keeps it."""

import statistics

import pytest

from ddptrain.config import Config, ConfigError
from ddptrain.ddp.buckets import MB
from ddptrain.doctor.autotune import STEPS_PER_CAP, BucketAutotune, candidate_caps
from ddptrain.preflight import validate
from ddptrain.testing import run_threaded
from ddptrain.trainer.building import ddp_options
from tests.doctor.tasks import DoctorTask, doctor_config


def test_the_sizes_tried_include_fractions_of_a_small_model():
    six_mib = 6 * 2**20
    assert candidate_caps(six_mib) == (0.75, 1.0, 1.5, 3.0, 5.0, 25.0, 100.0)
    assert candidate_caps(800 * 2**20) == (1.0, 5.0, 25.0, 100.0, 200.0, 400.0)


# the task's MLP: 6 layers of 1 MiB + 2 KiB (weight and bias) and a small head, ~6.03 MiB
CANDIDATES = candidate_caps(6 * (512 * 512 + 512) * 4 + (512 * 10 + 10) * 4)


def _fit(rank, world_size, out):
    model = {"kind": "mlp", "layers": 6, "width": 512}
    config = doctor_config(out, model=model, dist={"bucket_cap_mb": "auto"}, batch=4)
    config.trainer.doctor = False
    config.trainer.max_steps = len(CANDIDATES) * (1 + STEPS_PER_CAP) + 2
    trainer = DoctorTask(config)
    trainer.fit()
    tune = next(c for c in trainer.callbacks if isinstance(c, BucketAutotune))
    return tune.chosen_mb, tune.times, trainer.model.reducer.bucket_cap_bytes, tune.caps_mb


@pytest.mark.timeout(120)
def test_every_rank_tries_every_size_and_keeps_the_same_choice(tmp_path):
    results = run_threaded(_fit, 2, tmp_path, timeout_s=100)
    chosen = {r[0] for r in results}
    assert len(chosen) == 1 and chosen.pop() in CANDIDATES
    for chosen_mb, times, cap_bytes, tried in results:
        # 1 MB gives 0.75's buckets (one layer each); 25 and 100 MB give 5's (after the first bucket
        # of 1 MB, the five layers left fill 5 MB): each layout tried once
        assert tried == (CANDIDATES[0], *CANDIDATES[2:-2]), tried
        assert [len(t) for t in times] == [STEPS_PER_CAP] * len(tried)
        assert cap_bytes == int(chosen_mb * MB)  # the reducer runs on with the chosen layout
    # the size whose slowest rank's median step is the shortest
    slowest = [max(statistics.median(r[1][i]) for r in results) for i in range(len(results[0][3]))]
    assert results[0][0] == results[0][3][slowest.index(min(slowest))]


def _choose(rank, world_size, out, medians):
    model = {"kind": "mlp", "layers": 6, "width": 512}
    config = doctor_config(out, model=model, dist={"bucket_cap_mb": "auto"}, batch=4)
    config.trainer.doctor, config.trainer.max_steps = False, 1
    trainer = DoctorTask(config)
    trainer.fit()
    tune = next(c for c in trainer.callbacks if isinstance(c, BucketAutotune))
    tune.caps_mb = (CANDIDATES[0], CANDIDATES[2], CANDIDATES[3])  # three layouts of their own
    tune.times = [[m] * STEPS_PER_CAP for m in medians[rank]]  # this rank's step times for each size
    tune._choose(trainer)
    return tune.chosen_mb, trainer.model.reducer.bucket_cap_bytes


@pytest.mark.timeout(120)
def test_ranks_that_timed_different_sizes_fastest_agree_on_the_one_fastest_for_the_slowest_rank(tmp_path):
    # alone, rank 0 would keep the first size and rank 1 the second; the job goes at its slowest
    # rank's pace (45, 40, 35 ms): both keep the third (the ranks' mean would pick the second)
    medians = [[0.010, 0.040, 0.035], [0.045, 0.012, 0.035]]
    results = run_threaded(_choose, 2, tmp_path, medians, timeout_s=100)
    assert results == [(CANDIDATES[3], int(CANDIDATES[3] * MB))] * 2


def test_bucket_cap_accepts_auto_and_numbers_and_refuses_the_rest():
    for value in ("auto", 0.05, 25, "5"):
        config = Config.from_dict({"dist": {"bucket_cap_mb": value}})
        validate(config, 2)
        expected = 25.0 if value == "auto" else float(value)
        assert ddp_options(config.dist)["bucket_cap_mb"] == expected
    for value in ("fast", -1, True):
        with pytest.raises(ConfigError, match="dist.bucket_cap_mb=.* must be a number of MiB >= 0, or auto"):
            validate(Config.from_dict({"dist": {"bucket_cap_mb": value}}), 2)
