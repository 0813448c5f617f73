"""``dist.grad_compression=bf16|fp16`` in the Trainer, on the threaded group.

At two ranks the two paths that compress must agree bit for bit: plain DDP's bf16 compression
hook (divide, cast, one addition) and ZeRO's bf16 reduce-scatter (the same division, cast and
addition). Both must differ from the uncompressed fit, or nothing was compressed. What
compression cannot be combined with is refused before any process starts.
"""

import copy

import pytest
import torch

from ddptrain import Config
from ddptrain.config import ConfigError
from ddptrain.preflight import validate
from ddptrain.testing import run_threaded
from tests.zero.test_trainer import Task

pytestmark = pytest.mark.timeout(300)


def _fit(rank, world_size, out, compression, zero_stage):
    config = Config.from_dict(
        {
            "data": {"global_batch_size": 24},
            "dist": {"grad_compression": compression, "zero_stage": zero_stage, "bucket_cap_mb": 0.0002},
            "optimizer": {"name": "adamw", "lr": 0.01},
            "trainer": {"epochs": 2, "progress": False, "loggers": {"tensorboard": False}, "output_dir": str(out)},
        }
    )
    task = Task(config)
    task.fit()
    return [p.detach().clone() for p in task.model.module.parameters()]


def test_bf16_compression_is_the_same_through_plain_ddps_hook_and_zeros_reduce_scatter(tmp_path):
    plain = run_threaded(_fit, 2, tmp_path / "none", "none", 0, timeout_s=120)
    hook = run_threaded(_fit, 2, tmp_path / "hook", "bf16", 0, timeout_s=120)
    zero = run_threaded(_fit, 2, tmp_path / "zero", "bf16", 2, timeout_s=120)
    assert all(torch.equal(a, b) for a, b in zip(hook[0], hook[1])), "ranks diverged"
    assert all(torch.equal(a, b) for a, b in zip(hook[0], zero[0])), "the hook and ZeRO compressed differently"
    assert not all(torch.equal(a, b) for a, b in zip(hook[0], plain[0])), "nothing was compressed"
    for a, b in zip(hook[0], plain[0]):  # ... and only rounded: training went the same way
        assert (a - b).abs().max() < 0.05 * b.abs().max()


def test_fp16_compression_trains_like_the_uncompressed_fit(tmp_path):
    plain = run_threaded(_fit, 2, tmp_path / "none", "none", 0, timeout_s=120)
    fp16 = run_threaded(_fit, 2, tmp_path / "fp16", "fp16", 1, timeout_s=120)
    assert not all(torch.equal(a, b) for a, b in zip(fp16[0], plain[0])), "nothing was compressed"
    for a, b in zip(fp16[0], plain[0]):
        assert (a - b).abs().max() < 0.05 * b.abs().max()


@pytest.mark.parametrize(
    "override, message",
    [
        (
            {"dist": {"algorithm": "ring"}},
            "dist.grad_compression=bf16 cannot be combined with dist.algorithm=ring: plain DDP sends its buckets "
            "either through the ring or through the compression hook",
        ),
        (
            {"trainer": {"world_size_invariant": True}},
            "cannot be combined with trainer.world_size_invariant=true: invariant mode sums exact integer gradients",
        ),
        ({"trainer": {"doctor": True}}, "cannot be combined with trainer.doctor=true: the doctor's model"),
    ],
)
def test_what_compression_cannot_be_combined_with_is_refused_with_the_reason(override, message):
    data = {"dist": {"grad_compression": "bf16"}, "trainer": {}}
    for section, values in override.items():
        data[section] = {**data.get(section, {}), **values}
    with pytest.raises(ConfigError) as err:
        validate(Config.from_dict(copy.deepcopy(data)), 2)
    assert message in str(err.value)
    assert "or set dist.grad_compression=none" in str(err.value)


def test_the_ring_compresses_under_zero_and_an_unknown_dtype_is_refused_with_the_choices():
    validate(Config.from_dict({"dist": {"grad_compression": "bf16", "algorithm": "ring", "zero_stage": 1}}), 2)
    with pytest.raises(ConfigError, match="dist.grad_compression='int8' is not one of none, bf16, fp16"):
        validate(Config.from_dict({"dist": {"grad_compression": "int8"}}), 2)
