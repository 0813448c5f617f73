"""``trainer.compile=true`` against eager mode on ``recipe=mnist_fast``, measured in the same run.

Runs ``python -m ddptrain recipe=mnist_fast`` with and without ``trainer.compile=true``
(alternating, ``--repeats`` times each) for ``--windows`` logging windows of ``--steps`` optimizer
steps, and reads each window's throughput from the run's ``metrics.csv``. The first window holds
the compilation (and the allocator's warm-up) and is reported apart; the steady step time is the
median of the others. Also printed: the mean wait at the end of backward for the gradient
all-reduces (``train/comm_wait_s``), which tells whether the buckets still overlap the backward.

    .venv/bin/python scripts/bench_compile.py [--repeats 2] [--steps 20] [--windows 4] [-- key=value ...]
"""

from __future__ import annotations

import argparse
import csv
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def run(compile_: bool, args: argparse.Namespace, run_dir: Path) -> dict:
    """One run: the first window's seconds per step, the steady median, the mean comm wait."""
    steps = args.steps * args.windows
    cmd = [sys.executable, "-m", "ddptrain", "recipe=mnist_fast", f"trainer.compile={str(compile_).lower()}"]
    cmd += [f"trainer.max_steps={steps}", f"trainer.log_every_steps={args.steps}", "trainer.progress=false"]
    cmd += ["trainer.eval_every_epochs=0", "trainer.limit_val_batches=1", "trainer.checkpoint.at_end=false"]
    cmd += ["trainer.checkpoint.every_epochs=0", f"hydra.run.dir={run_dir}", *args.overrides]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    with open(run_dir / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/samples_per_s")]
    batch = yaml.safe_load((run_dir / "hparams.yaml").read_text())["data"]["global_batch_size"]
    per_step = [batch / float(r["train/samples_per_s"]) for r in rows]
    waits = [float(r["train/comm_wait_s"]) for r in rows[1:]]
    return {"first": per_step[0], "steady": statistics.median(per_step[1:]), "wait": statistics.mean(waits)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per logging window")
    parser.add_argument("--windows", type=int, default=4, help="windows per run (the first holds the compilation)")
    parser.add_argument("overrides", nargs="*", help="config overrides applied to both")
    args = parser.parse_args()
    results: dict[bool, list[dict]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for compile_ in (False, True) if i % 2 == 0 else (True, False):  # alternate: drift hits both
                r = run(compile_, args, Path(tmp) / f"{compile_}-{i}")
                results[compile_].append(r)
                print(
                    f"compile={compile_!s:<5} run {i + 1}: first window {r['first'] * 1e3:7.1f} ms/step, "
                    f"steady {r['steady'] * 1e3:6.1f} ms/step, comm wait at backward's end {r['wait'] * 1e3:5.2f} ms",
                    flush=True,
                )
    eager = statistics.median(r["steady"] for r in results[False])
    compiled = statistics.median(r["steady"] for r in results[True])
    first = statistics.median(r["first"] for r in results[True])
    print(
        f"median steady step: eager {eager * 1e3:.1f} ms, compiled {compiled * 1e3:.1f} ms; "
        f"compiled/eager = {compiled / eager:.2f}; compiled first window {first * 1e3:.0f} ms/step (compilation)"
    )


if __name__ == "__main__":
    main()
