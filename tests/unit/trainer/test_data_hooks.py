"""``train_dataloader()`` / ``val_dataloader()``: a Dataset gets ddptrain's distributed sampler; a
DataLoader keeps its collate_fn and has its sampler replaced; what cannot be distributed is
refused with the reason. Held against the plain single-process loop of test_trainer."""

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, WeightedRandomSampler

from ddptrain import ConfigError
from ddptrain.testing import run_threaded

from .test_trainer import FixedInitTrainer, _config, _reference, _task


class RawItems(Dataset):
    """Items as plain Python lists: only the user's collate_fn makes batches the model can take."""

    def __init__(self, tensors):
        self.x, self.y = tensors

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i].tolist(), int(self.y[i])


def collate_raw(items):
    xs, ys = zip(*items)
    return torch.tensor(xs), torch.tensor(ys)


class LoaderTrainer(FixedInitTrainer):
    """Lightning-style: DataLoaders with shuffle=True and a collate_fn, sizes from the config."""

    def train_dataloader(self):
        per_rank = self.config.data.global_batch_size // self.world_size
        return DataLoader(RawItems(super().train_dataloader().tensors), per_rank, shuffle=True, collate_fn=collate_raw)

    def val_dataloader(self):
        return DataLoader(RawItems(super().val_dataloader().tensors), batch_size=5, collate_fn=collate_raw)


class DatasetTrainer(FixedInitTrainer):
    """Returns a Dataset from the data hook."""

    def train_dataloader(self):
        return _task(self.num_train, 0)


def _fit(rank, world_size, cls, config):
    trainer = cls(config)
    metrics = trainer.fit()
    return {k: v.clone() for k, v in trainer.model.module.state_dict().items()}, metrics


@pytest.mark.parametrize("cls", [LoaderTrainer, DatasetTrainer])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_data_hooks_train_as_the_plain_loop_on_the_global_batch(tmp_path, cls, world_size):
    config = _config(tmp_path, {"global_batch_size": 12}, {"lr": 0.3, "momentum": 0.9})
    expected, eval_loss = _reference(config, epochs=2, steps_per_epoch=4)
    for params, metrics in run_threaded(_fit, world_size, cls, config, timeout_s=120):
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6, msg=name)
        assert metrics["eval/samples"] == 13 and metrics["eval/loss"] == pytest.approx(eval_loss, rel=1e-5)


class Returning(FixedInitTrainer):
    def __init__(self, config, loader):
        super().__init__(config)
        self.loader = loader

    def train_dataloader(self):
        return self.loader


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (
            lambda d: DataLoader(d, 10, sampler=WeightedRandomSampler([1.0] * len(d), len(d))),
            ValueError,
            r"custom sampler \(WeightedRandomSampler\).*return the Dataset itself",
        ),
        (lambda d: DataLoader(d, 10, drop_last=True), ValueError, r"drop_last=True \(set data.drop_last=true"),
        (lambda d: DataLoader(Stream(), 10), ValueError, r"an IterableDataset"),
        (
            lambda d: DataLoader(d, 4),
            ConfigError,
            r"batch_size=4, but the config gives 10 per rank.*data.global_batch_size=4.*batch_size=10",
        ),
        (lambda d: [d[0]], TypeError, r"train_dataloader\(\) returned a list: return a torch Dataset"),
    ],
)
def test_what_cannot_be_distributed_is_refused_with_the_reason(tmp_path, make, error, message):
    trainer = Returning(_config(tmp_path), make(_task(40, 0)))
    with pytest.raises(error, match=message):
        trainer.fit()


class Stream(IterableDataset):
    def __iter__(self):
        return iter([])


def _predict(rank, world_size, tmp_path):
    loader = DataLoader(RawItems(_task(17, 5).tensors), batch_size=4, shuffle=True, collate_fn=collate_raw)
    return FixedInitTrainer(_config(tmp_path)).predict(loader)


def test_predict_takes_a_dataloader_with_its_collate_fn(tmp_path):
    model = FixedInitTrainer(_config(tmp_path)).configure_model().eval()
    with torch.no_grad():
        expected = model(_task(17, 5).tensors[0])
    for predictions in run_threaded(_predict, 2, tmp_path, timeout_s=60):
        torch.testing.assert_close(predictions, expected, rtol=1e-6, atol=1e-6)


def _doubled(items):
    xs, ys = zip(*items)
    return torch.stack(xs) * 2, torch.stack(ys)


def test_the_collate_fn_of_a_loader_over_tensors_runs_too(tmp_path):
    """A TensorDataset is normally batched by indexing its tensors; with a user's collate_fn it must not be."""
    loader = DataLoader(_task(9, 5), batch_size=4, collate_fn=_doubled)
    model = FixedInitTrainer(_config(tmp_path)).configure_model().eval()
    with torch.no_grad():
        expected = model(_task(9, 5).tensors[0] * 2)
    torch.testing.assert_close(FixedInitTrainer(_config(tmp_path)).predict(loader), expected, rtol=1e-6, atol=1e-6)


def test_the_smoke_check_collates_its_probe_as_training_does(tmp_path):
    config = _config(tmp_path, {"global_batch_size": 12}, {"lr": 0.3, "momentum": 0.9}, smoke_check=True, epochs=3)
    assert LoaderTrainer(config).fit()["step"] == 12  # the probe's raw items went through collate_raw


def _invariant(rank, world_size, cls, config):
    return cls(config).fit()["params_sha256"]


def test_world_size_invariant_steps_collate_with_the_loaders_collate_fn(tmp_path):
    config = _config(tmp_path, {"global_batch_size": 12}, world_size_invariant=True, epochs=1)
    plain = run_threaded(_invariant, 1, FixedInitTrainer, config, timeout_s=60)[0]
    assert run_threaded(_invariant, 2, LoaderTrainer, config, timeout_s=60) == [plain, plain]
