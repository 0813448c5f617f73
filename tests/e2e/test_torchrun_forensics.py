"""Hang forensics under torchrun: a user script (``ddptrain.comm`` only, no Trainer, no ledger
directory set) where rank 1 is stuck in ``time.sleep``; the job must end soon after the timeout
with a message naming rank 1 and the line it is stuck on."""

import re
import subprocess
import time

import pytest

from tests.conftest import TORCHRUN, cli_env

# timed: its tests bound durations (scripts/test.sh runs this phase after the parallel one)
pytestmark = [pytest.mark.timed, pytest.mark.e2e, pytest.mark.timeout(120)]

SCRIPT = """\
import time
from datetime import timedelta

import torch

import ddptrain.comm as dist

dist.init_process_group("gloo", timeout=timedelta(seconds=4))
t = torch.ones(4)
dist.all_reduce(t)
if dist.get_rank() == 1:
    time.sleep(60)  # stuck here
dist.all_reduce(t)
"""


def test_a_rank_stuck_in_user_code_is_named_with_its_line_under_torchrun(tmp_path):
    (tmp_path / "stuck.py").write_text(SCRIPT)
    started = time.monotonic()
    proc = subprocess.run(
        [TORCHRUN, "--standalone", "--nproc-per-node=2", "stuck.py"],
        cwd=tmp_path,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=90,
    )
    elapsed = time.monotonic() - started
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert elapsed < 4 + 5 + 10, f"took {elapsed:.1f} s (timeout 4 s; +10 s for torchrun's start and stop)"
    assert re.search(r"rank 1 \(pid \d+\) never arrived at collective #2", out), out[-3000:]
    assert "it is now in stuck.py:12 in <module>: `time.sleep(60)  # stuck here`" in out, out[-3000:]
