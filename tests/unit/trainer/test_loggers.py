"""Loggers: metrics.csv (on by default) holds exactly what the run reduced, step by step, and the
configuration beside it; TensorBoard gets the hyper-parameters; MLflow (local file store) and
W&B (offline) runs hold the metrics and the configuration when their packages are installed."""

import csv
import sys

import pytest
import yaml

from ddptrain import Callback

from .test_trainer import TinyTrainer, _config


class Logs(TinyTrainer):
    def training_step(self, model, batch):
        loss = super().training_step(model, batch)
        self.log("double_loss", 2 * loss)
        return loss


class Record(Callback):
    def __init__(self):
        self.logged = {}

    def on_log(self, trainer, scalars):
        self.logged.setdefault(trainer.state.step, {}).update(scalars)

    def on_validation_end(self, trainer, metrics):
        self.logged.setdefault(trainer.state.step, {}).update(metrics)


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_metrics_csv_holds_every_reduced_value_at_its_step(tmp_path):
    record = Record()
    trainer = Logs(_config(tmp_path, loggers={"csv": True}), callbacks=[record])
    final = trainer.fit()
    rows = _rows(tmp_path / "metrics.csv")
    assert [int(r["step"]) for r in rows] == [2, 4, 6, 8]  # log_every_steps=2, 4 steps per epoch
    assert list(rows[0])[:2] == ["step", "train/loss"]
    for row in rows:
        step = int(row["step"])
        for name, value in record.logged[step].items():
            assert float(row[name]) == pytest.approx(value, rel=1e-12), (step, name)
        assert float(row["double_loss"]) == pytest.approx(2 * float(row["train/loss"]), rel=1e-6)
    assert [float(r["train/loss"]) for r in rows] == pytest.approx([loss for _, loss in trainer.loss_history])
    assert rows[1]["eval/loss"] != "" and rows[0]["eval/loss"] == ""  # evaluations at the epoch ends only
    assert float(rows[3]["eval/accuracy"]) == pytest.approx(final["eval/accuracy"])
    assert float(rows[1]["train/epoch_loss"]) > 0 and rows[2]["train/epoch_loss"] == ""
    hparams = yaml.safe_load((tmp_path / "hparams.yaml").read_text())
    assert hparams == trainer.config.to_dict() and hparams["trainer"]["epochs"] == 2


def test_metrics_csv_of_a_resumed_run_continues_the_first(tmp_path):
    kwargs = {"checkpoint": {"every_steps": 2}}
    TinyTrainer(_config(tmp_path / "straight", **kwargs)).fit()
    TinyTrainer(_config(tmp_path / "mid", stop_after_steps=6, **kwargs)).fit()
    TinyTrainer(
        _config(tmp_path / "mid", resume=str(tmp_path / "mid" / "checkpoints" / "step_000000004.pt"), **kwargs)
    ).fit()
    straight, resumed = _rows(tmp_path / "straight" / "metrics.csv"), _rows(tmp_path / "mid" / "metrics.csv")
    assert [r["step"] for r in resumed] == [r["step"] for r in straight] == ["2", "4", "6", "8"]  # step 6 once
    for a, b in zip(straight, resumed):
        assert {k: a[k] for k in ("train/loss", "eval/loss")} == {k: b[k] for k in ("train/loss", "eval/loss")}


def test_the_csv_logger_can_be_turned_off(tmp_path):
    TinyTrainer(_config(tmp_path, loggers={"csv": False}, epochs=1)).fit()
    assert not (tmp_path / "metrics.csv").exists() and (tmp_path / "metrics.json").exists()


def test_tensorboard_records_the_hyperparameters(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    TinyTrainer(_config(tmp_path, loggers={"tensorboard": True}, epochs=1)).fit()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    content = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    info = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
    assert info.hparams["trainer.epochs"].number_value == 1
    assert info.hparams["optimizer.name"].string_value == "sgd"
    assert {"train/loss", "eval/loss"} <= set(acc.Tags()["scalars"])


def test_mlflow_run_in_a_local_file_store(tmp_path):
    pytest.importorskip("mlflow", reason="MLflow is optional: pip install 'ddptrain[loggers]'")
    from mlflow.tracking import MlflowClient

    trainer = Logs(_config(tmp_path, loggers={"mlflow": True}))
    trainer.fit()
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("ddptrain").experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["trainer.epochs"] == "2"
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(s, pytest.approx(v)) for s, v in trainer.loss_history]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval/accuracy")] == [4, 8]
    assert "double_loss" in run.data.metrics


def test_wandb_offline_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="W&B is optional: pip install 'ddptrain[loggers]'")
    from ddptrain import WandbLogger

    monkeypatch.setenv("WANDB_SILENT", "true")
    logger, seen = WandbLogger(), {}

    class Peek(Callback):  # before the logger: its run is still open in on_fit_end
        def on_fit_end(self, trainer, metrics):
            seen.update(summary=dict(logger.run.summary), step=logger.run.step, config=dict(logger.run.config))

    trainer = Logs(_config(tmp_path), callbacks=[Peek(), logger])
    trainer.fit()
    assert seen["config"]["trainer"]["epochs"] == 2 and seen["step"] == 8
    assert seen["summary"]["train/loss"] in [pytest.approx(v) for _, v in trainer.loss_history]
    assert "double_loss" in seen["summary"] and "eval/accuracy" in seen["summary"]
    (offline,) = (tmp_path / "wandb").glob("offline-run-*")
    assert any(p.suffix == ".wandb" for p in offline.iterdir())


def test_a_missing_logger_package_says_how_to_install_it(tmp_path, monkeypatch):
    for name in ("mlflow", "mlflow.tracking", "mlflow.entities"):
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError, installed or not
    expected = r"MLflowLogger needs the 'mlflow.tracking' package .*pip install 'ddptrain\[loggers\]'"
    with pytest.raises(ImportError, match=expected):
        TinyTrainer(_config(tmp_path, loggers={"mlflow": True}, epochs=1)).fit()
