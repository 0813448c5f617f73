"""``recipe=mnist_fast`` against the tutorial's ``recipe=mnist``, measured in the same run.

Runs ``python -m ddptrain recipe=<name>`` for both recipes (alternating, ``--repeats`` times each,
2 local workers unless told otherwise) and prints each run's test accuracy, training seconds (the
epoch loops: ``time/train_s`` of ``metrics.json``) and whole-fit seconds, then the medians and the
ratio fast/tutorial of the training seconds. ``--` followed by overrides applies them to both.

    .venv/bin/python scripts/bench_recipes.py [--repeats 1] [--world-size 2] [-- key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPES = ("mnist", "mnist_fast")


def run_recipe(recipe: str, world_size: int, overrides: list[str], run_dir: Path) -> dict:
    """One ``python -m ddptrain`` run; its ``metrics.json``."""
    cmd = [sys.executable, "-m", "ddptrain", f"recipe={recipe}", f"dist.world_size={world_size}"]
    cmd += ["trainer.progress=false", f"hydra.run.dir={run_dir}", *overrides]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads((run_dir / "metrics.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("overrides", nargs="*", help="config overrides applied to both recipes")
    args = parser.parse_args()
    results: dict[str, list[dict]] = {r: [] for r in RECIPES}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for recipe in RECIPES if i % 2 == 0 else reversed(RECIPES):  # alternate: drift hits both
                m = run_recipe(recipe, args.world_size, args.overrides, Path(tmp) / f"{recipe}-{i}")
                results[recipe].append(m)
                print(
                    f"{recipe:<11} run {i + 1}: accuracy {m['eval/accuracy']:.4f}  train {m['time/train_s']:7.1f} s"
                    f"  fit {m['time/fit_s']:7.1f} s  epochs {m['epoch']}",
                    flush=True,
                )
    median = {
        r: {k: statistics.median(m[k] for m in results[r]) for k in ("eval/accuracy", "time/train_s")} for r in RECIPES
    }
    print(f"\nmedians over {args.repeats} run(s) each, {args.world_size} workers, {os.cpu_count()} cores:")
    print("| recipe | test accuracy | training s |")
    print("|---|---|---|")
    for r in RECIPES:
        print(f"| `recipe={r}` | {median[r]['eval/accuracy'] * 100:.2f}% | {median[r]['time/train_s']:.1f} |")
    ratio = median["mnist_fast"]["time/train_s"] / median["mnist"]["time/train_s"]
    print(f"training time ratio mnist_fast / mnist: {ratio:.2f}")


if __name__ == "__main__":
    main()
