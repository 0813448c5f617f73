"""trainer.precision from the command line: the MNIST smoke run in bf16-mixed on CPU (2 ranks)
trains (the smoke check passes) with parameters identical on every rank."""

import json

import pytest

from tests.conftest import run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_bf16_mixed_smoke_run_on_mnist(tmp_path, mnist_root):
    run_dir = tmp_path / "run"
    proc = run_cli(
        "recipe=mnist",
        "trainer=smoke",
        "trainer.precision=bf16-mixed",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
        env={"DDPTRAIN_DATA": str(mnist_root)},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "smoke check passed" in proc.stdout
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["params_agree"] and metrics["eval/samples"] == 10000
    assert metrics["train/loss_last"] < metrics["train/loss_first"]
    assert (run_dir / "metrics.csv").read_text().startswith("step,train/loss")


def test_16_mixed_on_cpu_is_a_short_error(tmp_path):
    proc = run_cli("recipe=mnist", "trainer.precision=16-mixed", cwd=tmp_path)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "trainer.precision=16-mixed needs trainer.device=cuda" in proc.stderr
