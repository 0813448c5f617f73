"""The command line as users run it: ``python -m ddptrain ...`` in a subprocess, each with a timeout.

Runs happen in a temporary working directory, so a stray output folder would show. MNIST comes
from the ``mnist_root`` fixture: a data root ddptrain's own loader prepared once per session.
"""

import json
import re
import time
from pathlib import Path

import pytest

from tests.conftest import PYTHON, TORCHRUN, check_run_log, run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

# Small synthetic runs: 8 steps of 128 per epoch, a 200-sample evaluation.
TINY = ["recipe=synthetic", "data.num_train_samples=1024", "data.num_val_samples=200", "trainer.epochs=1"]
MPIRUN = Path(PYTHON).parent / "mpirun"


def _short_error(proc, *words):
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) <= 15, proc.stderr
    for word in words:
        assert word in proc.stderr, f"{word!r} not in:\n{proc.stderr}"


# mnist_fast: BatchNorm buffers must agree too, and it trains in bf16-mixed (trainer.precision)
@pytest.mark.parametrize("recipe", ["mnist", "mnist_fast"])
def test_smoke_run_mnist(tmp_path, mnist_root, recipe):
    run_dir = tmp_path / "run"
    proc = run_cli(
        f"recipe={recipe}",
        "trainer=smoke",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
        env={"DDPTRAIN_DATA": str(mnist_root)},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "smoke check passed" in proc.stdout and "finished on 2 rank(s) at step 40" in proc.stdout
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["params_agree"] and metrics["train/loss_last"] < metrics["train/loss_first"]
    assert metrics["eval/samples"] == 10000 and metrics["world_size"] == 2
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert (run_dir / "metrics.csv").read_text().startswith("step,train/loss")
    assert [p.name for p in (run_dir / "checkpoints").glob("*.pt")] == ["step_000000040.pt"]
    check_run_log(run_dir, proc.stdout, steps_logged=[10, 20, 30, 40])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # one output directory, nothing else


def test_cfg_job_prints_the_composed_config(tmp_path):
    every = "trainer.checkpoint.every_steps=7"
    proc = run_cli(
        "recipe=mnist", "dist.world_size=4", "trainer.epochs=1", every, "--cfg", "job", cwd=tmp_path, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"\n  checkpoint:\n    every_epochs: 1\n    every_steps: 7\n", proc.stdout), proc.stdout
    for line in (
        "trainer_class: ddptrain.recipes.mnist.MnistTrainer",
        "world_size: 4",
        "epochs: 1",
        "lr: 0.01",
        "momentum: 0.5",
        "global_batch_size: 128",
        "_target_: ddptrain.recipes.mnist.Net",
    ):
        assert line in proc.stdout
    helped = run_cli("--help", cwd=tmp_path, timeout=60)
    assert helped.returncode == 0 and "recipe: fashion_mnist, mnist, mnist_fast, synthetic" in helped.stdout, (
        helped.stderr
    )
    assert not list(tmp_path.iterdir())  # printing the config or the help writes nothing
    script = Path(PYTHON).parent / "ddptrain"  # the console script, from any directory
    if script.exists():
        proc = run_cli("recipe=fashion_mnist", "--cfg", "job", cwd=tmp_path, timeout=60, prefix=[str(script)])
        assert proc.returncode == 0 and "FashionMnistTrainer" in proc.stdout, proc.stderr


@pytest.mark.parametrize(
    "override, words",
    [
        (
            "recipe=mnst",
            ["unknown recipe 'mnst'", "Did you mean recipe=mnist?", "fashion_mnist, mnist, mnist_fast, synthetic"],
        ),
        ("backend=glo", ["unknown backend 'glo'", "Did you mean backend=gloo?"]),
        ("launcher=torchrn", ["unknown launcher 'torchrn'", "Did you mean launcher=torchrun?"]),
        ("model=tutorial", ["unknown model 'tutorial'", "Did you mean model=tutorial_net?"]),
        ("data=fashion", ["unknown data 'fashion'", "Did you mean data=fashion_mnist?"]),
        ("optimizer=adam", ["unknown optimizer 'adam'", "Did you mean optimizer=adamw?"]),
        ("trainer=smok", ["unknown trainer 'smok'", "Did you mean trainer=smoke?"]),
        ("trainer.epoch=3", ["unknown config key trainer.epoch.", "Did you mean trainer.epochs?"]),
        ("+trainer.epoch=3", ["unknown config key trainer.epoch.", "Did you mean trainer.epochs?"]),
        ("dist.world_sise=3", ["Did you mean dist.world_size?"]),
        ("launcher.max_restart=1", ["Did you mean launcher.max_restarts?"]),
        ("data.global_batch=64", ["Did you mean data.global_batch_size?"]),
        ("optimizer.scheduler.nam=cosine", ["Did you mean optimizer.scheduler.name?"]),
        ("recipe.nme=x", ["Did you mean recipe.name?"]),
        ("trainer.devices=2", ["Did you mean dist.world_size?", "Lightning's Trainer(devices=...)"]),
        ("trainer.accumulate_grad_batches=2", ["Did you mean trainer.grad_accum_steps?"]),
        ("trainer.epochs=ten", ["trainer.epochs=ten", "could not be converted to Integer"]),
    ],
)
def test_a_typo_in_any_group_gets_did_you_mean_and_exit_2(tmp_path, override, words):
    args = [override] if override.startswith("recipe=") else ["recipe=mnist", override]
    proc = run_cli(*args, f"hydra.run.dir={tmp_path / 'r'}", cwd=tmp_path, timeout=60)
    _short_error(proc, *words)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "r").exists()


def test_a_missing_recipe_lists_them(tmp_path):
    proc = run_cli("trainer.epochs=1", cwd=tmp_path, timeout=60)
    _short_error(proc, "choose a recipe: recipe=<name>, one of fashion_mnist, mnist, mnist_fast, synthetic")
    assert proc.returncode == 2


def test_nccl_backend_group_selects_cuda(tmp_path):
    proc = run_cli("recipe=mnist", "backend=nccl", "--cfg", "job", cwd=tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout
    assert "backend: nccl" in job
    assert "device: cuda" in job.split("trainer:", 1)[1], job


def test_version_names_ddptrain_and_torch(tmp_path):
    import torch

    import ddptrain

    proc = run_cli("--version", cwd=tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().startswith(f"ddptrain {ddptrain.__version__} (torch {torch.__version__.split('+')[0]}")
    assert "Hydra" not in proc.stdout


def test_global_batch_not_divisible(tmp_path):
    proc = run_cli("recipe=mnist", "dist.world_size=3", f"hydra.run.dir={tmp_path / 'r'}", cwd=tmp_path, timeout=90)
    _short_error(proc, "data.global_batch_size=128", "dist.world_size=3", "multiple of 3")
    assert proc.returncode == 2


def test_dataset_missing_offline_is_one_short_error_in_cli_terms(tmp_path):
    # No MNIST anywhere (no sources, an empty root): the default tries to download, which fails on an
    # offline machine (and is forbidden here with data.download=false, so it fails the same way online).
    empty = tmp_path / "empty-root"
    empty.mkdir()
    env = {"DDPTRAIN_DATA_SOURCES": ""}
    started = time.monotonic()
    proc = run_cli(
        "recipe=mnist",
        f"data.root={empty}",
        "data.download=false",
        f"hydra.run.dir={tmp_path / 'r'}",
        cwd=tmp_path,
        timeout=90,
        env=env,
    )
    assert time.monotonic() - started < 60
    _short_error(
        proc,
        "MNIST was not found and it was not downloaded (data.download=true allows it",
        "train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, t10k-images-idx3-ubyte.gz, t10k-labels-idx1-ubyte.gz",
        str(empty / "MNIST" / "raw"),
        "data.root=<dir>",
        "DDPTRAIN_DATA_SOURCES",
    )
    assert proc.returncode == 1
    assert len(proc.stderr.strip().splitlines()) <= 3, proc.stderr


def test_files_in_data_root_are_used_without_any_download(tmp_path, mnist_root):
    """A proxy that records connections: with the files in data.root nothing may reach it."""
    import socket
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    connections = []

    def accept():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            connections.append(conn)

    threading.Thread(target=accept, daemon=True).start()
    proxy = f"http://127.0.0.1:{listener.getsockname()[1]}"
    env = {
        "DDPTRAIN_DATA_SOURCES": "",
        "http_proxy": proxy,
        "https_proxy": proxy,
        "HTTP_PROXY": proxy,
        "HTTPS_PROXY": proxy,
    }
    try:
        proc = run_cli(
            "recipe=mnist",
            "trainer.max_steps=2",
            "dist.world_size=1",
            f"data.root={mnist_root}",
            f"hydra.run.dir={tmp_path / 'r'}",
            cwd=tmp_path,
            timeout=150,
            env=env,
        )
    finally:
        listener.close()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert connections == [], "a download was attempted although data.root held the files"


def test_sweep_runs_every_point(tmp_path):
    proc = run_cli(
        "-m",
        *TINY,
        "dist.world_size=1",
        "trainer.max_steps=3",
        "trainer.seed=1,2",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        cwd=tmp_path,
        timeout=200,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    digests = []
    for job in ("0", "1"):
        metrics = json.loads((tmp_path / "sweep" / job / "metrics.json").read_text())
        assert metrics["step"] == 3 and metrics["world_size"] == 1
        digests.append(metrics["params_sha256"])
    assert digests[0] != digests[1]  # the seeds differ, so do the models
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep"]


@pytest.fixture(scope="module")
def torchrun_run(tmp_path_factory):
    """A 2-rank job started by torchrun: every process runs the CLI, rank 0 picks the directory."""
    cwd = tmp_path_factory.mktemp("torchrun")
    run_dir = cwd / "run"
    proc = run_cli(
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "ddptrain",
        *TINY,
        "trainer.max_steps=6",
        "trainer.checkpoint.every_steps=3",
        f"hydra.run.dir={run_dir}",
        "launcher=torchrun",
        cwd=cwd,
        timeout=200,
        prefix=[TORCHRUN],
    )
    return cwd, run_dir, proc


# The torchrun_run tests share one pytest-xdist worker (scripts/test.sh runs --dist loadgroup), so the job runs once.
@pytest.mark.xdist_group("cli-torchrun")
@pytest.mark.skipif(not Path(TORCHRUN).exists(), reason="torchrun is not installed next to the Python used")
def test_torchrun_job_uses_one_directory(torchrun_run):
    cwd, run_dir, proc = torchrun_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "finished on 2 rank(s) at step 6" in proc.stdout
    assert sorted(p.name for p in cwd.iterdir()) == ["run"]
    assert [p.name for p in sorted((run_dir / "checkpoints").glob("*.pt"))] == [
        "step_000000003.pt",
        "step_000000006.pt",
    ]
    assert json.loads((run_dir / "metrics.json").read_text())["params_agree"]
    check_run_log(run_dir, proc.stdout, steps_logged=[6])


@pytest.mark.xdist_group("cli-torchrun")
@pytest.mark.skipif(not Path(TORCHRUN).exists(), reason="torchrun is not installed next to the Python used")
def test_resume_errors_and_fallback(torchrun_run):
    cwd, run_dir, proc = torchrun_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    newest = run_dir / "checkpoints" / "step_000000006.pt"
    # Another world size: refused before any worker starts, with both sizes and the way out.
    refused = run_cli(
        *TINY, "dist.world_size=1", f"trainer.resume={run_dir}", f"hydra.run.dir={cwd / 'ws1'}", cwd=cwd, timeout=90
    )
    _short_error(refused, "saved with 2 rank(s), not 1", "trainer.allow_world_size_change=true")
    # A truncated checkpoint: refused, and nothing deleted.
    newest.write_bytes(newest.read_bytes()[:1000])
    corrupt = run_cli(*TINY, f"trainer.resume={newest}", f"hydra.run.dir={cwd / 'bad'}", cwd=cwd, timeout=90)
    _short_error(corrupt, "is corrupt or truncated", "step_000000003.pt")
    assert newest.is_file() and (run_dir / "checkpoints" / "step_000000003.pt").is_file()
    # resume=latest in the same directory: skips the corrupt one with a warning, continues from step 3.
    resumed = run_cli(
        *TINY, "trainer.max_steps=8", "trainer.resume=latest", f"hydra.run.dir={run_dir}", cwd=cwd, timeout=150
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "skipping checkpoint" in resumed.stderr and "step_000000006.pt" in resumed.stderr
    assert "resumed from" in resumed.stdout and "step_000000003.pt" in resumed.stdout
    assert "at step 8" in resumed.stdout


@pytest.mark.skipif(not MPIRUN.exists(), reason="mpirun is not installed next to the Python used")
def test_mpirun_job_on_the_mpi_backend(tmp_path):
    """Under mpirun (no MASTER_ADDR) backend=auto picks mpi; every rank runs the CLI, one directory."""
    proc = run_cli(
        "-n",
        "2",
        "--oversubscribe",
        PYTHON,
        "-m",
        "ddptrain",
        *TINY,
        "trainer.max_steps=4",
        "launcher=mpirun",
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
        timeout=150,
        prefix=[str(MPIRUN)],
        env={"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "finished on 2 rank(s) at step 4" in proc.stdout
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["params_agree"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_the_readmes_trainer_example_runs_as_written(tmp_path):
    import re

    from tests.conftest import REPO

    example = next(
        b for b in re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S) if "class MyTrainer" in b
    )
    (tmp_path / "mytask.py").write_text(example)
    proc = run_cli(
        "recipe=synthetic",
        "recipe.trainer_class=mytask.MyTrainer",
        "trainer.max_steps=10",
        "hydra.run.dir=run",
        cwd=tmp_path,
        timeout=150,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "training MyTrainer on 2 rank(s)" in proc.stdout
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["step"] == 10
