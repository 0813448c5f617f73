"""The traps a trial as a new user met (issue 50), each as the user met it: the CLI run in a
directory of one's own, observed through its output, its files and its exit status."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

import pytest

from tests.conftest import PYTHON, cli_env, run_cli, sigint_at_default

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def _recipe(tmp_path, name: str, text: str):
    (tmp_path / "my_conf" / "recipe").mkdir(parents=True, exist_ok=True)
    (tmp_path / "my_conf" / "recipe" / f"{name}.yaml").write_text(text)


def test_config_dir_goes_anywhere_on_the_command_line(tmp_path):
    """argparse took Hydra's overrides as one run: ``--config-dir`` between two of them left the
    second 'unrecognized'."""
    _recipe(tmp_path, "mine", "# @package _global_\ndefaults:\n  - synthetic\nrecipe:\n  name: mine\n")
    proc = run_cli("recipe=mine", "--config-dir", "my_conf", "trainer.max_steps=3", "--cfg", "job", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "unrecognized arguments" not in proc.stderr
    assert "  name: mine\n" in proc.stdout and "  max_steps: 3\n" in proc.stdout, proc.stdout


def test_a_recipe_file_without_its_package_header_is_told_to_add_it(tmp_path):
    _recipe(tmp_path, "nohead", "defaults:\n  - synthetic\ntrainer:\n  max_steps: 3\n")
    proc = run_cli("--config-dir", "my_conf", "recipe=nohead", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Key 'trainer' not in 'RecipeConfig'" in proc.stderr
    assert "recipe/nohead.yaml sets the top-level section trainer: make its first line '# @package _global_'" in (
        proc.stderr
    )
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    # another mistake in a recipe file (a value of the wrong type) gets Hydra's reason, and no such hint
    _recipe(tmp_path, "badvalue", "# @package _global_\ndefaults:\n  - synthetic\ntrainer:\n  max_steps: many\n")
    bad = run_cli("--config-dir", "my_conf", "recipe=badvalue", cwd=tmp_path)
    assert bad.returncode == 2, bad.stdout + bad.stderr
    assert bad.stderr.startswith("ddptrain: error: In 'recipe/badvalue'") and "@package" not in bad.stderr, bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr


def test_ddptrain_doctor_is_the_doctor(tmp_path):
    """The README calls the tool ``ddptrain doctor``: it was an unknown override."""
    proc = run_cli("doctor", "recipe=synthetic", "--cfg", "job", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "  doctor: true\n" in proc.stdout, proc.stdout  # the doctor's own window settings were added


_UNUSED = """
import torch
from torch import nn

import ddptrain


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.spare = nn.Linear(784, 10), nn.Linear(784, 10)

    def forward(self, x):
        return self.used(x.flatten(1))


class Unused(ddptrain.Trainer):
    def configure_model(self):
        return Head()
"""


def test_a_parameter_without_a_gradient_is_refused_with_the_config_key_that_allows_it(tmp_path):
    """DDP's refusal named its own keyword, find_unused_parameters=True: a ddptrain user sets a key."""
    (tmp_path / "unused.py").write_text(_UNUSED)
    proc = run_cli(
        "recipe=synthetic", "recipe.trainer_class=unused.Unused", "data.num_train_samples=512",
        "dist.world_size=1", "trainer.max_steps=3", cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "these did not: spare.weight, spare.bias" in proc.stderr, proc.stderr
    assert "or set dist.find_unused_parameters=true (slower" in proc.stderr, proc.stderr
    assert "DistributedDataParallel(..., find_unused_parameters=True)" not in proc.stderr


def _ctrl_c_once_hydra_made(tmp_path, hydra_dir: str, *args: str) -> tuple[int, str, str]:
    """A terminal's Ctrl-C to ``python -m ddptrain recipe=synthetic ... args`` as soon as Hydra has
    made its ``.hydra/`` (the glob ``hydra_dir`` under ``tmp_path``): (exit code, stdout, stderr)."""
    proc = subprocess.Popen(
        [PYTHON, "-m", "ddptrain", "recipe=synthetic", "trainer.max_steps=5", *args],
        cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, preexec_fn=sigint_at_default,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(hydra_dir)) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, out, err


def test_a_ctrl_c_while_starting_leaves_no_run_directory(tmp_path):
    """Stopped once Hydra has made the run directory, before any rank trained: one line, 130, and
    nothing left (there was a .hydra/ stub in outputs/ with nothing to resume)."""
    code, out, err = _ctrl_c_once_hydra_made(tmp_path, "outputs/synthetic/*/.hydra")
    assert code == 130, out + err
    assert err.strip().splitlines() == [
        "ddptrain: stopped by SIGINT (Ctrl-C): during start-up, before any rank trained: nothing to resume; "
        "run the command again"
    ], err
    assert list(tmp_path.iterdir()) == [], sorted(str(p) for p in tmp_path.rglob("*"))


def test_an_offline_first_run_leaves_no_empty_data_directory(tmp_path):
    """torchvision makes data/MNIST/raw/ before it downloads; offline, the folder stayed, empty."""
    # nowhere to find MNIST (the default root, ./data), and a download that fails at once
    env = {"DDPTRAIN_DATA": str(tmp_path / "data"), "DDPTRAIN_DATA_SOURCES": ""}
    env |= {"https_proxy": "http://127.0.0.1:9", "http_proxy": "http://127.0.0.1:9"}
    proc = run_cli("recipe=mnist", "trainer.max_steps=3", cwd=tmp_path, env=env, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "MNIST was not found and the download failed" in proc.stderr, proc.stderr
    assert list(tmp_path.iterdir()) == [], sorted(str(p) for p in tmp_path.rglob("*"))


def test_an_output_directory_that_cannot_be_written_is_one_line_and_leaves_nothing(tmp_path):
    """A read-only place gave a 30-line traceback and left a .hydra stub where it could."""
    (tmp_path / "afile").touch()
    proc = run_cli("recipe=synthetic", "hydra.run.dir=afile/run", cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"ddptrain: error: cannot write the run directory {tmp_path}/afile/run: {tmp_path}/afile is a file, not a "
        "directory. Run from a directory you can write, or choose another with hydra.run.dir=<dir>"
    ], proc.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["afile"]
    if not shutil.which("unshare") or subprocess.run(["unshare", "-m", "true"]).returncode:
        pytest.skip("needs root with unshare -m (a read-only mount of one's own)")
    (tmp_path / "ro").mkdir()
    command = f"mount -t tmpfs -o ro tmpfs ro && cd ro && exec {PYTHON} -m ddptrain recipe=synthetic"
    proc = subprocess.run(
        ["unshare", "-m", "bash", "-c", command], cwd=tmp_path, env=cli_env(), capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert f"{tmp_path}/ro is not writable (a read-only file system)" in proc.stderr, proc.stderr


_OWN_PARAMS = """
import json

from torch import nn

import ddptrain


class Mine(ddptrain.Trainer):
    def configure_model(self):
        params = self.config.recipe.params
        with open("seen.json", "w") as f:
            json.dump(dict(params), f)
        return nn.Sequential(nn.Flatten(), nn.Linear(784, params["width"]), nn.ReLU(), nn.Linear(params["width"], 10))
"""


def test_ones_own_hyperparameters_go_under_recipe_params_and_reach_the_trainer(tmp_path):
    """+gamma=0.7 and +recipe.gamma=0.7 were refused, and nothing said where one's own go."""
    (tmp_path / "mine.py").write_text(_OWN_PARAMS)
    proc = run_cli(
        "recipe=synthetic", "recipe.trainer_class=mine.Mine", "recipe.params.width=16", "recipe.params.gamma=0.7",
        "data.num_train_samples=256", "dist.world_size=1", "trainer.max_steps=2", cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "seen.json").read_text() == '{"width": 16, "gamma": 0.7}'
    refused = run_cli("recipe=synthetic", "+gamma=0.7", cwd=tmp_path)
    assert refused.returncode == 2
    assert "Your own hyperparameters go under recipe.params: recipe.params.gamma=<value>." in refused.stderr


_SCRIPT = """
import ddptrain

if __name__ == "__main__":
    config = {"recipe": {"name": "synthetic"}, "model": {"_target_": "ddptrain.recipes.mnist.Net"},
              "data": {"name": "synthetic", "num_train_samples": 512}, "trainer": {"max_steps": 3}}
    ddptrain.Trainer(ddptrain.Config.from_dict(config)).fit()
"""


def test_fit_in_a_script_logs_to_the_console_and_says_it_runs_one_process(tmp_path):
    """Trainer(config).fit() ran one process (of dist.world_size=2) without a word, and logged nothing."""
    (tmp_path / "script.py").write_text(_SCRIPT)
    proc = subprocess.run(
        [PYTHON, "script.py"], cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # a script with its own handler on ddptrain's logger gets the warning there, and no console of ours
    own = "import logging, sys\nlogging.getLogger('ddptrain').addHandler(logging.StreamHandler(sys.stderr))\n"
    (tmp_path / "own.py").write_text(own + _SCRIPT)
    mine = subprocess.run([PYTHON, "own.py"], cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=120)
    assert mine.returncode == 0, mine.stdout + mine.stderr
    assert "fit() from a script trains in this process alone" in mine.stderr and "[rank 0]" not in mine.stdout
    warning = (
        "[rank 0][WARNING] fit() from a script trains in this process alone (world size 1): it starts no workers. "
        "For dist.world_size=2 ranks run python -m ddptrain (or ddptrain.run(config)), or start the script under "
        "torchrun."
    )
    assert warning in proc.stdout, proc.stdout
    assert "[rank 0][INFO] step 3/3 (epoch 1): loss" in proc.stdout, proc.stdout
    # asked for one rank: said, not warned
    (tmp_path / "one.py").write_text(_SCRIPT.replace('"trainer": {', '"dist": {"world_size": 1}, "trainer": {'))
    one = subprocess.run([PYTHON, "one.py"], cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=120)
    assert one.returncode == 0, one.stdout + one.stderr
    assert "[rank 0][INFO] fit() from a script trains in this process alone" in one.stdout, one.stdout


def test_a_training_set_smaller_than_one_global_batch_is_warned_of_or_refused(tmp_path):
    """It trained one short step per epoch without a word, and data.drop_last=true did not stop it."""
    small = ["recipe=synthetic", "data.num_train_samples=100", "data.global_batch_size=128", "trainer.max_steps=2"]
    proc = run_cli(*small, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    said = [ln for ln in proc.stdout.splitlines() if "fewer than one global batch" in ln]
    assert len(said) == 1 and said[0].endswith(  # once, by rank 0
        "[rank 0][WARNING] the training set has 100 samples, fewer than one global batch (data.global_batch_size=128): "
        "every epoch is one step of 100 samples. Set data.global_batch_size=100 or less for full batches"
    ), proc.stdout
    exactly = run_cli(*small, "data.num_train_samples=128", cwd=tmp_path, timeout=120)  # one whole batch: fine
    assert exactly.returncode == 0 and "fewer than one global batch" not in exactly.stdout, exactly.stdout
    refused = run_cli(*small, "data.drop_last=true", cwd=tmp_path, timeout=120)
    assert refused.returncode in (1, 2), refused.stdout + refused.stderr
    assert (
        "the training set has 100 samples, fewer than one global batch (data.global_batch_size=128): with "
        "data.drop_last=true no full batch is left to train on. Set data.global_batch_size=100 or less, or "
        "data.drop_last=false"
    ) in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr


_CALLBACK = """
import ddptrain


class PrintLR(ddptrain.Callback):
    def __init__(self, tag: str = ""):
        self.tag = tag

    def on_log(self, trainer, scalars):
        if trainer.is_main:
            print(f"{self.tag} step {trainer.state.step} lr {scalars['train/lr']}", flush=True)
"""


def test_a_callback_of_ones_own_is_attached_from_the_command_line(tmp_path):
    """Attaching a callback from the CLI was documented only in a docstring, and took a subclass."""
    (tmp_path / "mycb.py").write_text(_CALLBACK)
    tiny = ["recipe=synthetic", "data.num_train_samples=512", "trainer.max_steps=4", "trainer.log_every_steps=2"]
    proc = run_cli(*tiny, "trainer.callbacks=[{_target_: mycb.PrintLR, tag: mine}]", cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    printed = [ln for ln in proc.stdout.splitlines() if ln.startswith("mine ")]
    assert printed == ["mine step 2 lr 0.01", "mine step 4 lr 0.01"], proc.stdout
    wrong = run_cli(*tiny, "trainer.callbacks=[{_target_: collections.OrderedDict}]", cwd=tmp_path, timeout=120)
    assert wrong.returncode == 1
    assert "trainer.callbacks[0]: collections.OrderedDict made a OrderedDict, not a ddptrain.Callback" in wrong.stderr


def test_a_ctrl_c_while_starting_into_an_existing_run_directory_leaves_it_as_it_was(tmp_path):
    """... but a directory that existed before (a resume into it, say) is never removed."""
    run_dir = tmp_path / "old_run"
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("mine")
    code, out, err = _ctrl_c_once_hydra_made(tmp_path, "old_run/.hydra", f"hydra.run.dir={run_dir}")
    assert code == 130, out + err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert (run_dir / "notes.txt").read_text() == "mine"
