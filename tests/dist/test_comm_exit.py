"""A gloo job ends cleanly right after its last collective.

gloo's worker threads release a finished work's tensors a moment after ``wait()`` returns, and
that takes the GIL: a process that was already finalizing Python died of SIGABRT ("terminate
called without an active exception") after a run that had succeeded (seen as a failed torchrun
job in CI). Observed from outside: the backend's threads (by their names in /proc), and real
2-process jobs' exit codes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
import torch

import ddptrain.comm as dist
from ddptrain.launch import find_free_port
from tests.conftest import PYTHON, REPO, cli_env

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]

SCRIPT = str(REPO / "tests" / "dist" / "exit_after_collective.py")
STOPPED_SCRIPT = str(REPO / "tests" / "dist" / "stop_while_waiting.py")


def _start(script: str) -> list[subprocess.Popen]:
    url = f"tcp://127.0.0.1:{find_free_port()}"
    return [
        subprocess.Popen(
            [PYTHON, script, url, str(rank)],
            cwd=REPO,
            env=cli_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]


def _job() -> list[tuple[int, str]]:
    ranks = _start(SCRIPT)
    try:
        outputs = [p.communicate(timeout=60)[0] for p in ranks]
        return [(p.returncode, out) for p, out in zip(ranks, outputs)]
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()


def _gloo_worker_threads() -> set[str]:
    """Thread ids of this process whose name torch gives gloo's work queue threads."""
    found = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            if open(f"/proc/self/task/{tid}/comm").read().strip() == "pt_gloo_runloop":
                found.add(tid)
        except OSError:  # ended meanwhile
            pass
    return found


def test_destroy_process_group_joins_gloo_worker_threads():
    """The trainer keeps its group referenced (its DDP model does) after destroying it: the
    backend's threads must end at the destroy, not when Python finalizes."""
    before = _gloo_worker_threads()
    group = dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{find_free_port()}", world_size=1, rank=0)
    outs = [torch.empty(3)]
    dist.all_gather(outs, torch.ones(3))
    # After a collective the work threads run and carry their name (read right after the init,
    # a thread not yet renamed was missed once, under the suite's load).
    started = _gloo_worker_threads() - before
    dist.destroy_process_group()
    assert started, "no gloo worker thread was seen: the check below would prove nothing"
    # a joined thread can stay listed in /proc for a moment (the kernel wakes the joiner first)
    deadline = time.monotonic() + 3
    while started & _gloo_worker_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not started & _gloo_worker_threads(), f"{group!r} was destroyed but its gloo threads still run"


def test_a_job_that_ends_with_an_unwaited_collective_exits_0():
    for attempt in range(4):
        for rank, (code, out) in enumerate(_job()):
            failed = code != 0 or "terminate called" in out
            assert not failed, f"job {attempt}, rank {rank}: exit {code}\n{out[-3000:]}"


def test_a_rank_stopped_by_a_signal_inside_a_stuck_collective_destroys_its_group_at_once():
    """A launcher's SIGTERM (torchrun taking a host's workers away) reaches a rank blocked on a
    dead peer: destroying the group must abandon the stuck work, not join it until the collective
    timeout (then the launcher's SIGKILL comes first and the rank's clean-up never runs)."""
    ranks = _start(STOPPED_SCRIPT)
    try:
        assert ranks[0].stdout.readline().strip() == "waiting"
        time.sleep(0.5)  # inside the all_reduce by now
        ranks[0].send_signal(signal.SIGTERM)
        try:
            out = ranks[0].communicate(timeout=20)[0]
        except subprocess.TimeoutExpired:
            pytest.fail("rank 0 was still destroying its group 20 s after the SIGTERM (the timeout is 60 s)")
        assert ranks[0].returncode == 0, out
        assert float(out.split("destroyed in ")[1].split()[0]) < 5, out
    finally:
        for p in ranks:
            p.kill()
            p.wait()
