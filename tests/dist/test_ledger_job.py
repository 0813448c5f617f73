"""The ledger in running jobs: the default check (no waiting on the call, silent mismatches still
named), and the dump of a live job through ``python -m ddptrain.dump`` and the launcher's SIGUSR1."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

import ddptrain.comm as dist
from ddptrain.comm.ledger_check import CollectiveMismatchError
from ddptrain.testing import run_distributed
from tests.conftest import PYTHON, REPO

# timed: its tests bound durations (scripts/test.sh runs this phase after the parallel one)
pytestmark = [pytest.mark.timed, pytest.mark.dist, pytest.mark.timeout(120)]


def _default_check_body(rank, ws):
    out = {}
    # async_op=True returns before the peers arrive (torch's semantics): rank 1 comes 1 s late
    if rank == 1:
        time.sleep(1.0)
    start = time.monotonic()
    work = dist.all_reduce(torch.ones(4), async_op=True)
    out["async_s"] = time.monotonic() - start
    work.wait()
    # another reduce op on one rank: gloo reduces without a word (2 instead of 3); the ledger check
    # (DDPTRAIN_CHECK_EVERY=1) names it. The last rank to call it finds the mismatch before it
    # starts the collective; the others then fail in it, with the ledgers' verdict.
    op = dist.ReduceOp.MAX if rank == 1 else dist.ReduceOp.SUM
    try:
        dist.all_reduce(torch.ones(4), op=op)  # LINE:silent
        dist.all_reduce(torch.ones(1))
        out["mismatch"] = "not caught"
    except dist.CommError as exc:
        out["mismatch"] = f"{type(exc).__name__}: {exc}"
    time.sleep(1.0)
    return out


def test_default_check_returns_async_calls_at_once_and_names_a_silent_mismatch():
    results = run_distributed(
        _default_check_body, 3, timeout_s=90, comm_timeout_s=10, env={"DDPTRAIN_CHECK_EVERY": "1"}
    )
    line = next(n for n, text in enumerate(Path(__file__).read_text().splitlines(), 1) if "# LINE:silent" in text)
    assert results[0]["async_s"] < 0.5, results[0]  # rank 1 arrived a second later
    assert any(out["mismatch"].startswith(CollectiveMismatchError.__name__) for out in results), results
    for out in results:
        msg = out["mismatch"]
        assert "rank 1 diverged first, at collective #" in msg, msg
        assert f"rank 1 called all_reduce of float32[4] MAX from tests/dist/test_ledger_job.py:{line}" in msg, msg
        assert "ranks [0, 2] called all_reduce of float32[4] SUM" in msg, msg


JOB = """
import sys, time, torch
import ddptrain.comm as dist
from ddptrain.testing import run_distributed


def body(rank, ws, stop_file):
    import os
    while True:  # the ranks stop together: each one's look at the stop file travels in the reduction
        t = torch.tensor([float(os.path.exists(stop_file)), 0.0, 0.0, 0.0])
        dist.all_reduce(t)  # LINE:job
        if t[0] > 0:
            return "done"
        time.sleep(0.05)


if __name__ == "__main__":
    print(run_distributed(body, 2, sys.argv[1], timeout_s=90, comm_timeout_s=30), flush=True)
"""


def test_dump_and_the_launchers_sigusr1_show_a_live_job_without_stopping_it(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    ledgers, stop = tmp_path / "ledger", tmp_path / "stop"
    env = {**os.environ, "PYTHONPATH": str(REPO), "DDPTRAIN_LEDGER_DIR": str(ledgers)}
    job = subprocess.Popen(
        [PYTHON, str(script), str(stop)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while len(list(ledgers.glob("rank*.ledger"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)  # a few collectives on record
        dump = subprocess.run(
            [PYTHON, "-m", "ddptrain.dump", str(tmp_path)], env=env, capture_output=True, text=True, timeout=30
        )
        assert dump.returncode == 0, dump.stderr
        for rank in (0, 1):
            assert f"rank {rank} (pid " in dump.stdout, dump.stdout
        assert dump.stdout.count('job.py", line 1') == 2, dump.stdout  # each rank's stack, in body's loop
        assert "world: all_reduce of float32[4] SUM from job.py:11 in body" in dump.stdout, dump.stdout
        job.send_signal(signal.SIGUSR1)  # the launcher prints the same on stderr
        time.sleep(2.0)
        stop.write_text("")
        out, err = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait(10)
    assert job.returncode == 0 and "['done', 'done']" in out, (out, err)
    assert "rank 1 (pid " in err and "all_reduce of float32[4] SUM from job.py:11 in body" in err, err
    assert err.count('job.py", line 1') >= 2, err
