"""Test and predict after a fit, from a checkpoint, and from inside a fit (threaded ranks), held
against the fitted module run in one process."""

import pytest
import torch
import torch.nn.functional as F

from ddptrain import Callback
from ddptrain.testing import run_threaded

from .test_trainer import TinyTrainer, _config, _task


class PredictAtEnd(Callback):
    """Calls predict from inside fit (a callback), where the fit's process group is in use."""

    def on_fit_end(self, trainer, metrics):
        self.predictions = trainer.predict(_task(11, 5))


def _after_fit(rank, world_size, tmp):
    at_end = PredictAtEnd()
    config = _config(tmp, {"global_batch_size": 12, "eval_batch_size": 3}, {"lr": 2.0, "momentum": 0.9}, epochs=5)
    config.trainer.checkpoint.every_epochs = 1  # lr 2: the best evaluation is not the last one
    config.trainer.checkpoint.monitor = "eval/loss"
    trainer = TinyTrainer(config, callbacks=[at_end])
    trainer.fit()
    weights = {k: v.clone() for k, v in trainer.model.module.state_dict().items()}
    after = trainer.predict(_task(11, 5))
    from_best = TinyTrainer(config).test(_task(13, 1), checkpoint="best")  # a new trainer, no fit
    fitted_best = trainer.test(_task(13, 1), checkpoint="best")  # the checkpoint's weights, not the fitted ones
    return weights, at_end.predictions, after, trainer.test(), (from_best, fitted_best)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_predict_and_test_after_fit_and_from_the_best_checkpoint(tmp_path, world_size):
    results = run_threaded(_after_fit, world_size, tmp_path, timeout_s=120)
    model = torch.nn.Linear(8, 3)
    model.load_state_dict(results[0][0])
    x, _ = _task(11, 5).tensors
    val_x, val_y = _task(13, 1).tensors
    with torch.no_grad():
        expected = model(x)
        expected_loss = F.cross_entropy(model(val_x), val_y).item()
    best = torch.load(sorted((tmp_path / "checkpoints" / "best").glob("*.pt"))[0], weights_only=True)
    for _, during, after, tested, from_best in results:
        torch.testing.assert_close(during, expected, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(after, expected, rtol=1e-6, atol=1e-6)
        assert tested["test/samples"] == 13 and tested["test/loss"] == pytest.approx(expected_loss, rel=1e-5)
        for metrics in from_best:
            assert metrics["test/loss"] == pytest.approx(best["monitor"]["value"], rel=1e-6)


def test_a_predict_step_without_one_row_per_sample_is_refused(tmp_path):
    class Summing(TinyTrainer):
        def predict_step(self, model, batch):
            return model(batch[0]).sum()

    with pytest.raises(ValueError, match=r"predict_step returned a tensor of shape \(\) for a batch of 7"):
        Summing(_config(tmp_path, {"eval_batch_size": 7})).predict(_task(10, 0))
