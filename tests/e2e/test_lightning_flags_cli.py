"""The Lightning-style flags on the command line: what a fast dev run leaves on disk (nothing),
what it says when the recipe is broken, and ``trainer.max_time``'s stop, line and resume."""

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import PYTHON, REPO, TORCHRUN, cli_env, run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

TINY = ["recipe=synthetic", "data.num_train_samples=512", "data.num_val_samples=200", "trainer.progress=false"]


def _files(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _dev_run_dirs(temp):
    """The fast dev runs' temporary directories in ``temp`` (torch's own caches may be there too)."""
    return [p.name for p in temp.iterdir() if p.name.startswith("ddptrain-fast-dev-run-")]


def test_a_fast_dev_run_writes_nothing_and_says_it_worked(tmp_path):
    work, temp = tmp_path / "work", tmp_path / "tmp"
    work.mkdir(), temp.mkdir()
    proc = run_cli(*TINY, "trainer.fast_dev_run=2", cwd=work, env={"TMPDIR": str(temp)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    passed = "ddptrain: fast_dev_run passed: 2 batch(es) per rank of training, validation and test on 2 rank(s)"
    assert passed in proc.stdout
    assert "epoch 1/1" in proc.stdout + proc.stderr  # it did train: one epoch of 2 steps
    assert _files(work) == [] and _dev_run_dirs(temp) == []  # no run directory, checkpoint, log or temp left


def test_a_fast_dev_run_under_torchrun_leaves_no_rank_s_directory(tmp_path):
    work, temp = tmp_path / "work", tmp_path / "tmp"
    work.mkdir(), temp.mkdir()
    flags = [*TINY, "launcher=torchrun", "trainer.fast_dev_run=true"]
    command = [TORCHRUN, "--nproc-per-node=2", "-m", "ddptrain", *flags]
    proc = subprocess.run(command, cwd=work, env=cli_env(TMPDIR=str(temp)), capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "fast_dev_run passed: 1 batch(es)" in proc.stdout
    assert _files(work) == [] and _dev_run_dirs(temp) == []


@pytest.mark.skipif(
    shutil.which("mpiexec", path=str(Path(sys.executable).parent)) is None,
    reason="mpiexec not installed next to this Python (pip install 'ddptrain[mpi]')",
)
def test_a_fast_dev_run_on_backend_mpi_leaves_nothing_either(tmp_path):
    work, temp = tmp_path / "work", tmp_path / "tmp"
    work.mkdir(), temp.mkdir()
    proc = run_cli(*TINY, "backend=mpi", "trainer.fast_dev_run=true", cwd=work, env={"TMPDIR": str(temp)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "mpiexec -n 2" in proc.stdout + proc.stderr and "fast_dev_run passed: 1 batch(es)" in proc.stdout
    assert _files(work) == [] and _dev_run_dirs(temp) == []


def test_a_fast_dev_run_says_what_broke_and_keeps_the_traceback(tmp_path):
    broken = "recipe.trainer_class=tests.e2e.broken_validation.BrokenValidation"
    proc = run_cli(*TINY, broken, "trainer.fast_dev_run=true", cwd=tmp_path, env={"PYTHONPATH": str(REPO)})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    error = proc.stderr.strip().splitlines()
    expected = r"ddptrain: error: fast_dev_run failed: rank \d failed: RuntimeError: validation_step is broken"
    assert re.match(expected, error[0]), proc.stderr
    assert "error.log" in proc.stderr  # where the full traceback is


def test_max_time_stops_with_a_checkpoint_exit_0_and_a_resume_line_that_works(tmp_path):
    run_dir = tmp_path / "run"
    slow = [
        *TINY,
        "recipe.trainer_class=tests.e2e.slow_trainer.SlowTrainer",
        "data.num_train_samples=2560",  # 20 steps of 40 ms per epoch
        "trainer.epochs=3",
        "trainer.max_time=00:00:00:02",
        f"hydra.run.dir={run_dir}",
    ]
    proc = run_cli(*slow, cwd=tmp_path, env={"PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = re.search(r"ddptrain: stopped by trainer.max_time at step (\d+) \((\S+)\)\. Resume with: (.+)", proc.stdout)
    assert line, proc.stdout
    step, checkpoint = int(line.group(1)), line.group(2)
    assert 0 < step < 60 and checkpoint.endswith(".pt") and (tmp_path / checkpoint).exists()
    resume = shlex.split(line.group(3))
    assert resume[:3] == [PYTHON, "-m", "ddptrain"] and f"trainer.resume={run_dir}" in resume
    again = subprocess.run(
        [*resume, "trainer.max_time=null"],
        cwd=tmp_path,
        env=cli_env(PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"resumed from {tmp_path / checkpoint}: step {step}," in again.stdout + again.stderr
    assert "at step 60" in again.stdout
