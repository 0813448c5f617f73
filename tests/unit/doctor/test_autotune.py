"""dist.bucket_cap_mb=auto: every rank tries the same sizes, agrees on the fastest, and keeps it."""

import pytest

from ddptrain.config import Config, ConfigError, validate
from ddptrain.ddp.buckets import MB
from ddptrain.doctor.autotune import CAPS_MB, STEPS_PER_CAP, BucketAutotune
from ddptrain.testing import run_threaded
from tests.doctor_tasks import DoctorTask, doctor_config


def _fit(rank, world_size, out):
    # 6 layers of 1.1 MB: 1, 5, 25 and 100 MB caps give 6, 2 (5 MB holds four), 1 and 1 buckets
    model = {"kind": "mlp", "layers": 6, "width": 512}
    config = doctor_config(out, model=model, dist={"bucket_cap_mb": "auto"}, batch=4)
    config.trainer.doctor = False
    config.trainer.max_steps = len(CAPS_MB) * (1 + STEPS_PER_CAP) + 2
    trainer = DoctorTask(config)
    trainer.fit()
    tune = next(c for c in trainer.callbacks if isinstance(c, BucketAutotune))
    return tune.chosen_mb, [len(t) for t in tune.times], trainer.model.reducer.bucket_cap_bytes, tune.caps_mb


@pytest.mark.timeout(120)
def test_every_rank_tries_every_size_and_keeps_the_same_choice(tmp_path):
    results = run_threaded(_fit, 2, tmp_path, timeout_s=100)
    chosen = {r[0] for r in results}
    assert len(chosen) == 1 and chosen.pop() in CAPS_MB
    for chosen_mb, counts, cap_bytes, tried in results:
        assert tried == (1.0, 5.0, 25.0)  # 100 MB gives 25 MB's single bucket: tried once
        assert counts == [STEPS_PER_CAP] * len(tried)
        assert cap_bytes == int(chosen_mb * MB)  # the reducer runs on with the chosen layout


def test_bucket_cap_accepts_auto_and_numbers_and_refuses_the_rest():
    for value in ("auto", 0.05, 25, "5"):
        config = Config.from_dict({"dist": {"bucket_cap_mb": value}})
        validate(config, 2)
        expected = 25.0 if value == "auto" else float(value)
        assert config.dist.ddp_options()["bucket_cap_mb"] == expected
    for value in ("fast", -1, True):
        with pytest.raises(ConfigError, match="dist.bucket_cap_mb=.* must be a number of MiB >= 0, or auto"):
            validate(Config.from_dict({"dist": {"bucket_cap_mb": value}}), 2)
