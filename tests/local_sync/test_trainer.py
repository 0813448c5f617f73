"""Local SGD and DiLoCo (``dist.sync``) on the Trainer's real loop, ranks as threads.

The references are computed here, outside the trainer: plain DDP for local SGD at H=1, and a
hand-written DiLoCo (each rank's copy stepped on the batches that rank really trained on, the
outer Nesterov step written out) for the outer step. Byte counts are checked against the sizes
of the tensors that travel.
"""

import pytest
import torch
from torch.utils.data import TensorDataset

from ddptrain import Config, Trainer, comm
from ddptrain.config import ConfigError
from ddptrain.preflight import validate
from ddptrain.testing import run_threaded
from ddptrain.trainer.callbacks import Callback
from ddptrain.trainer.stopping import NUM_VOTES

pytestmark = pytest.mark.timeout(300)

N_TRAIN, N_VAL, GLOBAL_BATCH = 240, 60, 24  # 10 steps per epoch


class Task(Trainer):
    """A small classification task with its own generators; records each step's sample ids."""

    batch_norm = False

    def configure_model(self):
        layers = [torch.nn.Linear(8, 17), torch.nn.Tanh(), torch.nn.Linear(17, 3)]
        if self.batch_norm:
            layers.insert(1, torch.nn.BatchNorm1d(17))
        model = torch.nn.Sequential(*layers)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        return model

    def _data(self):
        x = torch.randn(N_TRAIN + N_VAL, 8, generator=torch.Generator().manual_seed(0))
        return x, x[:, :3].argmax(1)

    def train_dataloader(self):
        x, y = self._data()
        return TensorDataset(x[:N_TRAIN], y[:N_TRAIN], torch.arange(N_TRAIN))

    def val_dataloader(self):
        x, y = self._data()
        return TensorDataset(x[N_TRAIN:], y[N_TRAIN:], torch.arange(N_VAL))

    def training_step(self, model, batch):
        inputs, targets, ids = batch
        self.seen = getattr(self, "seen", [])
        self.seen.append(ids.tolist())
        return torch.nn.functional.cross_entropy(model(inputs), targets)

    def validation_step(self, model, batch):
        inputs, targets, _ = batch
        logits = model(inputs)
        return {"accuracy": (logits.argmax(1) == targets).float()}


class BatchNormTask(Task):
    batch_norm = True


class Scalars(Callback):
    """What every logging point reported."""

    def __init__(self):
        self.logged = []

    def on_log(self, trainer, scalars):
        self.logged.append((trainer.state.step, dict(scalars)))


def _config(out, optimizer=None, dist=None, **trainer):
    return Config.from_dict(
        {
            "data": {"global_batch_size": GLOBAL_BATCH, "eval_batch_size": 10},
            "optimizer": optimizer or {"name": "sgd", "lr": 0.1, "momentum": 0.9},
            "dist": dist or {},
            "trainer": {
                "epochs": 2,
                "progress": False,
                "loggers": {"tensorboard": False},
                "output_dir": str(out),
                **trainer,
            },
        }
    )


def _fit(rank, world_size, out, cls=Task, optimizer=None, dist=None, **trainer):
    scalars = Scalars()
    task = cls(_config(out, optimizer, dist, **trainer), callbacks=[scalars])
    final = task.fit()
    return task, final, scalars.logged


def _params(task):
    return [p.detach().clone() for p in task.model.module.parameters()]


def test_local_sgd_at_h1_equals_every_step_training(tmp_path):
    """Averaging the parameters after every step is averaging the gradients (SGD with momentum is
    linear in them): the same model as DDP, to rounding."""
    ddp = run_threaded(_fit, 2, tmp_path / "ddp", timeout_s=120)
    local = run_threaded(_fit, 2, tmp_path / "l", dist={"sync": "local_sgd", "sync_every": 1}, timeout_s=120)
    for (a, _, _), (b, _, _) in zip(ddp, local):
        assert a.state.step == b.state.step == 20
        for p, q in zip(_params(a), _params(b)):
            torch.testing.assert_close(q, p, rtol=0, atol=2e-6)
    moved = max((p - q).abs().max().item() for p, q in zip(_params(ddp[0][0]), _params(local[0][0])))
    start = max(p.abs().max().item() for p in Task(Config()).configure_model().parameters())
    assert moved < 1e-3 * start  # the tolerance is far below what training moved


def test_local_sgd_with_longer_rounds_differs_from_every_step(tmp_path):
    ddp = run_threaded(_fit, 2, tmp_path / "ddp", epochs=1, timeout_s=120)[0][0]
    local = run_threaded(_fit, 2, tmp_path / "l", dist={"sync": "local_sgd", "sync_every": 5}, epochs=1, timeout_s=120)
    (a, final_a, _), (b, final_b, _) = local
    assert final_a["params_agree"] and final_a["params_sha256"] == final_b["params_sha256"]
    assert all(torch.equal(p, q) for p, q in zip(_params(a), _params(b)))  # step 10: an outer step
    assert max((p - q).abs().max().item() for p, q in zip(_params(ddp), _params(a))) > 1e-4


def _reference(cls, seen_per_rank, steps, every, lr, outer_lr, outer_momentum):
    """DiLoCo written out: each rank's copy takes SGD steps on the ids it trained on; every
    ``every`` steps (and at the last) the outer Nesterov step moves the consensus parameters and
    the floating buffers are averaged. ``outer_lr=1, outer_momentum=0`` is local SGD. Returns the
    final state dict (every copy holds the consensus then)."""
    task = cls(Config())
    consensus = task.configure_model()
    momentum = [torch.zeros_like(p) for p in consensus.parameters()]
    x, y = task._data()
    copies = [task.configure_model() for _ in seen_per_rank]
    for step in range(1, steps + 1):
        for model, seen in zip(copies, seen_per_rank):
            ids = torch.tensor(seen[step - 1])
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(x[ids]), y[ids]).backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= lr * p.grad
        if step % every == 0 or step == steps:
            with torch.no_grad():
                for i, theta in enumerate(consensus.parameters()):
                    g = theta - sum(list(m.parameters())[i] for m in copies) / len(copies)
                    momentum[i] = outer_momentum * momentum[i] + g
                    theta -= outer_lr * (g + outer_momentum * momentum[i])
                for name, buffer in consensus.named_buffers():
                    if buffer.is_floating_point():
                        buffer -= sum(buffer - m.get_buffer(name) for m in copies) / len(copies)
                for m in copies:  # integer buffers (num_batches_tracked) stay each copy's own
                    floats = {k: v for k, v in consensus.state_dict().items() if v.is_floating_point()}
                    m.load_state_dict(floats, strict=False)
    return copies[0].state_dict()


def test_the_diloco_outer_step_equals_a_reference_outside_the_trainer(tmp_path):
    sgd = {"name": "sgd", "lr": 0.2, "momentum": 0.0}
    dist = {"sync": "diloco", "sync_every": 3, "outer_lr": 0.7, "outer_momentum": 0.9}
    results = run_threaded(_fit, 2, tmp_path, optimizer=sgd, dist=dist, timeout_s=120)
    seen = [task.seen for task, _, _ in results]
    assert [len(s) for s in seen] == [20, 20]
    assert not set(map(tuple, seen[0])) & set(map(tuple, seen[1]))  # distinct samples per rank
    expected = _reference(Task, seen, 20, 3, 0.2, 0.7, 0.9)
    for task, final, _ in results:
        assert final["params_agree"]
        for name, tensor in task.model.module.state_dict().items():
            torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-6)


def _outer_step_labels(rank, world_size, out, **fit):
    _fit(rank, world_size, out, **fit)
    return [r.label for r in comm.get_process_group().ledger.records() if "outer step" in r.label]


@pytest.mark.parametrize("sync", ["local_sgd", "diloco"])
def test_each_outer_step_is_one_collective_named_in_the_ledger(tmp_path, sync):
    """A hang report names the outer step: after steps 3, 6, ..., 18 and the last one, 20."""
    dist = {"sync": sync, "sync_every": 3}
    for labels in run_threaded(_outer_step_labels, 2, tmp_path, dist=dist, timeout_s=120):
        assert labels == [f"{sync} outer step"] * 7, labels


def _resume_outer_sync(rank, world_size):
    from ddptrain.ddp.outer import OuterSync

    model = torch.nn.Linear(3, 2)
    sync = OuterSync(model, comm.get_process_group(), "local_sgd")
    consensus = [t.clone() for t in sync.live]
    local = [torch.full_like(t, 7.0) for t in sync.live]
    sync.resume(local)  # the consensus from the module, then this rank's copy in
    out = {"local": [torch.equal(t, torch.full_like(t, 7.0)) for t in sync.live]}
    out["consensus"] = [torch.equal(a, b) for a, b in zip(sync.consensus, consensus)]
    sync.resume(None)  # a new round: the copy starts at the consensus (now the module's 7s)
    out["new_round"] = [torch.equal(a, b) for a, b in zip(sync.consensus, sync.live)]
    for wrong in (local[:1], [torch.zeros(2, 4), local[1]]):
        try:
            sync.resume(wrong)
        except ValueError as exc:
            out.setdefault("refused", []).append(str(exc))
    return out


def test_resuming_the_outer_sync_takes_the_local_copy_and_refuses_one_that_does_not_fit():
    [out] = run_threaded(_resume_outer_sync, 1, timeout_s=60)
    assert all(out["local"]) and all(out["consensus"]) and all(out["new_round"]), out
    assert (
        out["refused"]
        == ["the checkpoint's local weights do not fit this model: resume with the model that wrote it"] * 2
    )


class CountsValidations(Task):
    def configure_callbacks(self):
        class Count(Callback):
            def on_validation_end(self, trainer, metrics):
                trainer.validations = getattr(trainer, "validations", 0) + 1

        return [*super().configure_callbacks(), Count()]


class StopAtTheEnd(CountsValidations):
    """Sets ``should_stop`` at the end of the last epoch: after the last planned step's outer step."""

    def configure_callbacks(self):
        class Stop(Callback):
            def on_epoch_end(self, trainer, epoch, metrics):
                trainer.should_stop = epoch == trainer.config.trainer.epochs - 1

        return [*super().configure_callbacks(), Stop()]


class StopAfterTheFirstEpoch(CountsValidations):
    """Sets ``should_stop`` at the end of epoch 0: step 10, inside the round of steps 10-12."""

    def configure_callbacks(self):
        class Stop(Callback):
            def on_epoch_end(self, trainer, epoch, metrics):
                trainer.should_stop = True

        return [*super().configure_callbacks(), Stop()]


@pytest.mark.parametrize(
    ("cls", "stopped_at", "validations"),
    # After the last planned step: that step had its outer step; another (a zero pseudo-gradient,
    # but Nesterov's momentum) would move the model. Each epoch's evaluation, none at the end.
    # After step 10 (outer steps at 3, 6, 9): an outer step over step 10, as the reference's last
    # step has; the epoch's evaluation, then one of the model it moved to.
    [(StopAtTheEnd, 20, 2), (StopAfterTheFirstEpoch, 10, 2)],
)
def test_an_early_stop_ends_with_an_outer_step_only_inside_a_round(tmp_path, cls, stopped_at, validations):
    sgd = {"name": "sgd", "lr": 0.2, "momentum": 0.0}
    dist = {"sync": "diloco", "sync_every": 3, "outer_lr": 0.7, "outer_momentum": 0.9}
    results = run_threaded(_fit, 2, tmp_path, cls=cls, optimizer=sgd, dist=dist, timeout_s=120)
    assert all(final["stopped_early"] and final["step"] == stopped_at for _, final, _ in results)
    expected = _reference(Task, [task.seen for task, _, _ in results], stopped_at, 3, 0.2, 0.7, 0.9)
    for task, final, _ in results:
        assert task.validations == validations and final["params_agree"]
        for name, tensor in task.model.module.state_dict().items():
            torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-6)


class StopAtStart(Task):
    def configure_callbacks(self):
        class Stop(Callback):
            def on_fit_start(self, trainer):
                trainer.should_stop = True

        return [*super().configure_callbacks(), Stop()]


def test_a_resume_at_an_outer_step_that_stops_at_once_keeps_the_checkpoints_model(tmp_path):
    """The checkpoint says which step had the last outer step: resumed right there and stopped
    before any step, the fit owes no outer step (DiLoCo's momentum would move the model)."""
    dist = {"sync": "diloco", "sync_every": 3}
    run_threaded(_fit, 2, tmp_path, dist=dist, stop_after_steps=6, timeout_s=120)
    saved = torch.load(tmp_path / "checkpoints" / "step_000000006.pt", weights_only=False)["model"]
    results = run_threaded(_fit, 2, tmp_path, cls=StopAtStart, dist=dist, resume="latest", timeout_s=120)
    for task, final, _ in results:
        assert final["stopped_early"] and final["step"] == 6
        assert all(torch.equal(tensor, saved[name]) for name, tensor in task.model.module.state_dict().items())


def test_local_sgd_averages_parameters_and_batch_norm_statistics_as_a_reference_does(tmp_path):
    sgd = {"name": "sgd", "lr": 0.2, "momentum": 0.0}
    dist = {"sync": "local_sgd", "sync_every": 4}
    results = run_threaded(_fit, 2, tmp_path, cls=BatchNormTask, optimizer=sgd, dist=dist, epochs=1, timeout_s=120)
    expected = _reference(BatchNormTask, [task.seen for task, _, _ in results], 10, 4, 0.2, 1.0, 0.0)
    assert expected["1.running_mean"].abs().max() > 1e-2  # the statistics moved
    for task, _, _ in results:
        for name, tensor in task.model.module.state_dict().items():
            torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-6)


@pytest.mark.parametrize("sync", ["diloco", "local_sgd"])
def test_resume_in_the_middle_of_an_outer_round_is_bitwise(tmp_path, sync):
    """Adam (per-rank moments) and BatchNorm (per-rank statistics): a stop at step 7 of rounds of 4
    leaves every rank's own model and optimizer state mid-round; the resumed run must end on the
    same bits as the run that never stopped."""
    adam = {"name": "adam", "lr": 0.01}
    dist = {"sync": sync, "sync_every": 4}
    kw = {"cls": BatchNormTask, "optimizer": adam, "dist": dist, "timeout_s": 120}
    stopped = run_threaded(_fit, 2, tmp_path / "r", stop_after_steps=7, **kw)
    assert stopped[0][0].state.step == 7
    resumed = run_threaded(_fit, 2, tmp_path / "r", resume="latest", **kw)
    whole = run_threaded(_fit, 2, tmp_path / "w", **kw)
    for (a, _, _), (b, _, _) in zip(resumed, whole):
        assert a.state.step == b.state.step == 20
        got, expected = a.model.module.state_dict(), b.model.module.state_dict()
        assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert resumed[0][1]["params_sha256"] == whole[0][1]["params_sha256"]
    assert resumed[0][1]["eval/accuracy"] == whole[0][1]["eval/accuracy"]


def test_a_checkpoint_in_the_middle_of_a_round_holds_the_consensus_and_each_ranks_copy(tmp_path):
    dist = {"sync": "diloco", "sync_every": 4}
    results = run_threaded(_fit, 2, tmp_path, dist=dist, stop_after_steps=6, timeout_s=120)
    checkpoint = torch.load(tmp_path / "checkpoints" / "step_000000006.pt", weights_only=False)
    ranks = checkpoint["strategy"]["ranks"]
    assert len(ranks) == 2
    for (task, _, _), saved in zip(results, ranks):
        assert all(torch.equal(p, q) for p, q in zip(_params(task), saved["weights"]))  # this rank's copy
    assert not torch.equal(ranks[0]["weights"][0], ranks[1]["weights"][0])  # two steps after step 4
    model = [checkpoint["model"][k] for k in ("0.weight", "0.bias", "2.weight", "2.bias")]
    assert not any(torch.equal(m, w) for m, w in zip(model, ranks[0]["weights"]))  # the consensus, not rank 0's copy


def test_the_step_log_reports_the_bytes_of_one_outer_step_per_round(tmp_path):
    """A logging window of exactly one round: its bytes are one all-reduce of every parameter, the
    stop votes riding with them, in float32, or in bf16 under dist.grad_compression=bf16."""
    n = sum(p.numel() for p in Task(Config()).configure_model().parameters())
    for compression, width in (("none", 4), ("bf16", 2)):
        dist = {"sync": "diloco", "sync_every": 5, "grad_compression": compression}
        results = run_threaded(_fit, 2, tmp_path / compression, dist=dist, log_every_steps=5, epochs=1, timeout_s=120)
        for _, final, logged in results:
            step, scalars = logged[0]
            assert step == 5
            assert scalars["comm/bytes_per_step"] * 5 == (n + NUM_VOTES) * width
            assert final["comm/bytes_sent"] > 2 * (n + NUM_VOTES) * width  # two rounds, and start-up


def _traffic(rank, world_size):
    group = comm.get_process_group()
    before = dict(group.traffic.by_op)
    group.all_reduce(torch.ones(10)).wait()  # float32: 40 bytes
    group.broadcast(torch.ones(3, dtype=torch.float64), 0).wait()  # 24
    longs = [torch.zeros(2, dtype=torch.int64) for _ in range(world_size)]
    group.all_gather(longs, torch.ones(2, dtype=torch.int64)).wait()  # 16
    outputs, inputs = [torch.zeros(1) for _ in range(world_size)], [torch.ones(1) for _ in range(world_size)]
    group.all_to_all(outputs, inputs).wait()  # 4 per peer
    peer = 1 - rank
    if rank == 0:
        group.send(torch.ones(5, dtype=torch.bfloat16), peer).wait()  # 10
    else:
        group.recv(torch.zeros(5, dtype=torch.bfloat16), peer).wait()  # received: not counted
    sub = group.new_subgroup([0, 1], "pair", group.timeout)
    sub.all_reduce(torch.ones(4, dtype=torch.float16)).wait()  # 8, counted with the parent's
    return {op: group.traffic.by_op.get(op, 0) - before.get(op, 0) for op in group.traffic.by_op}, group.traffic.total


def test_the_process_group_counts_the_bytes_of_every_tensor_it_is_handed():
    (sent0, _), (sent1, _) = run_threaded(_traffic, 2, timeout_s=60)
    common = {"all_reduce": 40 + 8, "broadcast": 24, "all_gather": 16, "all_to_all": 8}
    assert {k: v for k, v in sent0.items() if v} == {**common, "send": 10}
    assert {k: v for k, v in sent1.items() if v} == common


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ({"trainer": {"world_size_invariant": True}}, "trainer.world_size_invariant=true"),
        ({"dist": {"zero_stage": 1}}, "dist.zero_stage=1"),
        ({"trainer": {"ema": {"decay": 0.99}}}, "trainer.ema.decay"),
        ({"trainer": {"doctor": True}}, "trainer.doctor=true"),
        ({"trainer": {"check_sync_every_n_steps": 6}}, "trainer.check_sync_every_n_steps=6"),
    ],
)
def test_what_local_steps_cannot_be_combined_with_is_refused_with_the_way_out(override, named):
    dist = {"sync": "diloco", "sync_every": 4, **override.get("dist", {})}
    raw = {"dist": dist, "trainer": override.get("trainer", {})}
    with pytest.raises(ConfigError) as err:
        validate(Config.from_dict(raw), 2)
    message = str(err.value)
    assert message.startswith(f"dist.sync=diloco cannot be combined with {named}:")
    assert message.endswith("or set dist.sync=every_step.")
    fine = {"dist": {"sync": "diloco", "sync_every": 4}, "trainer": {"check_sync_every_n_steps": 8}}
    validate(Config.from_dict(fine), 2)  # a multiple of sync_every


def test_a_checkpoint_of_local_steps_is_refused_at_another_world_size_or_rule(tmp_path):
    dist = {"sync": "local_sgd", "sync_every": 4}
    run_threaded(_fit, 2, tmp_path, dist=dist, stop_after_steps=6, timeout_s=120)
    rule = r"dist.sync=local_sgd and this run has dist.sync=diloco: .* resume with dist.sync=local_sgd"
    with pytest.raises(Exception, match=rule):
        run_threaded(_fit, 2, tmp_path, dist={"sync": "diloco", "sync_every": 4}, resume="latest", timeout_s=120)
