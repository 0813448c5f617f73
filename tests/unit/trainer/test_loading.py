"""Loading for inference (``ddptrain.load_model``) and fine-tuning (``trainer.init_from``), held
against the files on disk and the trained trainer's own model."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ddptrain
import ddptrain.loading  # used as ddptrain.loading.find_checkpoint: import it, not rely on others
from ddptrain import Callback, ConfigError
from ddptrain.testing import run_threaded
from ddptrain.trainer.checkpoint import CheckpointError, list_checkpoints
from tests.conftest import merged

from .test_trainer import TinyTrainer, _config


class DropoutTrainer(TinyTrainer):
    """A model whose train and eval modes differ (dropout), built from a config value."""

    def configure_model(self):
        width = self.config.model["width"]
        return nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Dropout(0.5), nn.Linear(width, 3))


def _fit(tmp_path, cls=DropoutTrainer, **trainer):
    config = _config(
        tmp_path, None, {"lr": 2.0, "momentum": 0.9}, **merged({"checkpoint": {"every_epochs": 1}}, trainer)
    )
    config.model = {"width": 6}
    fitted = cls(config)
    fitted.fit()
    return fitted


def test_load_model_rebuilds_the_users_model_with_the_weights_in_eval_mode(tmp_path):
    fitted = _fit(tmp_path, epochs=5, checkpoint={"monitor": "eval/loss", "save_top_k": 2})
    x, y = fitted.val_dataloader().tensors
    latest = ddptrain.load_model(tmp_path)  # the run directory; which="latest"
    assert isinstance(latest, nn.Sequential) and latest[0].out_features == 6  # through configure_model + config
    assert not latest.training and all(not m.training for m in latest.modules())
    fitted.model.module.eval()
    with torch.no_grad():
        torch.testing.assert_close(latest(x), fitted.model.module(x), rtol=0, atol=0)
    best = ddptrain.load_model(tmp_path, which="best")
    best_file = torch.load(ddptrain.loading.find_checkpoint(tmp_path, "best"), weights_only=True)
    with torch.no_grad():
        assert F.cross_entropy(best(x), y).item() == pytest.approx(best_file["monitor"]["value"], rel=1e-5)
    losses = [
        torch.load(p, weights_only=True)["monitor"]["value"]
        for p in list_checkpoints(tmp_path / "checkpoints" / "best")
    ]
    assert best_file["monitor"]["value"] == min(losses)
    # A checkpoint file and the checkpoints/best directory are accepted too.
    for source in (list_checkpoints(tmp_path / "checkpoints")[-1], tmp_path / "checkpoints" / "best"):
        assert ddptrain.load_model(source).state_dict().keys() == latest.state_dict().keys()


def test_plain_torch_load_weights_only_reads_every_checkpoint(tmp_path):
    _fit(tmp_path, epochs=2, checkpoint={"monitor": "eval/accuracy", "mode": "max"})
    files = list_checkpoints(tmp_path / "checkpoints") + list_checkpoints(tmp_path / "checkpoints" / "best")
    assert len(files) == 3
    for path in files:
        state = torch.load(path, weights_only=True)
        model = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Dropout(0.5), nn.Linear(6, 3))
        model.load_state_dict(state["model"])


def test_a_trainer_class_that_cannot_be_imported_is_named_and_can_be_passed(tmp_path):
    class LocalTrainer(DropoutTrainer):  # its dotted name has <locals>: not importable
        pass

    _fit(tmp_path, LocalTrainer, epochs=1)
    with pytest.raises(ConfigError, match=r"LocalTrainer.*cannot be imported.*trainer_class=YourTrainer"):
        ddptrain.load_model(tmp_path)
    assert isinstance(ddptrain.load_model(tmp_path, trainer_class=LocalTrainer), nn.Sequential)
    with pytest.raises(CheckpointError, match="no best checkpoint"):
        ddptrain.load_model(tmp_path, which="best", trainer_class=LocalTrainer)


class AtStart(Callback):
    def on_fit_start(self, trainer):
        self.step = trainer.state.step
        self.optimizer_state = len(trainer.optimizer.state)
        self.weights = {k: v.clone() for k, v in trainer.model.module.state_dict().items()}


def _fine_tune(rank, world_size, source_dir, target_dir, init_from):
    start = AtStart()
    config = _config(target_dir, {"global_batch_size": 12}, {"lr": 0.1, "momentum": 0.9}, epochs=1, init_from=init_from)
    config.model = {"width": 6}
    metrics = DropoutTrainer(config, callbacks=[start]).fit()
    return start.step, start.optimizer_state, start.weights, metrics["step"]


@pytest.mark.parametrize("world_size", [1, 2])
def test_init_from_starts_a_new_run_from_the_weights_only(tmp_path, world_size):
    _fit(tmp_path / "a", epochs=2, checkpoint={"monitor": "eval/loss"})
    for source in ("a", "a/checkpoints/best"):
        expected = torch.load(ddptrain.loading.find_checkpoint(tmp_path / source), weights_only=True)["model"]
        results = run_threaded(
            _fine_tune, world_size, tmp_path / "a", tmp_path / f"b{source[-4:]}", str(tmp_path / source), timeout_s=120
        )
        for step, optimizer_state, weights, final_step in results:
            assert step == 0 and optimizer_state == 0 and final_step == 4  # a fresh optimizer, from step 0
            for name, value in expected.items():
                assert torch.equal(weights[name], value), name


def test_init_from_a_model_that_does_not_fit_says_so(tmp_path):
    _fit(tmp_path / "a", epochs=1)
    config = _config(tmp_path / "b", epochs=1, init_from=str(tmp_path / "a"))
    config.model = {"width": 5}
    with pytest.raises(CheckpointError, match=r"trainer.init_from=.*do not fit this run's model.*size mismatch"):
        DropoutTrainer(config).fit()


def test_a_missing_init_from_is_refused_before_any_worker_starts(tmp_path):
    from ddptrain.trainer.checkpoint import preflight_resume

    config = _config(tmp_path, init_from=str(tmp_path / "nowhere"))
    with pytest.raises(CheckpointError, match=r"trainer.init_from=.*nowhere: no such file or directory"):
        preflight_resume(config, 2)
