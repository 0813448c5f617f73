"""The Checkpointer (ddptrain/trainer/checkpoint/checkpointer.py): what a checkpoint holds, restoring it,
the world-size rule, and the epoch position read from its one owner, the sampler."""

import random
import warnings

import pytest
import torch
from torch import nn

from ddptrain.data import DistributedSampler
from ddptrain.rundir import RunDir
from ddptrain.testing import run_threaded
from ddptrain.trainer import CheckpointError, Config
from ddptrain.trainer.checkpoint import (
    Checkpointer,
    CheckpointWarning,
    NothingToResumeError,
    TrainState,
    check_world_size,
    checkpoint_name,
    elastic_restart_resume,
    load_checkpoint,
)
from ddptrain.trainer.metrics import TrainingMetrics
from ddptrain.trainer.optimizers import OptimizerSet, Schedule

DATASET_LEN = 40


def test_train_state_reads_the_epoch_position_from_the_sampler():
    assert TrainState().position() == (0, 0, 0)  # before fit builds a sampler
    sampler = DistributedSampler(DATASET_LEN, num_replicas=2, rank=1)
    state = TrainState(step=3, sampler=sampler)
    sampler.advance(6)
    assert (state.epoch, state.samples_in_epoch, state.position()) == (0, 6, (3, 0, 6))
    sampler.set_epoch(1)
    assert state.position() == (3, 1, 0)


def test_world_size_rule_names_both_sizes_and_the_ways_out():
    check_world_size(2, 2, False, "ckpt.pt")
    check_world_size(2, 3, True, "ckpt.pt")
    with pytest.raises(CheckpointError) as info:
        check_world_size(2, 3, False, "ckpt.pt")
    message = str(info.value)
    for words in (
        "ckpt.pt",
        "saved with 2 rank(s), not 3",
        "RNG state",
        "dist.world_size=2",
        "trainer.allow_world_size_change=true",
        "the bits of training depend on the world size",
        "trainer.world_size_invariant=true a run resumes exactly at any world size",
    ):
        assert words in message


def test_only_invariant_mode_resumes_at_another_world_size_without_the_switch():
    from ddptrain import Config
    from ddptrain.trainer.checkpoint.checkpointer import world_size_change_allowed

    assert world_size_change_allowed(Config.from_dict({"trainer": {"world_size_invariant": True}}))
    assert world_size_change_allowed(Config.from_dict({"trainer": {"allow_world_size_change": True}}))
    for plain in ({}, {"dist": {"zero_stage": 1}}, {"dist": {"sync": "diloco"}}, {"trainer": {"elastic": True}}):
        assert not world_size_change_allowed(Config.from_dict(plain)), plain


def test_a_torchrun_restart_resumes_from_the_latest_checkpoint(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert elastic_restart_resume() is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert elastic_restart_resume() is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert elastic_restart_resume() == "auto"  # the failed attempt may have written none: then from scratch


class Run:
    """The objects of a fit that a checkpoint captures, for one rank of ``world_size``."""

    def __init__(self, tmp_path, rank, world_size, allow=False, seed=0):
        from ddptrain import comm as dist

        g = torch.Generator().manual_seed(seed)
        self.model = nn.Linear(4, 2)
        with torch.no_grad():
            for p in self.model.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: 0.5**step)
        self.sampler = DistributedSampler(DATASET_LEN, world_size, rank, seed=5)
        self.state = TrainState(sampler=self.sampler)
        self.metrics = TrainingMetrics(dist.get_process_group())
        config = Config.from_dict({"trainer": {"seed": 11, "allow_world_size_change": allow}})
        self.checkpointer = Checkpointer(
            model=self.model,
            optimizers=OptimizerSet([self.optimizer], [Schedule(self.scheduler)]),
            sampler=self.sampler,
            state=self.state,
            metrics=self.metrics,
            process_group=dist.get_process_group(),
            device=torch.device("cpu"),
            config=config,
            run_dir=RunDir(tmp_path),
            trainer_class="tests.Trainer",
        )

    def train(self, steps):
        for _ in range(steps):
            self.model(torch.ones(3, 4)).sum().backward()
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad()
            self.sampler.advance(2)
            self.state.step += 1
        self.metrics.loss_history.append((self.state.step, 0.5))
        self.metrics.last_eval, self.metrics.smoke_probe_start = {"eval/loss": 0.25}, (0, 2.0)


def _save_then_restore(rank, world_size, tmp_path):
    source = Run(tmp_path, rank, world_size)
    source.train(3)
    path = source.checkpointer.save(tmp_path / "checkpoints" / checkpoint_name(3))
    target = Run(tmp_path, rank, world_size, seed=1)  # other weights, fresh optimizer and sampler
    assert target.checkpointer.resume("latest")
    same = all(torch.equal(a, b) for a, b in zip(source.model.parameters(), target.model.parameters()))
    momentum = [target.optimizer.state[p]["momentum_buffer"] for p in target.model.parameters()]
    return {
        "path": str(path),
        "same_weights": same,
        "same_momentum": all(
            torch.equal(a, source.optimizer.state[p]["momentum_buffer"])
            for a, p in zip(momentum, source.model.parameters())
        ),
        "lr": target.optimizer.param_groups[0]["lr"],
        "position": target.state.position(),
        "metrics": (target.metrics.loss_history, target.metrics.last_eval, target.metrics.last_eval_step),
        "probe": target.metrics.smoke_probe_start,
    }


def test_a_checkpoint_restores_everything_at_two_ranks(tmp_path):
    results = run_threaded(_save_then_restore, 2, tmp_path, timeout_s=60)
    for r in results:
        assert r["same_weights"] and r["same_momentum"]
        assert r["lr"] == pytest.approx(0.1 * 0.5**3)
        assert r["position"] == (3, 0, 6)  # 3 steps of 2 samples per rank, from the sampler
        assert r["metrics"] == ([(3, 0.5)], {"eval/loss": 0.25}, 3) and r["probe"] == (0, 2.0)
    saved = load_checkpoint(results[0]["path"])
    assert saved["world_size"] == 2 and len(saved["rng"]) == 2
    assert (saved["step"], saved["epoch"], saved["samples_in_epoch"]) == (3, 0, 6)
    assert saved["sampler"]["consumed"] == 6 and saved["sampler"]["num_replicas"] == 2
    assert saved["trainer_class"] == "tests.Trainer" and saved["config"]["trainer"]["seed"] == 11


def test_rng_state_round_trips(tmp_path):
    def body(rank, world_size):
        run = Run(tmp_path, rank, world_size)
        torch.manual_seed(7)
        random.seed(7)
        run.checkpointer.save(tmp_path / "checkpoints" / checkpoint_name(0))
        expected = (torch.rand(3), random.random())
        torch.manual_seed(99)
        random.seed(99)
        Run(tmp_path, rank, world_size).checkpointer.resume("latest")
        return torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]

    assert run_threaded(body, 1, timeout_s=60) == [True]


def _save(rank, world_size, tmp_path, steps):
    run = Run(tmp_path, rank, world_size)
    run.train(steps)
    run.checkpointer.save(tmp_path / "checkpoints" / checkpoint_name(steps))


def _resume(rank, world_size, tmp_path, allow):
    run = Run(tmp_path, rank, world_size, allow=allow)
    try:
        run.checkpointer.resume(str(tmp_path / "checkpoints"))
    except CheckpointError as exc:
        return str(exc)
    return run.state.position()


def test_another_world_size_is_refused_on_every_rank_unless_allowed(tmp_path):
    run_threaded(_save, 2, tmp_path, 3, timeout_s=60)  # each of 2 ranks trained on 6 samples: 12 in all
    refused = run_threaded(_resume, 3, tmp_path, False, timeout_s=60)
    assert all("saved with 2 rank(s), not 3" in r for r in refused)
    # Allowed: the same global position, 12 samples, is 4 per rank on 3 ranks.
    assert run_threaded(_resume, 3, tmp_path, True, timeout_s=60) == [(3, 0, 4)] * 3


def test_resume_auto_without_a_checkpoint_starts_fresh_and_latest_refuses_on_every_rank(tmp_path, caplog):
    def body(rank, world_size, resume):
        try:
            return Run(tmp_path, rank, world_size).checkpointer.resume(resume)
        except NothingToResumeError as exc:
            return str(exc)

    caplog.set_level("INFO", logger="ddptrain")
    assert run_threaded(body, 2, "auto", timeout_s=60) == [False, False]
    assert "trainer.resume=auto: no checkpoint in" in caplog.text and "starting from scratch" in caplog.text
    refused = run_threaded(body, 2, "latest", timeout_s=60)
    assert all(isinstance(r, str) and "trainer.resume=latest: no checkpoint in" in r for r in refused), refused


def test_a_missing_checkpoint_fails_every_rank(tmp_path):
    def body(rank, world_size):
        try:
            Run(tmp_path, rank, world_size).checkpointer.resume(str(tmp_path / "nowhere.pt"))
        except CheckpointError as exc:
            return str(exc)
        return None

    assert all(r and "no such file or directory" in r for r in run_threaded(body, 2, timeout_s=60))


# == the owner alone: step checkpoints, the stop checkpoint, best ones, the one resolver ==========


def _files(directory):
    return sorted(p.name for p in directory.iterdir() if p.is_file())


def test_step_checkpoints_are_named_verified_and_pruned_to_keep_last(tmp_path):
    def body(rank, world_size):
        run = Run(tmp_path, rank, world_size)
        run.checkpointer.keep_step_checkpoints(tmp_path / "elsewhere", keep_last=2)
        written = []
        for _ in range(4):
            run.train(1)
            written.append(run.checkpointer.save_step())
        return written

    written = run_threaded(body, 2, timeout_s=60)
    assert written[0] == written[1]  # every rank gets the path rank 0 wrote
    assert [p.name for p in written[0]] == [checkpoint_name(s) for s in (1, 2, 3, 4)]
    assert _files(tmp_path / "elsewhere") == [
        n for s in (3, 4) for n in (checkpoint_name(s), checkpoint_name(s) + ".sha256")
    ]
    assert load_checkpoint(written[0][-1])["step"] == 4


def test_a_step_checkpoint_that_does_not_verify_deletes_nothing_older(tmp_path, monkeypatch):
    import ddptrain.trainer.checkpoint.checkpointer as owner
    from ddptrain.trainer.checkpoint.files import save_checkpoint

    def body(rank, world_size):
        run = Run(tmp_path, rank, world_size)
        run.checkpointer.keep_step_checkpoints(keep_last=1)
        run.train(1)
        run.checkpointer.save_step()
        run.train(1)
        run.checkpointer.save_step()  # written with a digest that does not match
        return None

    def corrupt_after_writing(path, state):
        save_checkpoint(path, state)
        path.write_bytes(path.read_bytes()[:-10])  # what a full disk or a dying NFS server leaves

    monkeypatch.setattr(
        owner, "save_checkpoint", lambda p, s: save_checkpoint(p, s) if s["step"] == 1 else corrupt_after_writing(p, s)
    )
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        run_threaded(body, 1, timeout_s=60)
    assert (tmp_path / "checkpoints" / checkpoint_name(1)).is_file()  # the previous one survives
    assert load_checkpoint(tmp_path / "checkpoints" / checkpoint_name(1))["step"] == 1


def test_the_stop_checkpoint_is_not_written_twice_and_always_names_a_file(tmp_path):
    def body(rank, world_size):
        run = Run(tmp_path, rank, world_size)
        fresh = run.checkpointer.save_at_stop()  # a stop before the first step: step 0 is written
        run.train(2)
        periodic = run.checkpointer.save_step()
        mtime = periodic.stat().st_mtime_ns
        stop = run.checkpointer.save_at_stop()  # the same state: named, not written again
        again = run.checkpointer.save_step()
        return fresh, periodic, stop, again, mtime == periodic.stat().st_mtime_ns

    fresh, periodic, stop, again, untouched = run_threaded(body, 1, timeout_s=60)[0]
    assert fresh.name == checkpoint_name(0) and fresh.is_file()
    assert stop == periodic and again is None and untouched
    assert _files(tmp_path / "checkpoints").count(checkpoint_name(2)) == 1


def test_a_resumed_state_is_not_rewritten_and_a_stop_names_the_file_it_came_from(tmp_path):
    run_threaded(_save, 1, tmp_path, 3, timeout_s=60)
    source = tmp_path / "checkpoints" / checkpoint_name(3)
    before = source.stat().st_mtime_ns

    def body(rank, world_size):
        run = Run(tmp_path / "next", rank, world_size)
        run.checkpointer.resume(str(source))
        return run.checkpointer.save_step(), run.checkpointer.save_at_stop()

    assert run_threaded(body, 1, timeout_s=60) == [(None, source)]
    assert source.stat().st_mtime_ns == before and not (tmp_path / "next" / "checkpoints").exists()


def test_best_checkpoints_carry_their_value_and_are_listed_and_deleted_by_the_owner(tmp_path):
    def body(rank, world_size):
        run = Run(tmp_path, rank, world_size)
        run.train(2)
        path = run.checkpointer.save_best(run.checkpointer.best_dir, {"name": "eval/loss", "mode": "min", "value": 0.5})
        listed = run.checkpointer.best_on_disk(run.checkpointer.best_dir)
        return path, listed

    (path, listed), _ = run_threaded(body, 2, timeout_s=60)
    assert path == tmp_path / "checkpoints" / "best" / checkpoint_name(2)
    assert listed == [(path, 2, {"name": "eval/loss", "mode": "min", "value": 0.5})]
    assert load_checkpoint(path)["monitor"]["value"] == 0.5
    Checkpointer.delete(path)
    assert _files(path.parent) == []


def test_the_launcher_the_workers_and_load_model_resolve_to_the_same_file(tmp_path):
    """One resolver: with the newest checkpoint corrupt, every caller falls back to the same older one."""
    from ddptrain.trainer.checkpoint import find_checkpoint, preflight_resume, resume_after_restart

    assert resume_after_restart(RunDir(tmp_path)) is None
    run_threaded(_save, 2, tmp_path, 2, timeout_s=60)
    run_threaded(_save, 2, tmp_path, 4, timeout_s=60)
    newest = tmp_path / "checkpoints" / checkpoint_name(4)
    newest.write_bytes(newest.read_bytes()[:-10])
    older = tmp_path / "checkpoints" / checkpoint_name(2)

    def body(rank, world_size):
        return Run(tmp_path, rank, world_size).checkpointer.resolve("latest")

    with pytest.warns(CheckpointWarning, match="skipping checkpoint"):
        assert find_checkpoint(tmp_path) == older
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)  # named again by each caller
        assert run_threaded(body, 2, timeout_s=60) == [str(older)] * 2
        config = Config.from_dict({"trainer": {"output_dir": str(tmp_path), "resume": "latest"}})
        preflight_resume(config, 2)  # the launcher accepts the older one...
        with pytest.raises(CheckpointError, match=r"saved with 2 rank\(s\), not 3"):
            preflight_resume(config, 3)  # ...and refuses it at another world size, as the workers would
        assert resume_after_restart(RunDir(tmp_path)) == "latest"
