"""trainer.precision: bf16 autocast on CPU through our DDP (native and ring all-reduce), float32
parameters and gradients, ranks in agreement; 16-mixed refused on CPU; on CUDA (when present)
16-mixed scales the loss and its scaler state survives a checkpoint."""

import pytest
import torch
import torch.nn.functional as F

from ddptrain import Callback, ConfigError
from ddptrain.config import Config
from ddptrain.preflight import validate
from ddptrain.testing import run_threaded
from ddptrain.trainer.checkpoint import load_checkpoint
from ddptrain.trainer.precision import Precision

from .test_trainer import FixedInitTrainer, _config


class Watch(FixedInitTrainer):
    """Records what autocast does inside the steps."""

    def training_step(self, model, batch):
        x, y = batch
        logits = model(x)
        self.seen.add(("train", logits.dtype, torch.is_autocast_enabled("cpu")))
        return F.cross_entropy(logits, y)

    def validation_step(self, model, batch):
        self.seen.add(("val", model(batch[0]).dtype))
        return super().validation_step(model, batch)

    def setup(self):
        self.seen = set()
        super().setup()


class GradDtypes(Callback):
    def __init__(self):
        self.dtypes = set()

    def on_train_batch_end(self, trainer, loss):
        self.dtypes |= {p.dtype for p in trainer.model.parameters()}


def _fit(rank, world_size, config):
    grads = GradDtypes()
    trainer = Watch(config, callbacks=[grads])
    final = trainer.fit()
    return trainer.seen, grads.dtypes, final


@pytest.mark.parametrize("algorithm", ["native", "ring"])
def test_bf16_mixed_trains_through_our_ddp_on_cpu(tmp_path, algorithm):
    config = _config(tmp_path, data={"global_batch_size": 12}, precision="bf16-mixed")
    config.dist.algorithm = algorithm
    results = run_threaded(_fit, 2, config, timeout_s=120)
    reference = _fit(0, 1, _config(tmp_path / "fp32", data={"global_batch_size": 12}))[2]
    for seen, dtypes, final in results:
        assert seen == {("train", torch.bfloat16, True), ("val", torch.bfloat16)}
        assert dtypes == {torch.float32}  # parameters (and so gradients, optimizer states) stay float32
        assert final["params_agree"] and final["train/loss_last"] < final["train/loss_first"]
        assert final["eval/loss"] == pytest.approx(reference["eval/loss"], rel=0.05)  # close to float32
        assert final["eval/loss"] != reference["eval/loss"]  # ... and not float32 itself
    assert results[0][2]["params_sha256"] == results[1][2]["params_sha256"]


def test_bf16_mixed_checkpoints_hold_no_scaler_and_resume_exactly(tmp_path):
    kwargs = {"data": {"global_batch_size": 12}, "precision": "bf16-mixed", "checkpoint": {"every_steps": 3}}
    straight = FixedInitTrainer(_config(tmp_path / "straight", **kwargs)).fit()
    FixedInitTrainer(_config(tmp_path / "mid", stop_after_steps=3, **kwargs)).fit()
    assert load_checkpoint(tmp_path / "mid" / "checkpoints" / "step_000000003.pt")["grad_scaler"] is None
    resumed = FixedInitTrainer(_config(tmp_path / "mid", resume="latest", **kwargs)).fit()
    assert resumed["params_sha256"] == straight["params_sha256"]


def test_16_mixed_on_cpu_is_refused_with_the_fix(tmp_path):
    expected = r"needs trainer.device=cuda \(float16 .* On CPU use trainer.precision=bf16-mixed"
    with pytest.raises(ConfigError, match=expected):
        FixedInitTrainer(_config(tmp_path, precision="16-mixed")).fit()
    with pytest.raises(ConfigError, match="trainer.precision=16-mixed needs trainer.device=cuda"):
        validate(Config.from_dict({"trainer": {"precision": "16-mixed"}}), 1)
    with pytest.raises(ConfigError, match="trainer.precision='fp8' is not one of 32, bf16-mixed, 16-mixed"):
        validate(Config.from_dict({"trainer": {"precision": "fp8"}}), 1)
    assert Config.from_dict({"trainer": {"precision": 32}}).trainer.precision == "32"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="16-mixed needs CUDA")
def test_16_mixed_on_cuda_scales_and_checkpoints_the_scaler(tmp_path):
    kwargs = {
        "data": {"global_batch_size": 12},
        "precision": "16-mixed",
        "device": "cuda",
        "checkpoint": {"every_steps": 3},
    }
    config = _config(tmp_path / "mid", stop_after_steps=3, **kwargs)
    config.dist.backend = "nccl"
    FixedInitTrainer(config).fit()
    saved = load_checkpoint(tmp_path / "mid" / "checkpoints" / "step_000000003.pt")
    assert saved["grad_scaler"]["scale"] > 1 and saved["grad_scaler"]["_growth_tracker"] == 3
    precision = Precision("16-mixed", torch.device("cuda"))
    precision.load_state_dict(saved["grad_scaler"])
    assert precision.scaler.get_scale() == saved["grad_scaler"]["scale"]


def test_bf16_mixed_applies_in_world_size_invariant_mode(tmp_path):
    config = _config(tmp_path, data={"global_batch_size": 16}, precision="bf16-mixed", world_size_invariant=True)
    for seen, dtypes, final in run_threaded(_fit, 2, config, timeout_s=120):
        assert ("train", torch.bfloat16, True) in seen and ("train", torch.float32, False) not in seen
        assert dtypes == {torch.float32} and final["params_agree"]


class ScaledOnCpu(FixedInitTrainer):
    """16-mixed's loss scaling without CUDA: a CPU GradScaler in the fit's Precision (float32 forward)."""

    def setup(self):
        super().setup()
        self.precision.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)


def _clipped_reference(config, steps):
    """SGD on the sampler's global batches, each step's gradient clipped to norm ``grad_clip_norm``."""
    model = FixedInitTrainer(config).configure_model()
    x, y = FixedInitTrainer(config).train_dataloader().tensors
    optimizer = torch.optim.SGD(model.parameters(), lr=config.optimizer.lr)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(config.trainer.seed))
    batch, norms = config.data.global_batch_size, []
    for step in range(steps):
        index = order[step * batch : (step + 1) * batch]
        optimizer.zero_grad()
        F.cross_entropy(model(x[index]), y[index]).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), config.trainer.grad_clip_norm)))
        optimizer.step()
    return model.state_dict(), norms


def test_gradients_are_unscaled_before_clipping(tmp_path):
    """With a scale of 4096, clipping the still-scaled gradients to norm 0.05 (unscaling after, or
    in the scaler's step) would leave steps 4096 times too small; the parameters are those of
    plain SGD with the true gradients clipped."""
    config = _config(tmp_path, grad_clip_norm=0.05, max_steps=3)
    trainer = ScaledOnCpu(config)
    trainer.fit()
    expected, norms = _clipped_reference(config, 3)
    assert min(norms) > 0.05 * 4  # the clip is active at every step, by far
    assert trainer.precision.scaler.get_scale() == 2.0**12  # no inf/NaN skipped a step
    for name, value in trainer.model.module.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6)
