"""``Trainer.predict`` and ``Trainer.test`` on real processes (gloo), at world sizes that do not
divide the dataset: the outputs come back in dataset order without the sampler's padding, equal
to one process's prediction, and the test metrics equal a plain computation over the whole set."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from ddptrain import Config, Trainer
from ddptrain.testing import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]

LENGTH = 29  # divisible by neither 2 nor 3; batches of 4 leave a short one


def _dataset():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(LENGTH, 8, generator=g)
    return TensorDataset(x, x[:, :3].argmax(1), torch.arange(LENGTH))


class Predictor(Trainer):
    def configure_model(self):
        torch.manual_seed(1000 + self.rank)  # different on every rank: predict must use rank 0's weights
        return nn.Sequential(nn.Linear(8, 5), nn.Dropout(0.5), nn.Linear(5, 3))

    def test_dataloader(self):
        return _dataset()

    def test_step(self, model, batch):
        x, y, _ = batch
        return super().test_step(model, (x, y))  # the default: validation_step's loss and accuracy

    def predict_step(self, model, batch):
        x, _, index = batch
        return {"logits": model(x), "index": index, "pair": (x.sum(1), index * 2)}


def _config(tmp):
    return Config.from_dict({"data": {"eval_batch_size": 4}, "trainer": {"output_dir": str(tmp), "progress": "false"}})


def _body(rank, world_size, tmp):
    trainer = Predictor(_config(tmp))
    predictions = trainer.predict(_dataset())
    metrics = trainer.test()
    return predictions, metrics


def _reference(model_seed):
    torch.manual_seed(model_seed)
    model = nn.Sequential(nn.Linear(8, 5), nn.Dropout(0.5), nn.Linear(5, 3)).eval()
    x, y, _ = _dataset().tensors
    with torch.no_grad():
        logits = model(x)
    loss = F.cross_entropy(logits, y).item()
    return logits, {"test/loss": loss, "test/accuracy": (logits.argmax(1) == y).sum().item() / LENGTH}


@pytest.mark.parametrize("world_size", [2, 3])
def test_predict_and_test_equal_one_process(tmp_path, world_size):
    results = run_distributed(_body, world_size, str(tmp_path), timeout_s=150)
    logits, expected = _reference(1000)  # rank 0's weights, broadcast to every rank
    x = _dataset().tensors[0]
    for predictions, metrics in results:
        assert torch.equal(predictions["index"], torch.arange(LENGTH))  # dataset order, padding cut off
        torch.testing.assert_close(predictions["logits"], logits, rtol=1e-6, atol=1e-6)
        assert isinstance(predictions["pair"], tuple)
        torch.testing.assert_close(predictions["pair"][0], x.sum(1))
        assert torch.equal(predictions["pair"][1], torch.arange(LENGTH) * 2)
        assert metrics["test/samples"] == LENGTH
        assert metrics["test/loss"] == pytest.approx(expected["test/loss"], rel=1e-6)
        assert metrics["test/accuracy"] == pytest.approx(expected["test/accuracy"], abs=1e-12)
    assert (tmp_path / "test_metrics.json").is_file()
