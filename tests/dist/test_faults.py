"""Faults: a killed worker ends the job promptly, a hung collective names the missing rank,
diverged replicas are caught."""

import os
import signal
import time
from pathlib import Path

import pytest
import torch

import ddptrain.comm as dist
from ddptrain.ddp import DistributedDataParallel as DDP
from ddptrain.launch import WorkerFailedError
from ddptrain.testing import run_distributed
from tests.conftest import spawned_workers

# timed: its tests bound durations (scripts/test.sh runs this phase after the parallel one)
pytestmark = [pytest.mark.timed, pytest.mark.dist, pytest.mark.timeout(120)]


def _killed_body(rank, ws, pid_dir):
    Path(pid_dir, f"rank{rank}.pid").write_text(str(os.getpid()))
    t = torch.ones(1)
    dist.all_reduce(t)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    while True:  # rank 0 keeps communicating with a peer that is gone
        dist.all_reduce(t)


def test_sigkill_of_rank_1_ends_the_job_naming_rank_and_signal(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(WorkerFailedError) as err:
        run_distributed(_killed_body, 2, str(tmp_path), timeout_s=60, comm_timeout_s=30)
    assert time.monotonic() - t0 < 30
    killed_pid = int((tmp_path / "rank1.pid").read_text())  # written by rank 1 itself, before it died
    assert err.value.rank == 1 and err.value.exitcode == -signal.SIGKILL
    message = str(err.value)
    # The text a user reads names the rank (with its pid, seen from outside the launcher) and the signal.
    assert message.startswith(f"rank 1 (pid {killed_pid}) killed by signal SIGKILL "), message
    assert spawned_workers() == []  # rank 0 was stopped too, nothing left behind


def _hung_body(rank, ws):
    t = torch.ones(4)
    pg = dist.get_process_group()
    pg.all_reduce(t).wait()
    if rank == 2:
        time.sleep(20)  # held elsewhere: never reaches the next all-reduce in time
        return "late"
    pg.all_reduce(t).wait()


def test_hung_collective_times_out_naming_the_missing_rank():
    t0 = time.monotonic()
    with pytest.raises(WorkerFailedError) as err:
        run_distributed(_hung_body, 3, timeout_s=60, comm_timeout_s=3)
    assert time.monotonic() - t0 < 20
    text = str(err.value)
    assert "CommTimeoutError: all_reduce on group 'world'" in text
    assert "Rank(s) [2] never arrived at this all_reduce (collective #2 of the group)" in text, text


def _desync_body(rank, ws):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    ddp = DDP(model)
    ddp.check_parameters_in_sync()  # fine right after construction
    if rank == 1:
        with torch.no_grad():
            model.weight[0, 0] += 1e-3  # a write outside DDP's control
    try:
        ddp.check_parameters_in_sync()
    except RuntimeError as exc:
        return str(exc)
    return "not caught"


def test_desync_guard_names_the_diverged_rank():
    for msg in run_distributed(_desync_body, 3, timeout_s=60):
        assert "rank(s) [1] diverged from the others" in msg, msg
