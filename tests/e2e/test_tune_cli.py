"""``python -m ddptrain.tune lr|batch_size``: real runs on the local launcher, their files and lines."""

import json

import pytest

from ddptrain.tune.lr_find import smoothed, suggest
from tests.conftest import PYTHON, run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

TINY = ["recipe=synthetic", "data.num_train_samples=2560", "data.num_val_samples=200", "trainer.progress=false"]
TUNE = [PYTHON, "-m", "ddptrain.tune"]


def test_the_lr_finder_writes_its_plot_and_data_and_prints_the_override(tmp_path):
    proc = run_cli("lr", *TINY, "lr_find.num_training=40", "--apply", cwd=tmp_path, prefix=TUNE)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (run,) = (tmp_path / "outputs" / "lr_find").iterdir()
    result = json.loads((run / "lr_find.json").read_text())
    lrs, losses = result["lr"], result["loss"]
    assert 12 <= len(lrs) <= 40 and lrs[0] == pytest.approx(1e-8) and all(b > a for a, b in zip(lrs, lrs[1:]))
    assert losses == pytest.approx(smoothed(result["raw_loss"]))
    assert result["rule"] == "minimum" and result["suggestion"] == suggest(lrs, losses, "minimum")
    assert lrs[10] / 10 <= result["suggestion"] <= lrs[-2] / 10
    said = f"ddptrain: lr_find suggests optimizer.lr={result['suggestion']:.3g} (lr_find.suggestion=minimum, over "
    said += f"{len(lrs)} rates from {lrs[0]:.3g} to {lrs[-1]:.3g}; plot: {run / 'lr_find.png'})"
    assert said in proc.stdout, proc.stdout
    assert proc.stdout.strip().splitlines()[-1] == f"optimizer.lr={result['suggestion']:.3g}"
    png = (run / "lr_find.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    assert matplotlib.image.imread(run / "lr_find.png").shape[:2] == (400, 600)  # 6 x 4 inches at 100 dpi
    assert not list(run.glob("checkpoints/*.pt"))  # the spent weights are not kept


def test_the_batch_size_finder_doubles_until_the_limit_and_writes_nothing(tmp_path):
    search = ["--max-memory-gb", "100", "--max-trials", "3", "--apply"]
    proc = run_cli("batch_size", *TINY, *search, cwd=tmp_path, prefix=TUNE)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.strip().startswith("per-rank batch")]
    assert [int(r.split()[2].rstrip(":")) for r in rows] == [1, 2, 4] and all("peak" in r for r in rows)
    assert "the largest per-rank batch that fits is 4 (data.global_batch_size=8 on 2 rank(s))" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1] == "data.global_batch_size=8"
    assert not (tmp_path / "outputs").exists()

    proc = run_cli("batch_size", *TINY, "--max-memory-gb", "0.01", cwd=tmp_path, prefix=TUNE)
    assert proc.returncode == 1 and "not even a batch of 1 per rank fits under the limit" in proc.stderr
    assert "peak" in proc.stdout and "> 10 MB" in proc.stdout


def test_the_batch_size_finder_on_cpu_needs_a_memory_limit(tmp_path):
    proc = run_cli("batch_size", *TINY, cwd=tmp_path, prefix=TUNE)
    assert proc.returncode == 2 and "on CPU give a memory limit, --max-memory-gb G" in proc.stderr
    proc = run_cli("speed", *TINY, cwd=tmp_path, prefix=TUNE)
    assert proc.returncode == 2 and "say what to tune: lr or batch_size" in proc.stderr
