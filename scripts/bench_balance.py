#!/usr/bin/env python
"""What shares by speed (``trainer.balance.shares=auto``) gain when one rank is slow.

``recipe=mnist_fast`` on this machine, 2 ranks and then 3. The last rank is made slower per
sample by a factor (2, then 3): after its ``training_step``, a hook busy-waits (it does not sleep:
it keeps its core, as a slow GPU would) ``(factor - 1) * c`` seconds per sample of its batch,
``c`` being a rank's compute per sample measured by a calibration run in the same invocation.
Each case runs three ways, in one invocation:

- ``off``: plain DDP, every rank an equal share;
- ``auto``: ``trainer.balance.shares=auto``;
- ``ideal``: the harmonic balance of the speeds ``auto`` measured: ``auto``'s step time outside
  the slowest rank's compute (the same code path: communication, the update, the step's
  bookkeeping), plus the global batch divided by the sum of the ranks' speeds (every rank done
  at once).

Printed per case: the median step time (over the steps after the first decision window) of
``off`` and ``auto``, ``ideal``, ``auto / ideal`` (goal: at most 1.10) and ``off / auto``.
Then two checks of a healthy job and of a slowdown that comes and goes:

- ``--healthy``: no slow rank; ``off`` and ``auto`` alternate (``--rounds`` each) and the ratio of
  their median step times is printed (goal: within 2%), with the shares ``auto`` ended with;
- ``--transient``: the slowdown (factor 3) is on from step 100 to step 300 of 400; the shares at
  every change are printed, to show they follow it within the window and return;
- ``--neutral``: what the model learns. One epoch of 2 ranks, the last one slowed by 3, for seeds
  0, 1, 2: the test accuracy and the last logged loss of ``off`` and ``auto`` (normal mode: the
  same samples per step, cut otherwise, so equal within the seeds' noise), and their logged loss
  curves (every 10 steps): the mean gap between ``off`` and ``auto`` of one seed, against the
  gap between two seeds of ``off`` (the noise); and one epoch of
  ``recipe=mnist`` in world-size-invariant mode, uniform and unslowed against ``auto`` slowed:
  the two ``params_sha256`` (equal).

Usage::

    .venv/bin/python scripts/bench_balance.py [--steps 160] [--worlds 2 3] [--factors 2 3]
    .venv/bin/python scripts/bench_balance.py --healthy --rounds 3
    .venv/bin/python scripts/bench_balance.py --transient
    .venv/bin/python scripts/bench_balance.py --neutral
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench_checkpoint import TIMES_FILE, StepClock  # noqa: E402  (the same directory)

from ddptrain.recipes.mnist_fast import MnistTrainer  # noqa: E402

SLOW_ENV = "BENCH_BALANCE_SLOW"  # "<rank> <seconds per sample> <first step> <last step>"


def spin(seconds: float) -> None:
    """Busy-wait: keep the core, as a slow device keeps its rank busy."""
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


class SlowTrainer(MnistTrainer):
    """recipe=mnist_fast's trainer; the rank named in ``$BENCH_BALANCE_SLOW`` busy-waits in
    proportion to its batch after each training step, between the steps named there."""

    def training_step(self, model, batch):
        loss = super().training_step(model, batch)
        slow = os.environ.get(SLOW_ENV)
        if slow:
            rank, per_sample, first, last = slow.split()
            if self.rank == int(rank) and int(first) <= self.state.step < int(last):
                spin(float(per_sample) * len(batch[0]))
        return loss

    def configure_callbacks(self):
        return [*super().configure_callbacks(), StepClock()]


def run(out: Path, world_size: int, steps: int, shares: str, slow: str = "", *extra: str, recipe="mnist_fast") -> dict:
    overrides = [
        f"recipe={recipe}",
        "recipe.trainer_class=bench_balance.SlowTrainer",
        f"dist.world_size={world_size}",
        f"trainer.max_steps={steps}",
        "trainer.epochs=100",
        "trainer.eval_every_epochs=0",
        "trainer.num_sanity_val_steps=0",
        "trainer.limit_val_batches=1",
        "trainer.model_summary=false",
        "trainer.progress=false",
        "trainer.log_every_steps=0",
        "trainer.loggers.tensorboard=false",
        "trainer.loggers.csv=false",
        "trainer.checkpoint.every_epochs=0",
        "trainer.checkpoint.at_end=false",
        f"trainer.balance.shares={shares}",
        f"trainer.output_dir={out}",
        f"hydra.run.dir={out}",
        *extra,
    ]
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'scripts'}:{os.environ.get('PYTHONPATH', '')}", SLOW_ENV: slow}
    proc = subprocess.run(
        [sys.executable, "-m", "ddptrain", *overrides], cwd=REPO, env=env, capture_output=True, text=True, timeout=1800
    )
    if proc.returncode != 0:
        raise SystemExit(f"{out.name}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    ends = json.loads((out / TIMES_FILE).read_text())["ends"]
    metrics = json.loads((out / "metrics.json").read_text())
    return {"intervals": [b - a for a, b in zip(ends, ends[1:])], "metrics": metrics}


def median_after(intervals: list[float], skip: int) -> float:
    return statistics.median(intervals[skip:])


def global_batch(world_size: int) -> int:
    """recipe=mnist_fast's 256, or the nearest multiple of the world size below it (plain DDP needs one)."""
    return 256 // world_size * world_size


def calibrate(tmp: Path, world_size: int) -> tuple[float, float]:
    """A rank's compute seconds per sample, and the plain step's median, with no slow rank (an
    ``auto`` run only measures; its shares stay equal when the ranks are even)."""
    batch = f"data.global_batch_size={global_batch(world_size)}"
    r = run(tmp / f"cal{world_size}", world_size, 80, "auto", "", "trainer.balance.min_gain=1", batch)
    per_sample = max(r["metrics"]["balance"]["seconds_per_sample"])
    return per_sample, median_after(r["intervals"], 20)


def gains(args, tmp: Path) -> None:
    window = 20
    columns = ("ranks", "factor", "off s", "auto s", "ideal s", "auto/ideal", "off/auto")
    print(" ".join(f"{c:>{w}}" for c, w in zip(columns, (5, 6, 8, 8, 8, 10, 9))), " shares")
    for world_size in args.worlds:
        per_sample, _ = calibrate(tmp, world_size)
        for factor in args.factors:
            slow = f"{world_size - 1} {(factor - 1) * per_sample} 0 {10**9}"
            batch = global_batch(world_size)
            size = f"data.global_batch_size={batch}"
            off = run(tmp / f"off{world_size}x{factor}", world_size, args.steps, "off", slow, size)
            auto = run(tmp / f"auto{world_size}x{factor}", world_size, args.steps, "auto", slow, size)
            t_off = median_after(off["intervals"], 2 * window)
            t_auto = median_after(auto["intervals"], 2 * window)
            balance = auto["metrics"]["balance"]
            speeds = balance["seconds_per_sample"]
            slowest = max(w * batch * t for w, t in zip(balance["shares"], speeds))  # auto's compute per step
            ideal = t_auto - slowest + batch / sum(1 / t for t in speeds)
            shares = " ".join(f"{s:.3f}" for s in balance["shares"])
            print(
                f"{world_size:>5} {factor:>6} {t_off:>8.4f} {t_auto:>8.4f} {ideal:>8.4f} "
                f"{t_auto / ideal:>10.3f} {t_off / t_auto:>9.3f}  {shares}",
                flush=True,
            )


def healthy(args, tmp: Path) -> None:
    times: dict[str, list[float]] = {"off": [], "auto": []}
    for i in range(args.rounds):
        for shares in ("off", "auto"):
            r = run(tmp / f"healthy{i}{shares}", 2, args.steps, shares)
            times[shares].append(median_after(r["intervals"], 20))
            if shares == "auto":
                print(f"round {i}: auto ended with shares {r['metrics']['balance']['shares']}", flush=True)
    off, auto = statistics.median(times["off"]), statistics.median(times["auto"])
    print(
        f"no slow rank, 2 ranks, {args.rounds} alternating rounds: off {off:.4f} s, auto {auto:.4f} s, "
        f"auto/off {auto / off:.3f}"
    )


def transient(args, tmp: Path) -> None:
    per_sample, _ = calibrate(tmp, 2)
    slow = f"1 {2 * per_sample} 100 300"  # factor 3 from step 100 to step 300
    r = run(tmp / "transient", 2, 400, "auto", slow)
    print("slowdown x3 on rank 1 during steps 100-299 of 400; shares at each change:")
    for change in r["metrics"]["balance"]["changes"]:
        print(f"  step {change['step']:>4}: {change['shares']}")


def loss_curve(out: Path) -> list[float]:
    """The run's ``train/loss`` as logged every ``trainer.log_every_steps`` steps (metrics.csv)."""
    with open(out / "metrics.csv", newline="") as f:
        return [float(row["train/loss"]) for row in csv.DictReader(f) if row.get("train/loss")]


def curve_gap(a: list[float], b: list[float]) -> float:
    """The mean absolute difference of two loss curves logged at the same steps."""
    return statistics.mean(abs(x - y) for x, y in zip(a, b, strict=True))


def neutral(args, tmp: Path) -> None:
    per_sample, _ = calibrate(tmp, 2)
    slow = f"1 {2 * per_sample} 0 {10**9}"
    epoch = (
        "trainer.max_steps=234",
        "trainer.limit_val_batches=null",
        "trainer.log_every_steps=10",
        "trainer.loggers.csv=true",
    )
    header = ("seed", 4), ("off acc", 8), ("auto acc", 9), ("off loss", 9), ("auto loss", 10), ("curve gap", 10)
    print(" ".join(f"{name:>{width}}" for name, width in header) + "  auto shares")
    accuracies: dict[str, list[float]] = {"off": [], "auto": []}
    curves: dict[str, list[list[float]]] = {"off": [], "auto": []}
    for seed in (0, 1, 2):
        row = {}
        for shares in ("off", "auto"):
            out = tmp / f"neutral{seed}{shares}"
            r = run(out, 2, 234, shares, slow, *epoch, f"trainer.seed={seed}")
            row[shares] = r["metrics"]
            accuracies[shares].append(r["metrics"]["eval/accuracy"])
            curves[shares].append(loss_curve(out))
        print(
            f"{seed:>4} {row['off']['eval/accuracy']:>8.4f} {row['auto']['eval/accuracy']:>9.4f} "
            f"{row['off']['train/loss_last']:>9.4f} {row['auto']['train/loss_last']:>10.4f} "
            f"{curve_gap(curves['off'][-1], curves['auto'][-1]):>10.4f}  {row['auto']['balance']['shares']}",
            flush=True,
        )
    for shares, values in accuracies.items():
        print(f"{shares}: accuracy mean {statistics.mean(values):.4f}, spread {max(values) - min(values):.4f}")
    # the loss curves: off against auto of the same seed, and (the noise) off of one seed against another's
    same_seed = [curve_gap(a, b) for a, b in zip(curves["off"], curves["auto"])]
    seeds = [curve_gap(curves["off"][i], curves["off"][j]) for i, j in ((0, 1), (0, 2), (1, 2))]
    print(
        f"loss curves ({len(curves['off'][0])} points, every 10 steps), mean |difference|: off vs auto of the "
        f"same seed {statistics.mean(same_seed):.4f}; off of one seed vs another {statistics.mean(seeds):.4f}"
    )
    invariant = "trainer.world_size_invariant=true"
    uniform = run(tmp / "inv-off", 2, 300, "off", "", invariant, recipe="mnist")
    balanced = run(tmp / "inv-auto", 2, 300, "auto", f"1 {2 * per_sample} 0 {10**9}", invariant, recipe="mnist")
    a, b = uniform["metrics"]["params_sha256"], balanced["metrics"]["params_sha256"]
    print(f"invariant mode, recipe=mnist, 300 steps: uniform {a[:16]}..., auto slowed {b[:16]}... equal: {a == b}")
    print(f"  auto's shares: {balanced['metrics']['balance']['shares']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--factors", type=float, nargs="+", default=[2, 3])
    parser.add_argument("--healthy", action="store_true")
    parser.add_argument("--transient", action="store_true")
    parser.add_argument("--neutral", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-balance-") as tmp:
        if args.healthy:
            healthy(args, Path(tmp))
        elif args.transient:
            transient(args, Path(tmp))
        elif args.neutral:
            neutral(args, Path(tmp))
        else:
            gains(args, Path(tmp))


if __name__ == "__main__":
    main()
