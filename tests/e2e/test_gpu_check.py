"""``scripts/gpu_check.sh``, the one prepared run for a lent GPU, in its CPU dry run: every check it
would run on the GPU runs here small, and the table it prints says pass for each (a check that
cannot run here fails the table, and so this test, long before a GPU is lent)."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import PYTHON, REPO, cli_env

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]


def _gpu_check(*args: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "scripts/gpu_check.sh", *args],
        cwd=REPO,
        env=cli_env(PYTHON=PYTHON, **env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_the_dry_run_passes_every_line_of_its_table(tmp_path, mnist_root):
    only = ("--only", "tests,resume,bench")  # the resume check trains recipe=mnist: the real MNIST, found here
    done = _gpu_check("--dry-run", *only, "--out", str(tmp_path), DDPTRAIN_DATA=str(mnist_root))
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    lines = json.loads((tmp_path / "gpu_check.json").read_text())
    names = [line["name"] for line in lines]
    assert {line["status"] for line in lines} == {"pass"}, lines
    assert "tests/cuda test_our_ddp_equals_torch_ddp_bitwise[no_sync]" in names
    assert "tests/cuda test_zero_equals_plain_ddp_bitwise[2]" in names
    assert {"ctrl-c and resume", "step time gpt2", "step time small_tensors"} <= set(names)
    assert (tmp_path / "gpu_check.md").read_text().startswith("device: cpu (dry run)\n| check | result | figure | s |")


def test_without_a_gpu_it_says_so_and_names_the_dry_run():
    done = _gpu_check("--only", "bench", timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "torch.cuda.is_available() is False here; run it on a GPU, or --dry-run" in done.stderr
    bad = _gpu_check("--dry-run", "--only", "mnist,gpus", timeout=60)
    assert bad.returncode == 2 and "--only gpus: the parts are tests,mnist,resume,doctor,bench" in bad.stderr
