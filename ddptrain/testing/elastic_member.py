"""One member of an elastic job, for tests and benchmarks of :mod:`ddptrain.comm.elastic`:

    python -m ddptrain.testing.elastic_member --store HOST:PORT --id a --world-size 3 --steps 500 --log events.jsonl

Each step is one all-reduce of ones (its sum must be the generation's size) that also carries
rank 0's two questions to everyone: do newcomers wait (then all regroup at this boundary), and is
the job asked to stop (the store key ``stop``). A failed collective makes the member regroup with
the survivors. After each new generation the members agree on the step to go on from (the
furthest any of them got). Every event is one JSON line appended to ``--log``, which the caller
reads from outside: ``generation`` (number, rank, size, step), ``step`` (step, gen, size, total),
``failed`` (the error), ``done``. Rank 0 stops the job at a step boundary once the key ``stop`` is set in the
membership's namespace (``Store(...).prefixed("elastic").set("stop", "1")``).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

import ddptrain.comm as dist
from ddptrain.comm.elastic import ElasticMembership
from ddptrain.comm.store import connect


def run_member(
    membership: ElasticMembership,
    world_size: int,
    steps: int,
    log_path: str,
    timeout_s: float = 3.0,
    stall_at_step: int = -1,
    stall_s: float = 0.0,
) -> dict:
    """The member's loop (see the module docstring) until ``steps``; its id, last rank and step.
    ``stall_at_step``: before that step, compute (sleep) ``stall_s`` seconds, once."""
    torch.set_num_threads(1)
    log = open(log_path, "a", buffering=1)  # noqa: SIM115 - one line per event, closed at the end
    member = membership.id

    def say(**record) -> None:
        log.write(json.dumps({"member": member, "pid": os.getpid(), "t": time.time(), **record}) + "\n")

    def form(step: int):
        """The new generation's group, and the step everyone goes on from (a newcomer knows none)."""
        while True:
            try:
                pg = membership.new_process_group(timeout_s=timeout_s)
                agreed = torch.tensor([float(step)])
                dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
                g = membership.generation
                say(event="generation", number=g.number, rank=pg.rank(), size=pg.size(), step=int(agreed.item()))
                return pg, int(agreed.item())
            except dist.CommError:
                membership.regroup(timeout_s=timeout_s + 2)  # lost another member meanwhile

    membership.join(world_size, timeout_s=60)
    pg, step = form(0)
    while step < steps:
        try:
            asks = [0.0, 0.0]
            if pg.rank() == 0:
                asks = [float(membership.newcomers_waiting()), float(membership.store.check(["stop"]))]
            if step + 1 == stall_at_step:
                stall_at_step = -1  # once: the step is taken again after the others regroup
                say(event="stall", step=step)
                time.sleep(stall_s)  # a long computation: alive (heartbeat), but not at the collective
            t = torch.tensor([1.0, *asks])
            dist.all_reduce(t)
            step += 1
            say(event="step", step=step, gen=membership.generation.number, size=pg.size(), total=t[0].item())
            if t[2] > 0:
                break
            time.sleep(0.02)
            if t[1] > 0:
                membership.regroup(timeout_s=timeout_s + 2)
                pg, step = form(step)
        except dist.CommError as exc:
            say(event="failed", step=step, error=str(exc).splitlines()[0][:200])
            membership.regroup(timeout_s=timeout_s + 2)
            pg, step = form(step)
    say(event="done", step=step)
    rank = pg.rank()
    dist.destroy_process_group()
    membership.close()
    log.close()
    return {"member": member, "rank": rank, "step": step}


def check_events(events: list[dict]) -> list[str]:
    """What went wrong in a job's event log (every member's lines, in order): a step whose sum is
    not its generation's size, or a member whose steps do not follow each other (a new generation
    goes on from the step the members agreed on). Empty when nothing did."""
    problems = [
        f"step sum {e['total']} in a generation of {e['size']}: {e}"
        for e in events
        if e["event"] == "step" and e["total"] != e["size"]
    ]
    for member in sorted({e["member"] for e in events}):
        expected = None
        for e in (e for e in events if e["member"] == member):
            if e["event"] == "generation":
                expected = e["step"] + 1
            elif e["event"] == "step":
                if e["step"] != expected:
                    problems.append(f"{member}: step {e['step']} where step {expected} was due")
                expected = e["step"] + 1
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddptrain.testing.elastic_member")
    parser.add_argument("--store", required=True, help="HOST:PORT of python -m ddptrain.store")
    parser.add_argument("--id", required=True, help="this member's unique id")
    parser.add_argument("--world-size", type=int, required=True, help="members of the first generation")
    parser.add_argument("--steps", type=int, default=10**9, help="stop after this step")
    parser.add_argument("--log", required=True, help="the JSON-lines event log (appended to)")
    parser.add_argument("--timeout-s", type=float, default=3.0, help="the groups' collective timeout")
    parser.add_argument("--dead-after-s", type=float, default=3.0, help="heartbeat silence that means dead")
    parser.add_argument("--stall-at-step", type=int, default=-1, help="before this step, compute for --stall-s")
    parser.add_argument("--stall-s", type=float, default=0.0, help="seconds of that stall (alive, not arriving)")
    args = parser.parse_args(argv)
    membership = ElasticMembership(connect(args.store), args.id, dead_after_s=args.dead_after_s)
    run_member(membership, args.world_size, args.steps, args.log, args.timeout_s, args.stall_at_step, args.stall_s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
