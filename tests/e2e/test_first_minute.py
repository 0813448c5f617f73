"""The traps a newcomer met in the first minute (issue 22), each as the user met it: a real CLI
or Python run in an empty directory, observed through its files, its output and its exit status."""

import json
import re
import subprocess

import pytest

from ddptrain.config import Config
from tests.conftest import PYTHON, REPO, cli_env, run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

# Small synthetic runs: 8 steps of 128 per epoch, a 200-sample evaluation.
TINY = ["recipe=synthetic", "data.num_train_samples=1024", "data.num_val_samples=200"]


def _readme_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    return next(b for b in blocks if "class MyTrainer" in b)


def _no_mnist_env() -> dict:
    """Our environment without any place MNIST could be found (and no download: offline)."""
    env = cli_env(DDPTRAIN_DATA_SOURCES="")
    env.pop("DDPTRAIN_DATA", None)
    return env


def test_the_readmes_subclass_command_runs_with_its_own_data_and_no_mnist_anywhere(tmp_path):
    """Trap 1: the README's own command, recipe=mnist with a trainer that brings its own datasets,
    from an empty directory: the default prepare_data looked for MNIST and failed."""
    (tmp_path / "mytask.py").write_text(_readme_example())
    proc = subprocess.run(
        [PYTHON, "-m", "ddptrain", "recipe=mnist", "recipe.trainer_class=mytask.MyTrainer", "trainer.max_steps=5"],
        cwd=tmp_path,
        env=_no_mnist_env(),
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "finished on 2 rank(s) at step 5" in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mytask.py", "outputs"]  # no data/ made either


@pytest.mark.parametrize("how", ["ddptrain.run", "MyTrainer.fit"])
def test_the_python_api_writes_its_run_under_outputs_not_into_the_working_directory(tmp_path, how):
    """Trap 2: ``ddptrain.run(...)`` and ``.fit()`` put checkpoints/, ledger/, metrics.* and
    tensorboard/ into the current directory; the CLI's place is outputs/<recipe>/<time>/."""
    (tmp_path / "mytask.py").write_text(_readme_example())
    config = '{"recipe": {"trainer_class": "mytask.MyTrainer"}, "trainer": {"max_steps": 3}}'
    call = {
        "ddptrain.run": f"ddptrain.run(ddptrain.Config.from_dict({config}))",
        "MyTrainer.fit": f"MyTrainer(ddptrain.Config.from_dict({config})).fit()",
    }[how]
    script = f"import ddptrain\nfrom mytask import MyTrainer\n\nif __name__ == '__main__':\n    {call}\n"
    (tmp_path / "script.py").write_text(script)
    proc = subprocess.run(
        [PYTHON, "script.py"], cwd=tmp_path, env=_no_mnist_env(), capture_output=True, text=True, timeout=150
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "__pycache__") == [
        "mytask.py",
        "outputs",
        "script.py",
    ]
    runs = sorted((tmp_path / "outputs").glob("*/*/metrics.json"))
    assert len(runs) == 1, runs
    run_dir = runs[0].parent
    assert run_dir.parent.name == Config().recipe.name  # the default recipe's name
    assert re.fullmatch(r"\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d", run_dir.name), run_dir.name  # the CLI's pattern
    assert json.loads(runs[0].read_text())["step"] == 3
    assert (run_dir / "checkpoints").is_dir()


def test_resume_latest_without_a_run_directory_continues_the_newest_run_of_the_recipe(tmp_path):
    """Trap 3: ``trainer.resume=latest`` without the old run's directory trained from scratch, rc 0,
    with one WARNING line. Now it takes the newest run of that recipe under outputs/ ..."""
    first = run_cli(*TINY, "trainer.max_steps=4", "trainer.checkpoint.every_steps=2", cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    (old_run,) = (tmp_path / "outputs" / "synthetic").iterdir()
    resumed = run_cli(*TINY, "trainer.max_steps=6", "trainer.resume=latest", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resumed from {old_run / 'checkpoints' / 'step_000000004.pt'}" in resumed.stdout, resumed.stdout
    assert "finished on 2 rank(s) at step 6" in resumed.stdout


def test_resume_latest_with_nothing_to_resume_refuses_and_says_how(tmp_path):
    """... and with no checkpoint anywhere it refuses (rc 2), never trains from scratch silently."""
    proc = run_cli(*TINY, "trainer.max_steps=4", "trainer.resume=latest", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "trainer.resume=latest" in proc.stderr and "no checkpoint" in proc.stderr
    assert "trainer.resume=auto" in proc.stderr  # the way to say "resume if there is one"
    assert "Traceback" not in proc.stderr
    missing = run_cli(*TINY, "trainer.max_steps=4", f"trainer.resume={tmp_path / 'nowhere.pt'}", cwd=tmp_path)
    assert missing.returncode == 2, missing.stdout + missing.stderr  # a wrong path: the user's input
    assert "nowhere.pt: no such file or directory" in missing.stderr and "Traceback" not in missing.stderr
    fresh = run_cli(*TINY, "trainer.max_steps=2", "trainer.resume=auto", cwd=tmp_path)
    assert fresh.returncode == 0, fresh.stdout + fresh.stderr
    assert "trainer.resume=auto: no checkpoint" in fresh.stdout + fresh.stderr


LOGS_PROGRESS = """
import ddptrain


class LogsProgress(ddptrain.Trainer):
    def training_step(self, model, batch):
        loss = super().training_step(model, batch)
        self.log("twice_loss", 2 * loss.detach(), prog_bar=True)
        return loss
"""


def test_step_lines_can_be_silenced_and_show_prog_bar_values(tmp_path):
    """Trap 6: the console printed a line every 10 steps with no setting to turn them off, and
    ``self.log(..., prog_bar=True)`` values never appeared in them."""
    (tmp_path / "logs_progress.py").write_text(LOGS_PROGRESS)
    args = [*TINY, "trainer.epochs=1", "recipe.trainer_class=logs_progress.LogsProgress"]
    shown = run_cli(*args, "trainer.log_every_steps=4", "hydra.run.dir=shown", cwd=tmp_path)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    steps = [ln for ln in shown.stdout.splitlines() if re.search(r"\] step \d+/8 ", ln)]
    assert len(steps) == 2 and all("twice_loss=" in ln for ln in steps), shown.stdout
    quiet = run_cli(*args, "trainer.log_every_steps=0", "hydra.run.dir=quiet", cwd=tmp_path)
    assert quiet.returncode == 0, quiet.stdout + quiet.stderr
    assert not re.search(r"\] step \d+/", quiet.stdout), quiet.stdout
    assert "epoch 1/1:" in quiet.stdout and "finished on 2 rank(s) at step 8" in quiet.stdout


def test_epoch_labels_name_the_epoch_the_step_belongs_to_and_come_in_order(tmp_path):
    """Trap 8: the last flush said ``step 8/8 (epoch 2)`` on a 1-epoch run, and the best-checkpoint
    and early-stopping lines came before the epoch line they belong to."""
    proc = run_cli(
        *TINY,
        "trainer.epochs=2",
        "trainer.log_every_steps=3",  # 8 is no multiple of 3: the epoch's last steps are flushed at its end
        "trainer.checkpoint.monitor=eval/loss",
        "trainer.early_stopping.monitor=eval/loss",
        "trainer.early_stopping.patience=0",
        "trainer.early_stopping.min_delta=100",  # the second evaluation is no improvement: stop
        "hydra.run.dir=run",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    log = (tmp_path / "run" / "train.log").read_text().splitlines()
    labels = [(int(m[1]), int(m[2])) for m in (re.search(r"\] step (\d+)/16 \(epoch (\d+)\)", ln) for ln in log) if m]
    assert labels and all(epoch == (step - 1) // 8 + 1 for step, epoch in labels), labels
    order = [
        kind
        for ln in log
        for kind, pattern in (("epoch", r"\] epoch \d/2: "), ("best", r"best checkpoint"), ("stop", r"early stopping"))
        if re.search(pattern, ln)
    ]
    assert order[:2] == ["epoch", "best"] and order[-1] == "stop" and "epoch" in order[2:-1], order


PER_SAMPLE = """
import torch.nn.functional as F
import ddptrain


class PerSample(ddptrain.Trainer):
    def training_step(self, model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y, reduction="none")
"""


@pytest.mark.parametrize("invariant", [False, True])
def test_a_per_sample_loss_gets_told_to_take_the_mean(tmp_path, invariant):
    """Trap 9: a per-sample loss got only torch's "grad can be implicitly created only for scalar outputs"."""
    (tmp_path / "per_sample.py").write_text(PER_SAMPLE)
    proc = run_cli(
        *TINY,
        "recipe.trainer_class=per_sample.PerSample",
        f"trainer.world_size_invariant={str(invariant).lower()}",
        "hydra.run.dir=run",
        cwd=tmp_path,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "training_step must return the loss as one number" in proc.stderr, proc.stderr
    assert re.search(r"shape \(\d+,\)", proc.stderr) and "loss.mean()" in proc.stderr, proc.stderr
    assert "implicitly created only for scalar outputs" not in proc.stderr
