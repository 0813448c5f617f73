#!/usr/bin/env python
"""What a checkpoint costs the training steps: foreground saves against background ones.

A model of about 50M parameters with AdamW (a checkpoint of about 0.6 GB: weights and two
moments), 2 ranks on this machine, one checkpoint every ``--every`` steps. Each run records, on
rank 0, the wall time between the ends of consecutive steps (a step that checkpoints includes what
the save cost it) and the process's peak resident memory. Five runs, in the same invocation:

- ``none``: no checkpoint (the anchor);
- ``sync``: ``trainer.checkpoint.async_save=false``, the single-file ``torch`` format, written in the step;
- ``async``: ``trainer.checkpoint.async_save=true``, the same file written by a thread of rank 0;
- ``dcp``: ``trainer.checkpoint.format=dcp``, each rank writing its part in the step;
- ``dcp-async``: the same, each rank writing its part in a thread.

Printed: the median step time without a checkpoint, the stall (the checkpointing step's time
minus that median, median over the checkpoints), the steady step time (median of the other
steps) as a ratio to ``none``'s, and rank 0's peak RSS. ``--world-size 1 --threads-per-worker 1``
trains one rank on one thread, which leaves this 2-core machine a core for the background writer:
the steady step then shows what the write costs the training when it need not take a core from a
rank. Usage::

    .venv/bin/python scripts/bench_checkpoint.py [--steps 40] [--every 10]
    .venv/bin/python scripts/bench_checkpoint.py --world-size 1 --threads-per-worker 1 --modes async dcp-async
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import ddptrain  # noqa: E402
from ddptrain.trainer.callbacks import Callback  # noqa: E402

TIMES_FILE = "step_times.json"
MODES = ("none", "sync", "async", "dcp", "dcp-async")


class StepClock(Callback):
    """Rank 0: the end time of every step and the peak RSS, written when the fit ends."""

    def __init__(self):
        self.ends: list[float] = []

    def on_train_batch_end(self, trainer, loss) -> None:
        self.ends.append(time.perf_counter())

    def on_fit_end(self, trainer, metrics) -> None:
        if trainer.is_main:
            peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            record = {"ends": self.ends, "peak_rss_mib": peak_mib}
            (Path(trainer.output_dir) / TIMES_FILE).write_text(json.dumps(record))


class BenchTrainer(ddptrain.Trainer):
    """About 50M parameters: 784 -> 8192 -> 4096 -> 2048 -> 10."""

    def configure_model(self):
        return nn.Sequential(
            nn.Flatten(),
            nn.Linear(784, 8192),
            nn.ReLU(),
            nn.Linear(8192, 4096),
            nn.ReLU(),
            nn.Linear(4096, 2048),
            nn.ReLU(),
            nn.Linear(2048, 10),
        )

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(4096, 1, 28, 28, generator=g)
        return TensorDataset(x, torch.randint(0, 10, (4096,), generator=g))

    def val_dataloader(self):
        return None

    def configure_callbacks(self):
        return [*super().configure_callbacks(), StepClock()]


def run(mode: str, steps: int, every: int, out: Path, world_size: int = 2, threads: int = 0) -> dict:
    overrides = [
        "recipe=synthetic",
        f"dist.world_size={world_size}",
        f"dist.threads_per_worker={threads}",
        "recipe.trainer_class=bench_checkpoint.BenchTrainer",
        "optimizer=adamw",
        "data.global_batch_size=64",
        f"trainer.max_steps={steps}",
        "trainer.epochs=100",
        "trainer.log_every_steps=0",
        "trainer.eval_every_epochs=0",
        "trainer.num_sanity_val_steps=0",
        "trainer.model_summary=false",
        "trainer.progress=false",
        "trainer.loggers.tensorboard=false",
        "trainer.loggers.csv=false",
        "trainer.checkpoint.keep_last=1",
        "trainer.checkpoint.every_epochs=0",
        "trainer.checkpoint.at_end=false",
        f"trainer.checkpoint.every_steps={0 if mode == 'none' else every}",
        f"trainer.checkpoint.async_save={'true' if mode.endswith('async') else 'false'}",
        f"trainer.checkpoint.format={'dcp' if mode.startswith('dcp') else 'torch'}",
        f"trainer.output_dir={out}",
        f"hydra.run.dir={out}",
    ]
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'scripts'}:{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(
        [sys.executable, "-m", "ddptrain", *overrides], cwd=REPO, env=env, capture_output=True, text=True, timeout=1800
    )
    if proc.returncode != 0:
        raise SystemExit(f"{mode}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    record = json.loads((out / TIMES_FILE).read_text())
    ends = record["ends"]
    intervals = [b - a for a, b in zip(ends, ends[1:])]  # intervals[i]: the step numbered i + 2
    saving = {i for i in range(len(intervals)) if mode != "none" and (i + 2) % every == 0}
    steady = [t for i, t in enumerate(intervals) if i not in saving and i + 1 not in saving]
    return {"intervals": intervals, "saving": sorted(saving), "steady": steady, "peak_rss_mib": record["peak_rss_mib"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument(
        "--world-size", type=int, default=2, help="ranks (1 leaves a core free for the background writer)"
    )
    parser.add_argument(
        "--threads-per-worker", type=int, default=0, help="dist.threads_per_worker (0: ddptrain's choice)"
    )
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES, help="none is always run")
    args = parser.parse_args()
    params = sum(p.numel() for p in BenchTrainer.configure_model(None).parameters())
    print(
        f"bench_checkpoint: {params / 1e6:.1f}M parameters, AdamW, {args.world_size} rank(s), {args.steps} steps, "
        f"a checkpoint every {args.every}"
    )
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-checkpoint-") as tmp:
        for mode in [m for m in MODES if m == "none" or m in args.modes]:
            results[mode] = run(
                mode, args.steps, args.every, Path(tmp) / mode, args.world_size, args.threads_per_worker
            )
    anchor = statistics.median(results["none"]["steady"])
    print(
        f"{'mode':<9} {'steady step s':>14} {'vs none':>8} {'stall s (median)':>17} "
        f"{'stall / sync':>13} {'peak RSS MiB':>13}"
    )
    sync_stall = None
    for mode, r in results.items():
        steady = statistics.median(r["steady"])
        stalls = [r["intervals"][i] - anchor for i in r["saving"]]
        stall = statistics.median(stalls) if stalls else 0.0
        if mode == "sync":
            sync_stall = stall
        ratio = f"{stall / sync_stall:.3f}" if sync_stall and mode != "none" else "-"
        print(
            f"{mode:<9} {steady:>14.3f} {steady / anchor:>8.3f} {stall:>17.3f} {ratio:>13} {r['peak_rss_mib']:>13.0f}"
        )


if __name__ == "__main__":
    main()
