"""The call site in each ledger record is the user's line, seen from outside: user-style code in
this file calls collectives through ddptrain's API, DDP and the Trainer on threaded ranks, and
every record must name this file and the line that led to the collective, never a ddptrain/ file
(forensics tell the user where *their* code diverged).
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils.data import TensorDataset

from ddptrain import Config, Trainer, comm
from ddptrain.ddp import DistributedDataParallel as DDP
from ddptrain.testing import run_threaded

pytestmark = pytest.mark.timeout(120)

HERE = os.path.relpath(__file__)  # how the ledger writes a path under the working directory


def _sites(records) -> list[str]:
    return [r.site for r in records]


def _line_of(fn, text: str) -> int:
    """The line of ``fn`` whose source contains ``text`` (so the test survives edits above it)."""
    import inspect

    lines, first = inspect.getsourcelines(fn)
    (offset,) = [i for i, line in enumerate(lines) if text in line]
    return first + offset


def _helper_all_reduce(t):
    return comm.all_reduce(t)  # a user's own helper: the site is this line, its innermost user frame


def _through_the_api(rank, ws):
    comm.all_reduce(torch.ones(2))
    comm.broadcast(torch.ones(3), src=1)
    comm.all_gather([torch.zeros(1) for _ in range(ws)], torch.ones(1))
    _helper_all_reduce(torch.ones(4))
    comm.barrier()
    return comm.get_process_group().ledger.records()


def test_collectives_through_the_functional_api_name_the_users_lines():
    expected = [
        f"{HERE}:{_line_of(_through_the_api, 'comm.all_reduce(torch.ones(2))')} in _through_the_api",
        f"{HERE}:{_line_of(_through_the_api, 'comm.broadcast(')} in _through_the_api",
        f"{HERE}:{_line_of(_through_the_api, 'comm.all_gather(')} in _through_the_api",
        f"{HERE}:{_line_of(_helper_all_reduce, 'comm.all_reduce(t)')} in _helper_all_reduce",
        f"{HERE}:{_line_of(_through_the_api, 'comm.barrier()')} in _through_the_api",
    ]
    for records in run_threaded(_through_the_api, 2, timeout_s=60):
        assert _sites(records)[-5:] == expected, records


def _through_ddp(rank, ws):
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 2))
    loss = model(torch.ones(3, 4) * (rank + 1)).sum()
    loss.backward()
    return comm.get_process_group().ledger.records()


def test_ddps_gradient_all_reduce_names_the_users_backward_line():
    """DDP's hooks run inside autograd, under torch and ddptrain frames: the site is the user's
    ``loss.backward()``, the construction broadcast the user's ``DDP(...)``."""
    built = f"{HERE}:{_line_of(_through_ddp, 'model = DDP(')} in _through_ddp"
    backward = f"{HERE}:{_line_of(_through_ddp, 'loss.backward()')} in _through_ddp"
    for records in run_threaded(_through_ddp, 2, timeout_s=60):
        buckets = [r for r in records if r.label.startswith("DDP bucket")]
        assert buckets and {r.site for r in buckets} == {backward}, records
        assert {r.site for r in records if not r.label} == {built}, records


def _task(num_samples, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, 8, generator=g)
    return TensorDataset(x, x[:, :3].argmax(1))


class UsersTrainer(Trainer):
    """A user's subclass whose ``training_step`` issues a collective of its own."""

    def train_dataloader(self):
        return _task(20, 0)

    def val_dataloader(self):
        return _task(7, 1)

    def training_step(self, model, batch):
        comm.all_reduce(torch.ones(5))  # the user's own collective, inside the Trainer's loop
        return super().training_step(model, batch)


def _fit(rank, ws, output_dir):
    config = Config.from_dict(
        {
            "model": {"_target_": "torch.nn.Linear", "in_features": 8, "out_features": 3},
            "data": {"global_batch_size": 10, "eval_batch_size": 7},
            "optimizer": {"lr": 0.5},
            "trainer": {
                "epochs": 1,
                "progress": False,
                "loggers": {"tensorboard": False},
                "checkpoint": {"every_epochs": 0, "at_end": False},
                "output_dir": output_dir,
            },
        }
    )
    trainer = UsersTrainer(config)
    trainer.fit()
    return comm.get_process_group().ledger.records()


def test_the_trainers_collectives_name_the_users_fit_call_not_ddptrains_loop(tmp_path):
    """The Trainer's own collectives (gradients, stop votes, evaluation) happen in ddptrain's
    loop: the site is the user's line that called ``fit()``. Below the user's ``training_step``
    the innermost user frame wins: its own collective, and what DDP's forward issues under its
    ``super().training_step`` call, name those lines."""
    fit = f"{HERE}:{_line_of(_fit, 'trainer.fit()')} in _fit"
    step = UsersTrainer.training_step
    own = f"{HERE}:{_line_of(step, 'comm.all_reduce(')} in training_step"
    forward = f"{HERE}:{_line_of(step, 'super().training_step(')} in training_step"
    for records in run_threaded(_fit, 2, str(tmp_path), timeout_s=120):
        assert {r.site for r in records} <= {fit, own, forward}, [r.describe() for r in records]
        assert [r.site for r in records if r.op == "all_reduce" and r.numel == 5] == [own] * 2  # one per step
        loop = [r for r in records if r.label in ("stop votes", "DDP bucket 0") or r.op == "all_gather"]
        assert len(loop) >= 4 and {r.site for r in loop} == {fit}, [r.describe() for r in records]
