"""How long ``python -m ddptrain`` takes to start: a one-step job, a config typo, ``--help``.

Each command runs from an empty temporary directory, ``--rounds`` times (default 3); the script
prints the median wall time of each, and for the job also the time until ``train.log`` shows
step 1 (polled every 20 ms while the job runs: the first step as a user watching the log sees it).

Two anchors alternate with the job in each round, and the job's time is printed as a ratio to each:

- ``torch floor``: one process imports torch, builds an SGD optimizer and takes one step. No
  trainer that uses ``torch.optim`` starts faster on the machine (the first optimizer imports
  ``torch._dynamo``, 1.5-2.5 s here).
- ``torch DDP``: the same step on 2 gloo ranks started by ``torch.multiprocessing.spawn``, wrapped
  in ``torch.nn.parallel.DistributedDataParallel``: the script a torch user would write.

    .venv/bin/python scripts/bench_start.py [--rounds 3]

``--compare DIR [DIR ...]`` is an A/B of start-up across checkouts instead (``git worktree add``):
the one-step job of ``recipe=synthetic`` and ``recipe=mnist_fast`` (MNIST from ``$DDPTRAIN_DATA``
or ``$DDPTRAIN_DATA_SOURCES``), run with ``PYTHONPATH`` set to each checkout in turn, alternating
within each round; medians and ranges of the job and of its first step.

Measured figures go to benchmarks/README.md with the command and the date.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PYTHON = sys.executable
JOB = "job (recipe=synthetic trainer.max_steps=1, 2 workers)"
COMMANDS = {
    JOB: ["recipe=synthetic", "trainer.max_steps=1"],
    "typo (trainer.max_stepz=1)": ["recipe=synthetic", "trainer.max_stepz=1"],
    "--help": ["--help"],
    "--help trainer.max_steps": ["--help", "trainer.max_steps"],
    "--version": ["--version"],
}

_ONE_STEP = """
import torch
model = torch.nn.Linear(784, 10)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model(torch.randn(64, 784)).sum().backward()
optimizer.step()
"""
_TORCH_DDP = """
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank, port):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(784, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(64, 784)).sum().backward()
    optimizer.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as s:  # a free port: a fixed one may still be held from the last run (TIME_WAIT)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(port,), nprocs=2)
"""
ANCHORS = {
    "torch floor (1 process, one SGD step)": _ONE_STEP,
    "torch DDP (mp.spawn, 2 gloo ranks, one step)": _TORCH_DDP,
}


def _run_anchor(code: str, timeout_s: float = 300) -> float:
    """Wall seconds of a python script holding ``code``, run from an empty directory."""
    with tempfile.TemporaryDirectory(prefix="bench-start-") as cwd:
        script = Path(cwd) / "anchor.py"  # a file, not -c: spawn re-imports the main module
        script.write_text(code)
        started = time.monotonic()
        proc = subprocess.run([PYTHON, str(script)], cwd=cwd, timeout=timeout_s, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"the anchor exited {proc.returncode}:\n{proc.stderr[-2000:]}")
        return time.monotonic() - started


def _run_once(args: list[str], timeout_s: float = 300) -> tuple[float, float | None, int]:
    """(wall seconds, seconds until train.log shows step 1 or None, exit status) of one run."""
    with tempfile.TemporaryDirectory(prefix="bench-start-") as cwd:
        started = time.monotonic()
        err = open(Path(cwd) / "stderr.txt", "w+")  # noqa: SIM115 - read back after the run
        proc = subprocess.Popen([PYTHON, "-m", "ddptrain", *args], cwd=cwd, stdout=subprocess.DEVNULL, stderr=err)
        first_step = None
        deadline = started + timeout_s
        while proc.poll() is None and time.monotonic() < deadline:
            if first_step is None:
                for log in Path(cwd).glob("outputs/*/*/train.log"):
                    if re.search(r"\] step 1/", log.read_text()):
                        first_step = time.monotonic() - started
            time.sleep(0.02)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        wall = time.monotonic() - started
        err.seek(0)
        if proc.returncode not in (0, 2) and args[0] != "--help":
            print(f"    (exit {proc.returncode}: {err.read()[-500:]})", file=sys.stderr)
        err.close()
        return wall, first_step, proc.returncode


def _print(name: str, runs: list[tuple[float, float | None, int]]) -> float:
    """Print the median of ``runs`` (and of their first steps) and return it."""
    wall = statistics.median(r[0] for r in runs)
    firsts = [r[1] for r in runs if r[1] is not None]
    first = f", first step after {statistics.median(firsts):.2f} s" if firsts else ""
    codes = sorted({r[2] for r in runs})
    print(
        f"  {name}: {wall:.2f} s{first} (exit {', '.join(map(str, codes))}; runs: "
        f"{', '.join(f'{r[0]:.2f}' for r in runs)})",
        flush=True,
    )
    return wall


def compare(checkouts: list[str], rounds: int) -> None:
    """The one-step jobs of each checkout (through ``PYTHONPATH``), alternating within each round."""
    recipes = ("synthetic", "mnist_fast")
    runs: dict[tuple[str, str], list] = {(c, r): [] for c in checkouts for r in recipes}
    for _ in range(rounds):
        for checkout in checkouts:
            os.environ["PYTHONPATH"] = str(Path(checkout).resolve())
            for recipe in recipes:
                runs[checkout, recipe].append(_run_once([f"recipe={recipe}", "trainer.max_steps=1"]))
    print(f"one-step jobs, {rounds} rounds; median (range) of the job and of its first step")
    for (checkout, recipe), done in runs.items():
        ok = [r for r in done if r[2] == 0 and r[1] is not None]
        if not ok:
            print(f"  {checkout} recipe={recipe}: no run finished")
            continue
        job, first = [r[0] for r in ok], [r[1] for r in ok]
        print(
            f"  {checkout} recipe={recipe}: job {statistics.median(job):.2f} s ({min(job):.2f}-{max(job):.2f}), "
            f"first step {statistics.median(first):.2f} s ({min(first):.2f}-{max(first):.2f}), {len(ok)} runs",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compare", nargs="+", metavar="DIR", help="an A/B of these checkouts' start-up")
    options = parser.parse_args()
    rounds = options.rounds
    if options.compare:
        compare(options.compare, rounds)
        return
    print(f"python -m ddptrain, from an empty directory, median of {rounds} (cores: {os.cpu_count()})")
    # The job and its anchors alternate within each round, so a slow minute slows all of them alike.
    anchor_runs: dict[str, list[float]] = {name: [] for name in ANCHORS}
    job_runs = []
    for _ in range(rounds):
        for name, code in ANCHORS.items():
            anchor_runs[name].append(_run_anchor(code))
        job_runs.append(_run_once(COMMANDS[JOB]))
    job = _print(JOB, job_runs)
    for name, runs in anchor_runs.items():
        anchor = statistics.median(runs)
        shown = ", ".join(f"{r:.2f}" for r in runs)
        print(f"  {name}: {anchor:.2f} s (runs: {shown}); the job takes {job / anchor:.2f}x")
    for name, args in COMMANDS.items():
        if name != JOB:
            _print(name, [_run_once(args) for _ in range(rounds)])


if __name__ == "__main__":
    main()
