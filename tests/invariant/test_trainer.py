"""World-size-invariant mode (trainer.world_size_invariant): the Trainer on 1, 2, 4 and 8 threaded
ranks ends with the same parameters, bit for bit, and logs the same per-step losses — with dropout,
BatchNorm, tied weights, gradient accumulation, a short last batch, and a resume on another world size."""

import hashlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from ddptrain import Config, ConfigError, Trainer
from ddptrain.objects import instantiate
from ddptrain.testing import run_threaded
from tests.conftest import merged

# Threads share one process: every rank must build the same initial model without racing on the
# global generator, so the initial weights are made once here.
_INIT: dict[str, dict] = {}


def _initial_state(target: str) -> dict:
    if target not in _INIT:  # never in a rank's thread: they would race on the global generator
        torch.manual_seed(0)
        _INIT[target] = instantiate({"_target_": target}, "model", "").state_dict()
    return _INIT[target]


class ImagesTrainer(Trainer):
    """Random 28x28 images, 10 classes; ``num_train`` samples (not a multiple of the batch)."""

    num_train = 200

    def configure_model(self):
        model = instantiate(self.config.model, "model", "")
        model.load_state_dict(_INIT[self.config.model["_target_"]])
        return model

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(self.num_train, 1, 28, 28, generator=g)
        return TensorDataset(x, torch.randint(0, 10, (self.num_train,), generator=g))

    def val_dataloader(self):
        g = torch.Generator().manual_seed(1)
        return TensorDataset(torch.randn(30, 1, 28, 28, generator=g), torch.randint(0, 10, (30,), generator=g))


class BNTrainer(ImagesTrainer):
    num_train = 224  # 7 full batches: BatchNorm needs more than one sample per shard


def _config(tmp_path, model, invariant=True, **trainer):
    base = {
        "epochs": 2,
        "log_every_steps": 1,
        "progress": False,
        "loggers": {"tensorboard": False},
        "checkpoint": {"every_epochs": 0, "at_end": False},
        "output_dir": str(tmp_path),
        "world_size_invariant": invariant,
    }
    base = merged(base, trainer)
    _initial_state(model)  # here, in the test's thread
    return Config.from_dict(
        {
            "model": {"_target_": model},
            "data": {"global_batch_size": 32},
            "optimizer": {"lr": 0.05, "momentum": 0.5},
            "trainer": base,
        }
    )


def _fit(rank, world_size, trainer_class, config):
    trainer = trainer_class(config)
    final = trainer.fit()
    return final["params_sha256"], trainer.loss_history, final["step"]


def _params(rank, world_size, trainer_class, config):
    torch.set_num_threads(1)  # this thread's (as invariant mode's): small ops on 2 busy cores, fast
    trainer = trainer_class(config)
    trainer.fit()
    return {k: v.detach().clone() for k, v in trainer.model.module.state_dict().items()}, trainer.loss_history


def _assert_states_close(state, expected, **tolerance):
    assert state.keys() == expected.keys()
    for name, want in expected.items():
        torch.testing.assert_close(state[name], want, **tolerance, msg=lambda m, name=name: f"{name}: {m}")


def _runs(trainer_class, config, world_sizes=(1, 2, 4, 8)):
    results = {}
    for world_size in world_sizes:
        per_rank = run_threaded(_fit, world_size, trainer_class, config, timeout_s=120)
        assert len({r[0] for r in per_rank}) == 1, f"ranks disagree at world size {world_size}"
        results[world_size] = per_rank[0]
    return results


CASES = [
    pytest.param(ImagesTrainer, "ddptrain.recipes.mnist.Net", {}, id="dropout"),
    pytest.param(BNTrainer, "tests.models.BNNet", {}, id="batchnorm"),
    pytest.param(ImagesTrainer, "tests.models.TiedNet", {}, id="tied-weights"),
    pytest.param(ImagesTrainer, "ddptrain.recipes.mnist.Net", {"grad_accum_steps": 2}, id="dropout+accumulation"),
    pytest.param(BNTrainer, "tests.models.BNNet", {"grad_accum_steps": 2}, id="batchnorm+accumulation"),
]


@pytest.mark.parametrize(("trainer_class", "model", "extra"), CASES)
def test_the_same_bits_and_losses_on_1_2_4_and_8_ranks(tmp_path, trainer_class, model, extra):
    results = _runs(trainer_class, _config(tmp_path, model, **extra))
    digest, losses, steps = results[1]
    assert steps == 14 and len(losses) == 14  # 2 epochs of 7 steps, the last of each short for 200 samples
    for world_size, (other_digest, other_losses, _) in results.items():
        assert other_digest == digest, f"world size {world_size} ends with other parameters than 1"
        assert other_losses == losses, f"world size {world_size} logs other losses than 1"
    assert losses[-1][1] < losses[0][1] or model.endswith("mnist.Net")  # it learns (dropout: noisy)


def test_without_the_mode_the_world_size_changes_the_bits(tmp_path):
    """The check above can fail: plain DDP (float all-reduce, per-rank dropout seeds) differs."""
    results = _runs(ImagesTrainer, _config(tmp_path, "ddptrain.recipes.mnist.Net", invariant=False), (1, 2))
    assert results[1][0] != results[2][0]


def _final_state(rank, world_size, config):
    trainer = ImagesTrainer(config)
    trainer.fit()
    return {k: v.clone() for k, v in trainer.model.module.state_dict().items()}


@pytest.mark.parametrize("model", ["tests.models.Net", "tests.models.MixedNet"])
def test_the_gradient_is_the_global_batch_mean(tmp_path, model):
    """Without dropout, invariant mode trains what plain training trains, up to float rounding;
    float64 parameters too (their gradients do not land in the shards' float32 buffer)."""
    configs = [_config(tmp_path, model, invariant=i, epochs=1, max_steps=5) for i in (True, False)]
    invariant, plain = (run_threaded(_final_state, 1, c, timeout_s=60)[0] for c in configs)
    for name in plain:
        torch.testing.assert_close(invariant[name], plain[name], rtol=1e-4, atol=1e-6)


def test_a_parameter_no_shard_uses_gets_no_gradient(tmp_path):
    """BranchNet's branch and head are never used: with weight decay a zero gradient would shrink
    them; no gradient (None, as in plain training) leaves them as they were."""
    config = _config(tmp_path, "tests.models.BranchNet", epochs=1, max_steps=3)
    config.optimizer.weight_decay = 0.1
    initial = _INIT["tests.models.BranchNet"]
    for rank_state in run_threaded(_final_state, 2, config, timeout_s=60):
        for name in ("branch.weight", "branch.bias", "never.weight", "never.bias"):
            assert torch.equal(rank_state[name], initial[name]), name
        assert not torch.equal(rank_state["fc1.weight"], initial["fc1.weight"])  # the used ones train


def _first_step_shards(trainer) -> torch.Tensor:
    """The inputs of the first step's 8 shards of 4 (global batch 32, the sampler's first epoch
    order: trainer.seed 1234 + epoch 0), flattened: ``[8, 4, 784]``."""
    data = trainer.train_dataloader()
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(1234))[:32]
    return data.tensors[0][order].view(8, 4, -1)


def test_batchnorm_running_stats_take_the_mean_of_the_shards_statistics(tmp_path):
    """One step from fresh stats: running_mean = (1 - m) * 0 + m * mean over the 8 shards of their batch means."""

    config = _config(tmp_path, "tests.models.BNNet", epochs=1, max_steps=1)

    def body(rank, world_size):
        trainer = BNTrainer(config)
        module = trainer.configure_model()
        with torch.no_grad():
            features = module.fc1(_first_step_shards(trainer).reshape(32, -1))
        expected = 0.1 * features.view(8, 4, -1).mean(dim=1).mean(dim=0)
        trainer.fit()
        return trainer.model.module.bn.running_mean.clone(), expected, int(trainer.model.module.bn.num_batches_tracked)

    for running_mean, expected, tracked in run_threaded(body, 2, timeout_s=60):
        torch.testing.assert_close(running_mean, expected, rtol=1e-5, atol=1e-6)
        assert tracked == 1  # one update per step, not one per shard


def test_float64_running_stats_keep_float64_precision(tmp_path):
    """A float64 buffer is summed as float64 (a float32 row would round each shard's running mean
    to float32 first: off by ~1e-8 relative, far over this tolerance)."""

    config = _config(tmp_path, "tests.models.Float64BNNet", epochs=1, max_steps=1)

    def body(rank, world_size):
        trainer = BNTrainer(config)
        module = trainer.configure_model()
        with torch.no_grad():  # shard by shard, as the fit computes them: float32's bits
            shards = _first_step_shards(trainer)
            per_shard = torch.stack([0.1 * module.fc1(shard).double().mean(dim=0) for shard in shards])
        trainer.fit()
        return trainer.model.module.bn.running_mean.clone(), per_shard

    for running_mean, per_shard in run_threaded(body, 2, timeout_s=60):
        assert running_mean.dtype == torch.float64
        # the exact mean of the shards' float64 values, to float64's precision
        torch.testing.assert_close(running_mean, per_shard.mean(dim=0), rtol=1e-13, atol=1e-15)
        assert not torch.equal(running_mean, per_shard.float().double().mean(dim=0))  # float32's differs


def test_float64_parameters_get_float64_gradients(tmp_path):
    """MixedNet's float64 layer: after one SGD step its weight is ``w - lr * g``, g the float64 sum
    of the 8 shards' gradients (each ``training_step`` loss weighted 4/32), to float64's precision.
    Rounding each shard's gradient to float32 is off by ~1e-8 relative, far over this tolerance."""
    config = _config(tmp_path, "tests.models.MixedNet", epochs=1, max_steps=1)

    def body(rank, world_size):
        trainer = ImagesTrainer(config)
        module = trainer.configure_model()
        data = trainer.train_dataloader()
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(1234))[:32]
        for images, labels in zip(data.tensors[0][order].view(8, 4, 1, 28, 28), data.tensors[1][order].view(8, 4)):
            (trainer.training_step(module, (images, labels)) * (4 / 32)).backward()  # shard by shard
        expected = module.fc2.weight.detach() - config.optimizer.lr * module.fc2.weight.grad
        trainer.fit()
        return trainer.model.module.fc2.weight.detach().clone(), expected

    for weight, expected in run_threaded(body, 2, timeout_s=60):
        assert weight.dtype == torch.float64
        torch.testing.assert_close(weight, expected, rtol=1e-13, atol=1e-15)


def test_a_loss_that_is_not_one_number_is_refused_by_name(tmp_path):
    class PerSample(ImagesTrainer):
        def training_step(self, model, batch):
            images, labels = batch
            return F.nll_loss(model(images), labels, reduction="none")

    config = _config(tmp_path, "tests.models.Net", epochs=1, max_steps=1)
    with pytest.raises(RuntimeError, match=r"training_step must return the loss as one number.*shape \(4,\)"):
        run_threaded(_fit, 2, PerSample, config, timeout_s=60)


def _stop_then_resume(rank, world_size, config):
    trainer = ImagesTrainer(config)
    return trainer.fit()["params_sha256"], trainer.loss_history


def test_stop_at_2_ranks_mid_epoch_then_resume_at_4_continues_bitwise(tmp_path):
    """No trainer.allow_world_size_change: invariant mode's bits do not depend on the world size."""
    model = "ddptrain.recipes.mnist.Net"
    whole = run_threaded(_fit, 2, ImagesTrainer, _config(tmp_path / "whole", model), timeout_s=120)[0]
    first = _config(tmp_path / "run", model, stop_after_steps=10, checkpoint={"at_end": True})
    run_threaded(_fit, 2, ImagesTrainer, first, timeout_s=120)  # epoch 2, step 3 of 7
    second = _config(tmp_path / "run", model, resume=str(tmp_path / "run"))
    digest, losses = run_threaded(_stop_then_resume, 4, second, timeout_s=120)[0]
    assert digest == whole[0] and losses == whole[1]


def test_a_world_size_that_does_not_divide_virtual_ranks_is_a_config_error(tmp_path):
    config = _config(tmp_path, "tests.models.Net", virtual_ranks=4)
    with pytest.raises(ConfigError) as err:
        run_threaded(_fit, 8, ImagesTrainer, config, timeout_s=60)
    text = str(err.value)
    assert "dist.world_size=8" in text and "trainer.virtual_ranks=4" in text and "[1, 2, 4]" in text


def test_any_number_of_virtual_ranks_that_the_world_sizes_divide(tmp_path):
    """V=6 at W=1, 2, 3: shards of 4 samples, 3 per rank at W=2, 2 at W=3."""
    config = _config(tmp_path, "tests.models.Net", epochs=1, virtual_ranks=6)
    config.data.global_batch_size = 24  # every rank the same number of samples at 1, 2 and 3
    results = _runs(ImagesTrainer, config, (1, 2, 3))
    assert results[1] == results[2] == results[3]


def test_a_training_step_of_the_users_own_is_used_per_shard(tmp_path):
    """The user's loss is twice the default's: the parameters are those of plain training with the
    same training_step (equal at 1 and 4 ranks), measurably not those of the default one."""

    class Weighted(ImagesTrainer):
        def training_step(self, model, batch):
            images, labels = batch
            return F.nll_loss(model(images), labels) * 2.0

    config = _config(tmp_path / "invariant", "tests.models.Net", epochs=1)
    (one, losses), (four, other_losses) = (run_threaded(_params, w, Weighted, config, timeout_s=60)[0] for w in (1, 4))
    assert all(torch.equal(one[name], four[name]) for name in one) and losses == other_losses
    plain = {}
    for trainer_class in (Weighted, ImagesTrainer):
        config = _config(tmp_path / trainer_class.__name__, "tests.models.Net", False, epochs=1)
        plain[trainer_class] = run_threaded(_params, 1, trainer_class, config, timeout_s=60)[0][0]
    _assert_states_close(one, plain[Weighted], rtol=0, atol=1e-6)
    assert (one["fc1.weight"] - plain[ImagesTrainer]["fc1.weight"]).abs().max() > 1e-3


def test_the_cli_check_names_w_must_divide_v_before_the_batch_rule():
    """dist.world_size=3 does not divide the global batch of 128 either: the mode's rule is named first."""
    from ddptrain.preflight import validate

    config = Config.from_dict({"trainer": {"world_size_invariant": True}})
    with pytest.raises(ConfigError, match=r"W must divide V.*dist.world_size=3 and trainer.virtual_ranks=8"):
        validate(config, 3)


# == against references over whole epochs (the short last batch included) =======================
class DropoutMLP(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(5)  # its own generator: ranks that are threads share the global one
        self.fc1, self.fc2 = nn.Linear(784, 32), nn.Linear(32, 10)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)

    def forward(self, x):
        return F.log_softmax(self.fc2(F.dropout(F.relu(self.fc1(x.view(len(x), -1))), 0.5, self.training)), dim=1)


class DropoutTrainer(ImagesTrainer):
    def configure_model(self):
        return DropoutMLP()


def _documented_shard_seed(seed, epoch, step, shard):
    """invariant.shard_seed's documented hash of ``(seed, epoch, step, shard)``, written out here: a
    shard_seed that ignores one of them must not also change the reference."""
    digest = hashlib.blake2b(f"{seed}:{epoch}:{step}:{shard}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _invariant_reference(trainer_class, config):
    """The mode's semantics as a plain loop: each step's global batch ``[k*G, (k+1)*G)`` of the
    epoch's order (randperm seeded with seed + epoch) cut by ``tensor_split`` into 8 shards; each
    shard's forward under torch.manual_seed(shard_seed(seed, epoch, global step, shard)); the
    gradient of ``sum of shard_mean * shard_size / step_size``; SGD with momentum."""
    trainer = trainer_class(config)
    model, (x, y) = trainer.configure_model(), trainer.train_dataloader().tensors
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=config.optimizer.lr, momentum=config.optimizer.momentum)
    seed, batch, step, losses = config.trainer.seed, config.data.global_batch_size, 0, []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with torch.random.fork_rng():
        for epoch in range(config.trainer.epochs):
            order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed + epoch))
            for start in range(0, len(x), batch):
                index, loss_sum = order[start : start + batch], 0.0
                opt.zero_grad()
                for shard, part in enumerate(torch.tensor_split(index, config.trainer.virtual_ranks)):
                    if len(part) == 0:
                        continue
                    torch.default_generator.manual_seed(_documented_shard_seed(seed, epoch, step, shard))
                    loss = F.cross_entropy(model(x[part]), y[part])
                    (loss * (len(part) / len(index))).backward()
                    loss_sum += float(loss.detach()) * len(part)
                opt.step()
                step += 1
                losses.append((step, loss_sum / len(index)))
    torch.set_num_threads(threads)
    return model.state_dict(), losses


@pytest.mark.parametrize("world_size", [1, 2])
def test_dropout_over_whole_epochs_follows_the_per_shard_seeds_and_the_step_mean(tmp_path, world_size):
    """2 epochs of 200 samples in global batches of 32: 7 steps each, the last of 8 samples (8
    shards of 1). A shard seed without the step (the same masks every step) or a short batch's
    shards weighted by size / global batch (a quarter of its gradient) both leave the reference."""
    config = _config(tmp_path, "tests.models.Net")
    expected, expected_losses = _invariant_reference(DropoutTrainer, config)
    for state, losses in run_threaded(_params, world_size, DropoutTrainer, config, timeout_s=120):
        _assert_states_close(state, expected, rtol=1e-4, atol=1e-6)
        assert [s for s, _ in losses] == [s for s, _ in expected_losses] == list(range(1, 15))
        for (_, got), (_, want) in zip(losses, expected_losses):
            assert got == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("world_size", [1, 2])
def test_without_dropout_a_whole_epoch_trains_what_plain_training_trains(tmp_path, world_size):
    """Plain single-process training over a whole epoch (its short last batch of 8 a mean over 8)."""
    model = "tests.models.Net"
    plain = run_threaded(_params, 1, ImagesTrainer, _config(tmp_path / "plain", model, False, epochs=1), timeout_s=60)
    config = _config(tmp_path / "invariant", model, epochs=1)
    for state, _ in run_threaded(_params, world_size, ImagesTrainer, config, timeout_s=60):
        _assert_states_close(state, plain[0][0], rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ({"trainer": {"doctor": True}}, "trainer.doctor=true"),
        ({"dist": {"bucket_cap_mb": "auto"}}, "dist.bucket_cap_mb=auto"),
    ],
)
def test_what_measures_ddps_buckets_is_refused_naming_why(override, named):
    """Invariant mode sends no bucket: the doctor (whose probe once failed on its steps with a
    TypeError) and the bucket autotune would measure nothing of what the run does."""
    from ddptrain.preflight import validate

    raw = {"dist": override.get("dist", {}), "trainer": {"world_size_invariant": True, **override.get("trainer", {})}}
    with pytest.raises(ConfigError) as err:
        validate(Config.from_dict(raw), 2)
    message = str(err.value)
    assert message.startswith(f"trainer.world_size_invariant=true cannot be combined with {named}"), message
    assert "outside DDP's buckets" in message or "sends none" in message, message
