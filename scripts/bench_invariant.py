"""Cost of world-size-invariant mode: step time at world size 2, normal DDP against
``trainer.world_size_invariant=true``, both measured in one run of this script.

    python scripts/bench_invariant.py                    # recipe=mnist, 2 ranks, 600 steps, 3 rounds
    python scripts/bench_invariant.py --steps 300 --rounds 5 -- backend=mpi

Each round runs the CLI once per mode, alternating (so load on a shared machine hits both alike),
and reads ``time/train_s`` (the training loop only: no start-up, no evaluation) from
``metrics.json``. The figure is the median over rounds of the per-step time; the script prints both,
their ratio, and whether it is within the target (1.25x). Exit status 0 unless a run fails.

Then the floor the mode cannot go under (``--no-floor`` skips it): the shards' compute alone. One
process per rank, at the same time, each running the recipe's ``training_step`` forward and
backward on real training samples (in ``trainer.precision``), one thread, with nothing else: a
rank's samples of a step as one batch (what normal DDP computes) against the same samples as the
rank's shards one after another (what the mode must compute: each shard's bits may not depend on
the others). Added to normal DDP's step, that difference is the cheapest the mode could be with
free bookkeeping and a free exact sum.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import queue as queue_module
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from torch.utils.data import default_collate

TARGET = 1.25
MODES = {"normal": "trainer.world_size_invariant=false", "invariant": "trainer.world_size_invariant=true"}


def run_once(mode: str, steps: int, world_size: int, recipe: str, extra: list[str], out: Path) -> float:
    """One CLI run; its training seconds per step."""
    run_dir = out / f"{mode}-{len(list(out.iterdir()))}"
    cmd = [
        sys.executable,
        "-m",
        "ddptrain",
        f"recipe={recipe}",
        f"dist.world_size={world_size}",
        f"trainer.max_steps={steps}",
        "trainer.eval_every_epochs=0",
        "trainer.checkpoint.at_end=false",
        "trainer.checkpoint.every_epochs=0",
        "trainer.loggers.tensorboard=false",
        "trainer.progress=false",
        f"hydra.run.dir={run_dir}",
        MODES[mode],
        *extra,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        sys.exit(f"{mode} run failed ({proc.returncode}): {' '.join(cmd)}\n{(proc.stdout + proc.stderr)[-3000:]}")
    metrics = json.loads((run_dir / "metrics.json").read_text())
    return metrics["time/train_s"] / metrics["step"]


def _compute_worker(overrides: list[str], world_size: int, rank: int, repeats: int, queue) -> None:
    """One rank's forward+backward times (ms, median): its step's samples as one batch, and as shards."""
    import torch

    from ddptrain.cli.app import compose_config, to_config
    from ddptrain.runner import load_trainer_class
    from ddptrain.trainer.precision import Precision

    torch.set_num_threads(1)  # as both modes run at 2 ranks on this machine's cores
    config = to_config(compose_config(overrides), None)
    trainer_class = load_trainer_class(config)
    trainer_class.prepare_data(config)
    trainer = trainer_class(config)
    model, dataset = trainer.configure_model().train(), trainer.train_dataloader()
    precision = Precision(config.trainer.precision, torch.device("cpu"))
    per_rank, accumulation = config.data.global_batch_size // world_size, config.trainer.grad_accum_steps
    shard = config.data.global_batch_size // (accumulation * config.trainer.virtual_ranks)
    times: dict[str, list[float]] = {"one batch": [], "shards": []}
    for step in range(repeats):
        first = (step * world_size + rank) * per_rank % (len(dataset) - per_rank)  # real samples, in turn
        batch = default_collate([dataset[i] for i in range(first, first + per_rank)])
        for mode, size in (("one batch", per_rank // accumulation), ("shards", shard)):  # per micro-batch
            started = time.perf_counter()
            for begin in range(0, per_rank, size):
                with precision.autocast():  # trainer.precision (bf16-mixed: bfloat16 autocast)
                    loss = trainer.training_step(model, [part[begin : begin + size] for part in batch])
                precision.backward(loss)
            times[mode].append(time.perf_counter() - started)
    queue.put({mode: statistics.median(values[repeats // 5 :]) * 1000 for mode, values in times.items()})


def compute_floor(recipe: str, extra: list[str], world_size: int, repeats: int = 300) -> dict[str, float]:
    """Per-rank forward+backward ms of one batch and of its shards (the median over ranks)."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    overrides = [f"recipe={recipe}", *extra]
    procs = [
        context.Process(target=_compute_worker, args=(overrides, world_size, r, repeats, queue))
        for r in range(world_size)
    ]
    for proc in procs:
        proc.start()
    results = []
    deadline = time.monotonic() + 1800
    while len(results) < len(procs):
        try:
            results.append(queue.get(timeout=1))
        except queue_module.Empty:
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                for proc in procs:
                    proc.kill()
                sys.exit(f"the compute measurement failed (worker exit codes {failed}, or over 30 min): see above")
    for proc in procs:
        proc.join(timeout=60)
    return {mode: statistics.median(r[mode] for r in results) for mode in results[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # more than an epoch (469 steps at 2 ranks): the first steps of a run are not typical (the
    # exact sum's guessed scales fit differently as the gradients shrink)
    parser.add_argument("--steps", type=int, default=600, help="optimizer steps per run")
    parser.add_argument("--rounds", type=int, default=3, help="runs per mode (alternating)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--recipe", default="mnist")
    parser.add_argument("--no-floor", action="store_true", help="skip the shards' compute measurement")
    parser.add_argument("overrides", nargs="*", help="extra CLI overrides for both modes (after --)")
    args = parser.parse_args(argv)
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory(prefix="bench_invariant_") as tmp:
        for _ in range(args.rounds):
            for mode in MODES:
                times[mode].append(run_once(mode, args.steps, args.world_size, args.recipe, args.overrides, Path(tmp)))
    median = {mode: statistics.median(values) for mode, values in times.items()}
    ratio = median["invariant"] / median["normal"]
    for mode, values in times.items():
        runs = ", ".join(f"{v * 1000:.1f}" for v in values)
        print(f"{mode:>9}: {median[mode] * 1000:.2f} ms/step median (runs: {runs} ms/step)")
    verdict = "within" if ratio <= TARGET else "OVER"
    print(f"invariant/normal at world size {args.world_size}: {ratio:.3f}x ({verdict} the {TARGET}x target)")
    if not args.no_floor:
        floor = compute_floor(args.recipe, args.overrides, args.world_size)
        extra_ms = floor["shards"] - floor["one batch"]
        print(
            f"    floor: forward+backward of a rank's samples {floor['one batch']:.2f} ms as one batch, "
            f"{floor['shards']:.2f} ms as its shards (+{extra_ms:.2f} ms); normal DDP's step plus that: "
            f"{(median['normal'] * 1000 + extra_ms) / (median['normal'] * 1000):.3f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
