"""The flags Lightning users reach for first, on the Trainer's real loop (ranks as threads).

Each test watches from outside the code under test: the batches ``training_step`` received, the
metrics an evaluation returned against a reference computed here, the weights against a
reference moving average, the checkpoint files on disk.
"""

import time

import pytest
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import TensorDataset

import ddptrain
from ddptrain import Config, Trainer
from ddptrain.config import ConfigError
from ddptrain.export import export
from ddptrain.testing import run_threaded
from ddptrain.trainer.callbacks.loggers import MetricsLogger
from ddptrain.trainer.summary import model_summary

pytestmark = pytest.mark.timeout(300)

N_TRAIN, N_VAL, GLOBAL_BATCH = 240, 100, 24  # 10 steps per epoch


class Task(Trainer):
    """A small classification task whose data and weights draw from their own generators
    (the rank threads share the global one); it records the batches it trains on."""

    def configure_model(self):
        model = torch.nn.Sequential(torch.nn.Linear(8, 17), torch.nn.Tanh(), torch.nn.Linear(17, 3))
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        return model

    def train_dataloader(self):
        x = torch.randn(N_TRAIN + N_VAL, 8, generator=torch.Generator().manual_seed(0))
        return TensorDataset(x[:N_TRAIN], x[:N_TRAIN, :3].argmax(1), torch.arange(N_TRAIN))

    def val_dataloader(self):
        x = torch.randn(N_TRAIN + N_VAL, 8, generator=torch.Generator().manual_seed(0))[N_TRAIN:]
        return TensorDataset(x, x[:, :3].argmax(1), torch.arange(N_VAL))

    def training_step(self, model, batch):
        inputs, targets, ids = batch
        self.seen = getattr(self, "seen", [])
        self.seen.append((self.state.epoch, ids.tolist()))
        return torch.nn.functional.cross_entropy(model(inputs), targets)

    def validation_step(self, model, batch):
        inputs, targets, ids = batch
        logits = model(inputs)
        return {
            "loss": torch.nn.functional.cross_entropy(logits, targets, reduction="none"),
            "accuracy": (logits.argmax(1) == targets).float(),
        }


def _config(out, **trainer):
    return Config.from_dict(
        {
            "data": {"global_batch_size": GLOBAL_BATCH, "eval_batch_size": 10},
            "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
            "trainer": {
                "epochs": 2,
                "progress": False,
                "loggers": {"tensorboard": False},
                "output_dir": str(out),
                **trainer,
            },
        }
    )


def _fit(rank, world_size, out, cls=Task, **trainer):
    task = cls(_config(out, **trainer))
    final = task.fit()
    return task, final


def _params(task):
    return [p.detach().clone() for p in task.model.module.parameters()]


# == limit_train_batches, limit_val_batches, overfit_batches ========================================
def test_limit_train_batches_takes_the_first_batches_of_each_epochs_own_shuffle(tmp_path):
    full = run_threaded(_fit, 2, tmp_path / "full", timeout_s=120)
    limited = run_threaded(_fit, 2, tmp_path / "lim", limit_train_batches=3, timeout_s=120)
    for rank in range(2):
        task, final = limited[rank]
        assert final["step"] == 6 and final["epoch"] == 2, final  # 3 steps in each of 2 epochs
        whole = full[rank][0].seen
        for epoch in range(2):
            head = [ids for e, ids in whole if e == epoch][:3]
            assert [ids for e, ids in task.seen if e == epoch] == head
        assert sorted({i for _, ids in task.seen for i in ids}) != sorted({i for _, ids in whole[:3] for i in ids})


def test_limit_train_batches_as_a_fraction_of_the_epoch(tmp_path):
    task, final = run_threaded(_fit, 2, tmp_path, limit_train_batches=0.5, epochs=1, timeout_s=120)[0]
    assert final["step"] == 5 and task.steps_per_epoch == 5


def test_limit_val_batches_is_exact_over_the_samples_it_sees(tmp_path):
    task, final = run_threaded(_fit, 2, tmp_path, limit_val_batches=2, epochs=1, timeout_s=120)[0]
    seen = 2 * 2 * 10  # 2 batches of 10 on each of 2 ranks: the first 40 samples
    assert final["eval/samples"] == seen
    inputs, targets, _ = task.val_dataloader()[:seen]
    with torch.no_grad():
        logits = task.model.module(inputs)
    expected = (logits.argmax(1) == targets).float().mean().item()
    assert final["eval/accuracy"] == pytest.approx(expected, abs=1e-7)
    loss = torch.nn.functional.cross_entropy(logits, targets).item()
    assert final["eval/loss"] == pytest.approx(loss, rel=1e-6)


def test_overfit_batches_trains_on_the_same_unshuffled_batches_and_drives_the_loss_toward_zero(tmp_path):
    task, final = run_threaded(_fit, 2, tmp_path, overfit_batches=4, epochs=60, log_every_steps=4, timeout_s=200)[0]
    epochs = {}
    for epoch, ids in task.seen:
        epochs.setdefault(epoch, []).append(ids)
    assert len(epochs) == 60 and all(batches == epochs[0] for batches in epochs.values())
    assert sorted(i for ids in epochs[0] for i in ids) == list(range(0, 4 * GLOBAL_BATCH, 2))  # rank 0's half
    assert final["eval/samples"] == 4 * 2 * 10  # validation cut to 4 batches too
    assert final["train/loss_first"] > 0.5 and final["train/loss_last"] < 0.02, final


# == num_sanity_val_steps ===========================================================================
class BrokenValidation(Task):
    def validation_step(self, model, batch):
        self.validated = getattr(self, "validated", 0) + 1
        raise RuntimeError("validation is broken")


def _fit_broken(rank, world_size, out, **trainer):
    task = BrokenValidation(_config(out, **trainer))
    try:
        task.fit()
    except RuntimeError as exc:
        return task, exc
    return task, None


def test_a_broken_validation_step_fails_in_the_sanity_check_before_any_training_step(tmp_path):
    task, exc = run_threaded(_fit_broken, 2, tmp_path, timeout_s=120)[0]
    assert exc is not None and "validation is broken" in str(exc)
    assert "sanity check (trainer.num_sanity_val_steps=2)" in "\n".join(getattr(exc, "__notes__", []))
    assert getattr(task, "seen", []) == [] and task.validated == 1
    task, exc = run_threaded(_fit_broken, 2, tmp_path / "off", num_sanity_val_steps=0, timeout_s=120)[0]
    assert exc is not None and len(task.seen) == 10  # found only at the first epoch's end


class RandomValidation(Task):
    """Dropout in training, and a validation_step that draws random numbers and logs."""

    def configure_model(self):
        model = super().configure_model()
        return torch.nn.Sequential(model[0], torch.nn.Dropout(0.3), *model[1:])

    def validation_step(self, model, batch):
        torch.rand(7)  # a user's validation may draw randomness
        self.log("val_calls", 1.0, reduce="sum")
        return super().validation_step(model, batch)


def test_the_sanity_check_changes_no_bit_of_the_training_and_logs_nothing(tmp_path):
    one_epoch = {"epochs": 1, "timeout_s": 120}  # one evaluation: the sanity check's values would land in it
    with_check = run_threaded(_fit, 1, tmp_path / "a", cls=RandomValidation, num_sanity_val_steps=3, **one_epoch)
    without = run_threaded(_fit, 1, tmp_path / "b", cls=RandomValidation, num_sanity_val_steps=0, **one_epoch)
    assert all(torch.equal(a, b) for a, b in zip(_params(with_check[0][0]), _params(without[0][0])))
    assert with_check[0][1]["val_calls"] == without[0][1]["val_calls"] == 10  # the evaluation's batches only


# == fast_dev_run ===================================================================================
class CountingTask(Task):
    """Counts this rank's training and validation batches."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = {"train": 0, "val": 0}

    def training_step(self, model, batch):
        self.calls["train"] += 1
        return super().training_step(model, batch)

    def validation_step(self, model, batch):
        self.calls["val"] += 1
        return super().validation_step(model, batch)


def test_a_fast_dev_run_runs_n_batches_once_whatever_the_schedule_says(tmp_path, caplog):
    """The run's own epochs, sanity check, evaluation schedule and checkpoints all ask for more;
    a fast dev run of 2 trains 2 batches, validates 2 and tests 2 (``test_step`` defaults to
    ``validation_step``), once, and writes nothing."""
    schedule = dict(epochs=3, num_sanity_val_steps=3, eval_every_steps=1, checkpoint={"every_steps": 1})
    schedule["loggers"] = {"tensorboard": True, "csv": True, "mlflow": True, "wandb": True}
    caplog.set_level("INFO", logger="ddptrain")
    results = run_threaded(_fit, 2, tmp_path / "out", cls=CountingTask, fast_dev_run=2, **schedule, timeout_s=120)
    for task, final in results:
        assert task.calls == {"train": 2, "val": 2 + 2}, task.calls
        assert final["step"] == 2 and final.get("checkpoint") is None, final
        loggers = [type(c).__name__ for c in task.callbacks if isinstance(c, MetricsLogger)]
        assert loggers == [], loggers
    assert not (tmp_path / "out").exists()  # its files went to a temporary directory, removed
    assert not [r.getMessage() for r in caplog.records if "checkpoint saved" in r.getMessage()]


# == max_time =======================================================================================
class SlowTask(Task):
    """20 steps take at least 2 s: a 1 s max_time stops the job well inside, however fast the host."""

    def training_step(self, model, batch):
        time.sleep(0.1)
        return super().training_step(model, batch)


def test_max_time_stops_every_rank_at_the_same_step_with_a_checkpoint_and_resumes_bitwise(tmp_path):
    stopped = run_threaded(_fit, 2, tmp_path / "run", cls=SlowTask, max_time="00:00:00:01", timeout_s=120)
    steps = {final["step"] for _, final in stopped}
    assert len(steps) == 1 and 0 < steps.pop() < 20, [f["step"] for _, f in stopped]
    final = stopped[0][1]
    assert final["stopped_by"] == "max_time" and final["checkpoint"].endswith(".pt")
    resumed = run_threaded(_fit, 2, tmp_path / "run", resume="latest", timeout_s=120)
    straight = run_threaded(_fit, 2, tmp_path / "straight", timeout_s=120)
    assert resumed[0][1]["step"] == straight[0][1]["step"] == 20
    assert all(torch.equal(a, b) for a, b in zip(_params(resumed[0][0]), _params(straight[0][0])))


def test_max_time_must_be_days_hours_minutes_seconds():
    with pytest.raises(ConfigError, match=r"trainer.max_time='1:00:00' must be DD:HH:MM:SS, e.g. 00:12:00:00"):
        ddptrain.config.check_fields(Config.from_dict({"trainer": {"max_time": "1:00:00"}}))
    with pytest.raises(ConfigError, match="hours < 24"):
        ddptrain.config.check_fields(Config.from_dict({"trainer": {"max_time": "00:24:00:00"}}))


# == learning rates, gradient norm, model summary, deterministic ====================================
class TwoGroups(Task):
    def configure_optimizers(self, model):
        first, second = model[0], model[2]
        optimizer = torch.optim.SGD(
            [{"params": first.parameters()}, {"params": second.parameters(), "lr": 0.01}], lr=0.1
        )
        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)


def test_every_param_groups_learning_rate_is_logged(tmp_path):
    task, _ = run_threaded(_fit, 2, tmp_path, cls=TwoGroups, epochs=1, log_every_steps=2, timeout_s=120)[0]
    metrics = task.callback_metrics  # the last window: step 10, after 10 schedule steps
    assert metrics["train/lr/SGD/pg0"] == pytest.approx(0.1 * 0.5**10)
    assert metrics["train/lr/SGD/pg1"] == pytest.approx(0.01 * 0.5**10)
    assert metrics["train/lr"] == metrics["train/lr/SGD/pg0"]


class NormProbe(Task):
    """Records the global norm of the gradients the optimizer step receives (after the reduction)."""

    def optimizer_step(self):
        grads = torch.cat([p.grad.flatten() for p in self.model.module.parameters()])
        self.norms = getattr(self, "norms", []) + [torch.linalg.vector_norm(grads).item()]
        super().optimizer_step()


class Recorder(ddptrain.Callback):
    def __init__(self):
        self.logged = []

    def on_log(self, trainer, scalars):
        self.logged.append(scalars)


def _fit_logging_norms(rank, world_size, out, cls, zero_stage):
    config = _config(out, epochs=1, log_every_steps=1, log_grad_norm=True)
    config.dist.zero_stage = zero_stage
    recorder = Recorder()
    task = cls(config, callbacks=[recorder])
    task.fit()
    return getattr(task, "norms", None), [m["train/grad_norm"] for m in recorder.logged]


def test_the_logged_gradient_norm_is_the_global_norm_after_the_reduction_with_and_without_zero(tmp_path):
    plain = run_threaded(_fit_logging_norms, 2, tmp_path / "plain", NormProbe, 0, timeout_s=120)
    norms, logged = plain[0]
    assert plain[1][1] == logged and len(logged) == 10  # the same on every rank, every step
    assert logged == pytest.approx(norms, rel=1e-6)
    zero = run_threaded(_fit_logging_norms, 2, tmp_path / "zero", Task, 2, timeout_s=120)  # ZeRO-2: shards only
    assert zero[0][1] == zero[1][1] and zero[0][1] == pytest.approx(norms, rel=1e-5)


def test_the_model_summary_counts_each_parameter_once_and_the_frozen_ones_apart():
    first, tied = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    tied.weight = first.weight  # a tied weight: counted in the first row that holds it
    model = torch.nn.Sequential(first, torch.nn.BatchNorm1d(4), tied, torch.nn.Linear(4, 2, bias=False))
    model[3].weight.requires_grad_(False)
    rows = [row.split() for row in model_summary(model).splitlines()]
    assert [row[1:5] for row in rows[2:6]] == [
        ["0", "Linear", "20", "20"],
        ["1", "BatchNorm1d", "8", "8"],
        ["2", "Linear", "4", "4"],
        ["3", "Linear", "8", "0"],
    ]
    assert rows[-1][:9] == ["32", "trainable", "params,", "8", "non-trainable", "params,", "40", "total", "params,"]


def test_deterministic_switches_torch_to_deterministic_kernels_for_the_fit(tmp_path):
    class Probe(Task):
        def training_step(self, model, batch):
            self.flags = getattr(self, "flags", set()) | {torch.are_deterministic_algorithms_enabled()}
            return super().training_step(model, batch)

    before = torch.are_deterministic_algorithms_enabled()
    try:
        on = run_threaded(_fit, 1, tmp_path / "on", cls=Probe, epochs=1, deterministic=True, timeout_s=120)[0][0]
        assert on.flags == {True}
    finally:
        torch.use_deterministic_algorithms(before)
    off = run_threaded(_fit, 1, tmp_path / "off", cls=Probe, epochs=1, timeout_s=120)[0][0]
    assert off.flags == {before}


# == EMA ============================================================================================
class EmaReference(ddptrain.Callback):
    """torch's own moving average (``AveragedModel``, parameters and buffers), fed the model after
    every due step: ``get_ema_multi_avg_fn``'s constant decay, or the same lerp with timm's ramp."""

    def __init__(self, decay, every=1, start=0, warmup=False):
        self.decay, self.every, self.start, self.warmup, self.model = decay, every, start, warmup, None

    def _average(self, averages, current, n):
        if averages[0].is_floating_point():  # num_batches_tracked is not compared
            n = float(n)
            torch._foreach_lerp_(averages, current, 1 - min(self.decay, (1 + n) / (10 + n)))

    def on_train_batch_end(self, trainer, loss):
        module = trainer.model.module
        if self.model is None:
            rule = self._average if self.warmup else get_ema_multi_avg_fn(self.decay)
            self.model = AveragedModel(module, multi_avg_fn=rule, use_buffers=True)
        step = trainer.state.step
        if step > self.start and (step - self.start) % self.every == 0:
            self.model.update_parameters(module)


class NormTask(Task):
    """The task with a BatchNorm layer: running statistics to average."""

    def configure_model(self):
        model = super().configure_model()
        return torch.nn.Sequential(model[0], torch.nn.BatchNorm1d(17), *model[1:])


def _fit_ema(rank, world_size, out, decay, every, start, warmup=False, cls=Task, **trainer):
    reference = EmaReference(decay, every, start, warmup)
    ema = {"decay": decay, "every_n_steps": every, "start_step": start, "warmup": warmup}
    task = cls(_config(out, ema=ema, **trainer), callbacks=[reference])
    task.fit()
    return task, reference


@pytest.mark.parametrize("every, start, warmup", [(1, 0, False), (3, 4, False), (1, 0, True)])
def test_the_ema_weights_equal_torchs_averaged_model_bitwise(tmp_path, every, start, warmup):
    task, reference = run_threaded(_fit_ema, 1, tmp_path, 0.9, every, start, warmup, NormTask, timeout_s=120)[0]
    averaged = task.ema.weights()
    expected = reference.model.module.state_dict()
    floats = [k for k, v in expected.items() if v.is_floating_point()]
    assert "1.running_mean" in floats and all(torch.equal(averaged[k], expected[k]) for k in floats)
    trained = task.model.module.state_dict()
    assert not all(torch.equal(averaged[k], trained[k]) for k in floats)
    loaded = ddptrain.load_model(tmp_path, ema=True)  # the last checkpoint's average
    assert all(torch.equal(loaded.state_dict()[k], expected[k]) for k in floats)
    written, _, _ = export(tmp_path, "torch", ema=True, out=tmp_path / "ema.pt")  # python -m ddptrain.export --ema
    exported = torch.load(written, weights_only=True)
    assert all(torch.equal(exported[k], expected[k]) for k in floats)


def test_the_ema_parameters_are_the_same_on_every_rank(tmp_path):
    results = run_threaded(_fit_ema, 2, tmp_path, 0.9, 1, 0, True, timeout_s=120)
    (first, reference), (second, _) = results
    expected = [p.detach() for p in reference.model.module.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(first.ema.averages, expected))
    assert all(torch.equal(a, b) for a, b in zip(first.ema.averages, second.ema.averages))


@pytest.mark.parametrize("start,warmup", [(0, False), (10, True)])  # (10, True): stopped before the first update
def test_the_ema_resumes_bitwise(tmp_path, start, warmup):
    first = run_threaded(_fit_ema, 2, tmp_path / "r", 0.8, 1, start, warmup, stop_after_steps=7, timeout_s=120)[0][0]
    assert first.state.step == 7
    resumed = run_threaded(_fit_ema, 2, tmp_path / "r", 0.8, 1, start, warmup, resume="latest", timeout_s=120)[0][0]
    whole = run_threaded(_fit_ema, 2, tmp_path / "w", 0.8, 1, start, warmup, timeout_s=120)[0][0]
    assert resumed.state.step == whole.state.step == 20
    assert all(torch.equal(a, b) for a, b in zip(resumed.ema.averages, whole.ema.averages))


def _fit_evaluating_ema(rank, world_size, out, evaluate):
    task = NormTask(_config(out, ema={"decay": 0.8, "evaluate": evaluate, "warmup": False}))
    final = task.fit()
    inputs, targets, _ = task.val_dataloader()[:]

    def loss_of(state):  # a fresh model holding ``state``, as a user would load it
        model = task.configure_model()
        model.load_state_dict(state)
        with torch.no_grad():
            return torch.nn.functional.cross_entropy(model.eval()(inputs), targets).item()

    tested = task.test(task.val_dataloader())["test/loss"]
    return final["eval/loss"], loss_of(task.ema.weights()), loss_of(task.model.module.state_dict()), tested


def test_ema_evaluate_validates_and_tests_rank_0s_average_and_trains_on(tmp_path):
    logged, averaged, trained, tested = run_threaded(_fit_evaluating_ema, 2, tmp_path / "e", True, timeout_s=120)[0]
    assert averaged != pytest.approx(trained, rel=1e-4)  # the two weights differ enough to tell apart
    assert logged == pytest.approx(averaged, rel=1e-6) and tested == pytest.approx(averaged, rel=1e-6)
    logged, averaged, trained, tested = run_threaded(_fit_evaluating_ema, 2, tmp_path / "t", False, timeout_s=120)[0]
    assert logged == pytest.approx(trained, rel=1e-6) and tested == pytest.approx(trained, rel=1e-6)


def test_load_model_with_ema_refuses_a_run_without_an_average(tmp_path):
    run_threaded(_fit, 1, tmp_path, epochs=1, timeout_s=120)
    with pytest.raises(ConfigError, match="holds no EMA weights: its run did not set trainer.ema.decay"):
        ddptrain.load_model(tmp_path, ema=True)
