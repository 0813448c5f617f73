"""The Trainer in one process (a job of one): hooks, callbacks, data wiring, the smoke check."""

import pytest
import torch
from torch.utils.data import TensorDataset

from ddptrain import Callback, Config, SmokeCheckError, Trainer
from ddptrain.data import DistributedSampler, SyntheticClassification
from ddptrain.trainer.data import TensorBatches, batch_size_of, preload


def _config(tmp_path, **trainer):
    base = {
        "epochs": 2,
        "log_every_steps": 2,
        "progress": False,
        "tensorboard": False,
        "checkpoint_every_epochs": 0,
        "checkpoint_at_end": False,
        "output_dir": str(tmp_path),
    }
    base.update(trainer)
    return Config.from_dict(
        {
            "model": {"_target_": "torch.nn.Linear", "in_features": 8, "out_features": 3},
            "data": {"global_batch_size": 10, "eval_batch_size": 7},
            "optimizer": {"lr": 0.5, "momentum": 0.0},
            "trainer": base,
        }
    )


class TinyTrainer(Trainer):
    """A user's subclass: its own data and model (no files, no torchvision)."""

    def train_dataset(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(40, 8, generator=g)
        return TensorDataset(x, x[:, :3].argmax(1))

    def val_dataset(self):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(13, 8, generator=g)
        return TensorDataset(x, x[:, :3].argmax(1))


class Recorder(Callback):
    def __init__(self):
        self.calls = []

    def on_fit_start(self, trainer):
        self.calls.append("fit_start")

    def on_epoch_start(self, trainer, epoch):
        self.calls.append(f"epoch_start{epoch}")

    def on_train_batch_end(self, trainer, loss):
        self.calls.append("batch")

    def on_log(self, trainer, scalars):
        self.calls.append(f"log@{trainer.state.step}")
        assert set(scalars) == {"train/loss", "train/lr", "train/samples_per_s", "train/comm_wait_s"}

    def on_validation_end(self, trainer, metrics):
        self.calls.append("validation")

    def on_epoch_end(self, trainer, epoch, metrics):
        self.calls.append(f"epoch_end{epoch}")

    def on_fit_end(self, trainer, metrics):
        self.calls.append("fit_end")


def test_fit_in_one_process_calls_hooks_in_order(tmp_path):
    recorder = Recorder()
    trainer = TinyTrainer(_config(tmp_path), callbacks=[recorder])
    metrics = trainer.fit()
    assert recorder.calls == (
        [
            "fit_start",
            "epoch_start0",
            "batch",
            "batch",
            "log@2",
            "batch",
            "batch",
            "log@4",
            "validation",
            "epoch_end0",
            "epoch_start1",
            "batch",
            "batch",
            "log@6",
            "batch",
            "batch",
            "log@8",
            "validation",
            "epoch_end1",
            "fit_end",
        ]
    )
    assert metrics["step"] == 8 and metrics["epoch"] == 2 and metrics["world_size"] == 1
    assert metrics["eval/samples"] == 13 and 0.0 <= metrics["eval/accuracy"] <= 1.0
    assert metrics["train/loss_last"] < metrics["train/loss_first"]
    assert (tmp_path / "metrics.json").is_file()
    assert not torch.distributed.is_initialized()


def test_max_steps_and_grad_accumulation(tmp_path):
    trainer = TinyTrainer(_config(tmp_path, max_steps=3, grad_accum_steps=2))
    metrics = trainer.fit()
    # 10 samples per step in micro-batches of 5: 3 steps consumed 30 of the epoch's 40 samples.
    assert metrics["step"] == 3 and trainer.state.samples_in_epoch == 30 and trainer.batch_size == 5
    assert "eval/accuracy" in metrics  # evaluated at the end although the epoch did not finish


def test_smoke_check_fails_when_loss_does_not_fall(tmp_path):
    config = _config(tmp_path, smoke_check=True, max_steps=4)
    config.optimizer.lr = 1e-12  # nothing moves
    with pytest.raises(SmokeCheckError, match="the training loss did not fall"):
        TinyTrainer(config).fit()


def test_custom_validation_step_must_return_per_sample_values(tmp_path):
    class Bad(TinyTrainer):
        def validation_step(self, model, batch):
            return {"loss": torch.tensor(1.0)}

    with pytest.raises(ValueError, match="one value per sample"):
        Bad(_config(tmp_path, epochs=1)).fit()


def test_preload_and_tensor_batches_follow_the_sampler():
    synthetic = SyntheticClassification(30, input_shape=(4,), seed=2)
    tensors = preload(synthetic)
    assert tensors.tensors[0] is synthetic.data  # no copy for tensor-backed datasets
    sampler = DistributedSampler(tensors, num_replicas=2, rank=1, shuffle=True, seed=5)
    sampler.set_epoch(3)
    batches = list(TensorBatches(tensors, sampler, 4))
    assert [batch_size_of(b) for b in batches] == [4, 4, 4, 3]
    expected = sampler.epoch_indices()
    assert torch.equal(torch.cat([b[1] for b in batches]), synthetic.targets[expected])

    class Items(torch.utils.data.Dataset):
        def __len__(self):
            return 3

        def __getitem__(self, i):
            return torch.full((2,), float(i)), i

    stacked = preload(Items())
    assert stacked.tensors[0].shape == (3, 2) and stacked.tensors[1].tolist() == [0, 1, 2]


def test_run_refuses_a_launcher_that_did_not_start_us(monkeypatch):
    from ddptrain import ConfigError, run

    for var in (
        "RANK",
        "WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RUN_ID",
        "OMPI_COMM_WORLD_RANK",
        "PMI_RANK",
        "SLURM_PROCID",
    ):
        monkeypatch.delenv(var, raising=False)
    config = Config.from_dict({"launcher": {"name": "torchrun"}})
    with pytest.raises(
        ConfigError,
        match=r"launcher=torchrun, but this process was not started by torchrun.*"
        r"torchrun --nproc-per-node=2 -m ddptrain",
    ):
        run(config)
    config = Config.from_dict({"recipe": {"trainer_class": "torch.nn.Linear"}})
    with pytest.raises(ConfigError, match="not a subclass of ddptrain.Trainer"):
        run(config)
