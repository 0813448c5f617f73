"""Elastic membership under chaos: a random member killed every few seconds, and restarted.

    .venv/bin/python scripts/bench_elastic.py [--members 4] [--duration 60] [--every 5]

Starts ``python -m ddptrain.store`` and ``--members`` members
(``python -m ddptrain.testing.elastic_member``: one all-reduce per step, 20 ms apart). Every
``--every`` seconds (+-30%) it SIGKILLs a random member, rank 0 included, and starts a new one in
its place at once, as a launcher that restarts dead workers does. Then it reads the members' event
log and prints, per kill, the victim's rank and the seconds from the kill

- to the survivors' next completed step (in a generation after the kill), and
- to the first step at full size again (the restarted member admitted);

their medians and maxima, and whether every step's sum counted exactly its generation's members
and each member's steps went on without a gap or a repeat. Measured figures go to
benchmarks/README.md with the command and the date.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ddptrain.testing.elastic_member import check_events

PYTHON = sys.executable
REPO = Path(__file__).resolve().parents[1]


def _events(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _start(port: int, member: str, world_size: int, log: Path, env: dict) -> subprocess.Popen:
    args = ["--store", f"127.0.0.1:{port}", "--id", member, "--world-size", str(world_size), "--log", str(log)]
    return subprocess.Popen(
        [PYTHON, "-m", "ddptrain.testing.elastic_member", *args], env=env, stderr=subprocess.DEVNULL
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of kills")
    parser.add_argument("--every", type=float, default=5.0, help="seconds between kills (+-30%%)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    env = {**os.environ, "PYTHONPATH": str(REPO), "DDPTRAIN_LEDGER_DIR": "off"}
    work = Path(tempfile.mkdtemp(prefix="bench-elastic-"))
    log = work / "events.jsonl"
    store = subprocess.Popen(
        [PYTHON, "-m", "ddptrain.store", "--port", "0"], stdout=subprocess.PIPE, text=True, env=env
    )
    port = int(store.stdout.readline().rsplit(":", 1)[1])
    members = {f"m{i}": _start(port, f"m{i}", args.members, log, env) for i in range(args.members)}
    kills = []  # (time, victim, its rank, the last generation before the kill)
    try:
        deadline = time.monotonic() + 120
        while len({e["member"] for e in _events(log) if e["event"] == "step"}) < args.members:
            if time.monotonic() > deadline:
                raise SystemExit(f"the members did not start within 120 s; see {work}")
            time.sleep(0.1)
        end = time.monotonic() + args.duration
        while time.monotonic() < end:
            time.sleep(args.every * rng.uniform(0.7, 1.3))
            events = _events(log)
            generation = max(e["number"] for e in events if e["event"] == "generation")
            ranks = {e["member"]: e["rank"] for e in events if e["event"] == "generation" and e["number"] == generation}
            alive = [m for m in ranks if members[m].poll() is None]
            victim = rng.choice(alive)
            kills.append((time.time(), victim, ranks[victim], generation))
            members[victim].send_signal(signal.SIGKILL)
            new = f"m{len(members)}"
            members[new] = _start(port, new, args.members, log, env)
        time.sleep(args.every)  # the last replacement is admitted
        from ddptrain.comm.store import connect

        connect(f"127.0.0.1:{port}").prefixed("elastic").set(
            "stop", "1"
        )  # the members' namespace: rank 0 stops them at a boundary
        for proc in members.values():
            proc.wait(timeout=60)
    finally:
        for proc in [*members.values(), store]:
            if proc.poll() is None:
                proc.kill()
    events = _events(log)
    steps = [e for e in events if e["event"] == "step"]
    print(
        f"{args.members} members, {len(kills)} SIGKILLs over {args.duration:g} s, "
        f"a step every ~20 ms (cores: {os.cpu_count()})"
    )
    recovery, full = [], []
    for at, victim, rank, generation in kills:
        later = [e for e in steps if e["t"] > at and e["gen"] > generation]
        back = [e for e in later if e["size"] == args.members]
        r = min(e["t"] for e in later) - at if later else float("nan")
        f = min(e["t"] for e in back) - at if back else float("nan")
        recovery.append(r)
        full.append(f)
        print(f"  killed {victim} (rank {rank}): next step after {r:.3f} s, full size again after {f:.3f} s")
    print(f"kill -> the survivors' next step: median {statistics.median(recovery):.3f} s, max {max(recovery):.3f} s")
    print(f"kill -> full size again: median {statistics.median(full):.3f} s, max {max(full):.3f} s")
    problems = check_events(events)
    codes = {m: p.returncode for m, p in members.items()}
    ok = [m for m, c in codes.items() if c == 0]
    print(f"members that finished cleanly: {len(ok)} (killed: {len(kills)}); steps: {max(e['step'] for e in steps)}")
    print(
        "every step counted its generation's members, and no member skipped or repeated a step"
        if not problems
        else "PROBLEMS:\n  " + "\n  ".join(problems[:20])
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
