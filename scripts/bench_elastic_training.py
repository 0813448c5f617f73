"""Elastic training (``trainer.elastic=true``) measured from outside: chaos, and the cost when nothing fails.

    .venv/bin/python scripts/bench_elastic_training.py chaos [--steps 9000] [--every 20] [--seed 0] [--spares 0 1]
        [--world-size 4]
    .venv/bin/python scripts/bench_elastic_training.py overhead [--steps 400] [--rounds 5] [--normal]

``chaos``: ``python -m ddptrain recipe=mnist trainer.world_size_invariant=true trainer.elastic=true
dist.world_size=4`` (``--world-size``), once per ``--spares`` value (``launcher.spares``), no checkpoints written (so
none can be read), one log line per step. Every ``--every`` seconds (+-30%) this script SIGKILLs a
random member of the current generation (rank 0 included; the members are read from the job's
store, the pids from the launcher's ``member X started (slot S, pid P)`` lines), and the launcher
restarts it.
Per kill it prints the seconds from the kill to the next step rank 0 logs (the survivors' next
completed step) and to the first line saying the group is back at full size; then their median and
max, whether every kill is a change in the log, and whether the final ``params_sha256`` equals that
of the same training run uninterrupted (1 rank, not elastic: invariant mode's bits do not depend on
the world size).

``overhead``: the same job at 4 ranks with and without ``trainer.elastic=true``, alternating, and the
median of ``time/train_s`` of each; the ratio is the cost of being elastic when nothing fails (the
heartbeat thread, rank 0 asking the store for newcomers every 0.1 s). ``--normal``: both without
invariant mode, so the elastic side also reads its shares of each global batch by position.

Measured figures go to benchmarks/README.md with the command and the date.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ddptrain.comm.store import connect

PYTHON = sys.executable
REPO = Path(__file__).resolve().parents[1]
COMMON = [
    "recipe=mnist",
    "trainer.world_size_invariant=true",
    "trainer.progress=false",
    "trainer.loggers.tensorboard=false",
    "trainer.loggers.csv=false",
    "trainer.eval_every_epochs=0",
]
NO_CHECKPOINTS = ["trainer.checkpoint.every_epochs=0", "trainer.checkpoint.at_end=false"]


def _job(run_dir: Path, *overrides: str, invariant: bool = True) -> list[str]:
    common = COMMON if invariant else [o for o in COMMON if not o.startswith("trainer.world_size_invariant")]
    return [PYTHON, "-m", "ddptrain", *common, f"hydra.run.dir={run_dir}", *overrides]


def _metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


def chaos(args: argparse.Namespace, work: Path) -> int:
    steps = f"trainer.max_steps={args.steps}"
    epochs = f"trainer.epochs={-(-args.steps // 469)}"
    runs = {n: _chaos_run(args, work / f"chaos-spares{n}", n, steps, epochs) for n in args.spares}
    reference = work / "reference"
    ref = subprocess.run(
        _job(reference, steps, epochs, "dist.world_size=1", *NO_CHECKPOINTS), cwd=REPO, capture_output=True
    )
    expected = _metrics(reference)["params_sha256"] if ref.returncode == 0 else None
    same = {n: run is not None and _metrics(run)["params_sha256"] == expected for n, run in runs.items()}
    for n in args.spares:
        print(f"launcher.spares={n}: final params_sha256 equal to the uninterrupted run's: {same[n]}")
    return 0 if all(same.values()) else 1


def _members(store, lines: list[tuple[float, str]]) -> list[str]:
    """The current generation's members, read from the job's store (its address is in the log)."""
    if store[0] is None:
        address = next((m.group(1) for _, line in lines if (m := re.search(r"its store serves on (\S+) ", line))), None)
        if address is None:
            return []
        store[0] = connect(address).prefixed("elastic")
    latest = store[0].get("latest").decode()
    return json.loads(store[0].get(f"gen/{latest}"))["members"]


def _chaos_run(args: argparse.Namespace, run_dir: Path, spares: int, steps: str, epochs: str) -> Path | None:
    """One chaos job (see the module docstring); its directory, or None when the job failed, read a
    checkpoint or left a kill out of its record."""
    print(f"\n== launcher.spares={spares}", flush=True)
    rng = random.Random(args.seed)
    command = _job(
        run_dir,
        steps,
        epochs,
        "trainer.elastic=true",
        f"dist.world_size={args.world_size}",
        "trainer.log_every_steps=1",
    )
    command += [f"launcher.max_restarts={10**6}", f"launcher.spares={spares}", *NO_CHECKPOINTS]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    pids: dict[str, int] = {}
    lines: list[tuple[float, str]] = []  # (arrival time, line)
    kills: list[tuple[float, str]] = []
    done = threading.Event()
    store = [None]

    def read() -> None:
        for line in proc.stdout:
            lines.append((time.monotonic(), line))
            if started := re.search(r"member (\d+\.\d+) started \(slot \d+, pid (\d+)\)", line):
                pids[started.group(1)] = int(started.group(2))
        done.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    while not any("step 1/" in line for _, line in lines) and not done.is_set():
        time.sleep(0.05)
    while not done.wait(args.every * rng.uniform(0.7, 1.3)):
        try:
            members = _members(store, lines)  # a member, not a spare: its loss is a change
            victim = rng.choice(members)
            os.kill(pids[victim], signal.SIGKILL)
        except (
            IndexError,
            KeyError,
            ProcessLookupError,
            OSError,
            RuntimeError,
        ):  # RuntimeError: the job (and its store) ended
            continue
        kills.append((time.monotonic(), victim))
        print(f"SIGKILL {victim}", flush=True)
    proc.wait()
    output = "".join(line for _, line in lines)
    rows = []
    for i, (at, victim) in enumerate(kills):
        until = kills[i + 1][0] if i + 1 < len(kills) else float("inf")
        # the first step rank 0 logs after the change line that follows the kill (a step line read
        # just after the kill may be of a step completed before it)
        change = next((t for t, line in lines if t > at and "elastic: generation" in line), None)
        step = next(
            (t for t, line in lines if change and t > change and re.search(r"\]\[INFO\] step \d+/", line)), None
        )
        full = next((t for t, line in lines if t > at and re.search(rf"-> {args.world_size} rank\(s\)", line)), None)
        rows.append((victim, None if step is None else step - at, None if full is None or full > until else full - at))
    print(f"\n{'victim':>8} {'to next step (s)':>17} {'to full size (s)':>17}")
    for victim, step, full in rows:
        print(
            f"{victim:>8} {step if step is None else f'{step:.3f}':>17} {full if full is None else f'{full:.3f}':>17}"
        )
    to_step = [s for _, s, _ in rows if s is not None]
    to_full = [f for _, _, f in rows if f is not None]
    if to_step:
        print(f"kill -> next completed step: median {statistics.median(to_step):.3f} s, max {max(to_step):.3f} s")
    if to_full:
        print(f"kill -> back at full size: median {statistics.median(to_full):.3f} s, max {max(to_full):.3f} s")
    changes = _metrics(run_dir)["membership_changes"] if (run_dir / "metrics.json").exists() else []
    lost = sorted(m for c in changes for m in c["left"])
    print(
        f"kills: {len(kills)}; lost in metrics.json: {len(lost)}; change lines: {output.count('elastic: generation')}"
    )
    print(f"checkpoint read: {'resumed from' in output}; exit code {proc.returncode}")
    recorded = sorted(v for _, v in kills) == lost
    return run_dir if proc.returncode == 0 and recorded and "resumed from" not in output else None


def overhead(args: argparse.Namespace, work: Path) -> int:
    times: dict[bool, list[float]] = {False: [], True: []}
    for r in range(args.rounds):
        for elastic in (r % 2 == 0, r % 2 == 1):
            run_dir = work / f"{r}-{elastic}"
            overrides = [
                f"trainer.max_steps={args.steps}",
                "dist.world_size=4",
                f"trainer.elastic={str(elastic).lower()}",
            ]
            job = _job(run_dir, *overrides, *NO_CHECKPOINTS, invariant=not args.normal)
            subprocess.run(job, cwd=REPO, capture_output=True, check=True)
            times[elastic].append(_metrics(run_dir)["time/train_s"])
            print(f"round {r}: elastic={elastic}: time/train_s {times[elastic][-1]:.3f}", flush=True)
    plain, elastic = statistics.median(times[False]), statistics.median(times[True])
    print(f"\nmedian time/train_s of {args.steps} steps: plain {plain:.3f} s, elastic {elastic:.3f} s")
    print(f"elastic / plain: {elastic / plain:.3f}x")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    c = sub.add_parser("chaos")
    c.add_argument("--steps", type=int, default=9000)
    c.add_argument("--every", type=float, default=20.0, help="seconds between kills (+-30%%)")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--world-size", type=int, default=4, help="dist.world_size of the chaos runs")
    c.add_argument("--spares", type=int, nargs="+", default=[0, 1], help="launcher.spares of each chaos run")
    o = sub.add_parser("overhead")
    o.add_argument("--steps", type=int, default=400)
    o.add_argument("--rounds", type=int, default=5)
    o.add_argument("--normal", action="store_true", help="no invariant mode: plain DDP against elastic normal mode")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-elastic-training-"))
    print(f"runs in {work}")
    return chaos(args, work) if args.mode == "chaos" else overhead(args, work)


if __name__ == "__main__":
    raise SystemExit(main())
