"""Training tasks with one injected slowness each, for ``ddptrain doctor``'s tests and benchmark.

The knobs live in ``config.model`` (free-form): ``kind`` (``net``: the tutorial's conv net,
compute-bound; ``mlp``: ``layers`` Linear(width, width) layers + ReLU), ``sleep_s`` (each
sample's ``__getitem__`` sleeps that long), ``spin_s`` (... computes that long: a CPU-bound
decoder), ``slow_rank``/``slow_s`` (that rank sleeps in every ``training_step``). Importable by
spawned workers (a module, not a test file).
"""

from __future__ import annotations

import time

import torch
from torch import nn
from torch.utils.data import Dataset

from ddptrain import Config, Trainer
from ddptrain.doctor import doctor_callbacks


class SleepyDataset(Dataset):
    """MNIST-shaped random samples; ``__getitem__`` sleeps ``sleep_s`` (a slow disk) and then
    busy-waits ``spin_s`` (a slow decoder: it needs a core all that time)."""

    def __init__(self, n: int, sleep_s: float = 0.0, features: int = 784, spin_s: float = 0.0):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 1, 28, 28, generator=g) if features == 784 else torch.randn(n, features, generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)
        self.sleep_s, self.spin_s = sleep_s, spin_s

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i):
        if self.sleep_s:
            time.sleep(self.sleep_s)
        if self.spin_s:
            until = time.thread_time() + self.spin_s  # this thread's CPU time: a core's worth of work
            while time.thread_time() < until:
                pass
        return self.x[i], self.y[i]


def build_model(m) -> nn.Module:
    """The network ``config.model`` names (``net`` or ``mlp``)."""
    if m.get("kind", "net") == "net":
        from ddptrain.recipes.mnist import Net

        return Net()
    width, layers = m.get("width", 64), m.get("layers", 50)
    body = [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers)]
    return nn.Sequential(*body, nn.Linear(width, 10))


class DoctorTask(Trainer):
    """The task ``config.model`` describes (see the module docstring), with the doctor's callbacks
    (as the runner adds them: a script that calls ``fit()`` itself passes them)."""

    def __init__(self, config: Config, callbacks=()):
        super().__init__(config, [*callbacks, *doctor_callbacks(config)])

    def configure_model(self) -> nn.Module:
        return build_model(self.config.model)

    def train_dataloader(self) -> Dataset:
        m = self.config.model
        features = 784 if m.get("kind", "net") == "net" else m.get("width", 64)
        return SleepyDataset(self.config.data.num_train_samples, m.get("sleep_s", 0.0), features, m.get("spin_s", 0.0))

    def val_dataloader(self):
        return None

    def training_step(self, model, batch):
        m = self.config.model
        if self.rank == m.get("slow_rank", -1):
            time.sleep(m.get("slow_s", 0.0))
        return super().training_step(model, batch)


def doctor_config(
    output_dir, model: dict, dist: dict | None = None, batch: int = 64, steps: int = 6, samples: int = 4096, **doctor
):
    """A short doctored run of ``DoctorTask`` (one epoch of ``samples``): 2 warm-up steps, then
    ``steps`` measured."""
    warmup = doctor.pop("warmup_steps", 2)
    return Config.from_dict(
        {
            "recipe": {"trainer_class": "tests.doctor.tasks.DoctorTask"},
            "model": model,
            "dist": dist or {},
            "data": {"name": "synthetic", "num_train_samples": samples, "global_batch_size": batch},
            "trainer": {
                "epochs": 1,
                "max_steps": warmup + steps,
                "doctor": True,
                "checkpoint": {"every_epochs": 0, "at_end": False},
                "eval_every_epochs": 0,
                "loggers": {"tensorboard": False},
                "progress": "false",
                "log_every_steps": 1000,
                "output_dir": str(output_dir),
            },
            "doctor": {"warmup_steps": warmup, "steps": steps, **doctor},
        }
    )


def run_doctored(rank: int, world_size: int, runs: list[tuple[str, dict]], root: str) -> list[dict]:
    """Fit each ``(name, doctor_config kwargs)`` in this process group; rank 0 returns the reports."""
    import json
    from pathlib import Path

    reports = []
    for name, kwargs in runs:
        out = Path(root) / name
        DoctorTask(doctor_config(out, **kwargs)).fit()
        if rank == 0:
            reports.append(json.loads((out / "doctor.json").read_text()))
    return reports


def fit_on_one_core(rank: int, world_size: int, root: str, core: int, kwargs: dict) -> list[dict]:
    """Pin this rank to ``core``, fit ``doctor_config(root, **kwargs)``; this rank's step records."""
    import os

    os.sched_setaffinity(0, {core})
    trainer = DoctorTask(doctor_config(root, **kwargs))
    trainer.fit()
    return [r for c in trainer.callbacks for r in getattr(c, "records", [])]
