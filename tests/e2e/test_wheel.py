"""The product is what a user installs: a wheel, into a fresh virtual environment, used from an
empty directory — not this checkout.

The fresh venv reuses the already installed torch and the other dependencies (a ``.pth`` line
pointing at this project's venv's site-packages, read as a plain directory: its editable-install
hook does not run), so only ddptrain itself comes from the wheel.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.conftest import PYTHON, REPO, cli_env

# One pytest-xdist worker for the module (scripts/test.sh runs --dist loadgroup): installed is made once.
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.xdist_group("wheel")]

USER_TRAINER = '''
import torch.nn.functional as F
import ddptrain


class MyTrainer(ddptrain.Trainer):
    """The user's own trainer, in the directory the command runs from."""

    def training_step(self, model, batch):
        inputs, targets = batch
        return F.cross_entropy(model(inputs), targets)
'''


def _run(command: list[str], cwd: Path, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(command, cwd=cwd, env=cli_env(**env), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{command}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _not_sources(directory: str, names: list[str]) -> set[str]:
    """What a source distribution leaves out: caches, the venv, run outputs, a local data root."""
    left_out = {n for n in names if n in (".git", "__pycache__") or n.endswith(".egg-info")}
    if Path(directory) == REPO:
        left_out |= {n for n in names if n in (".venv", "build", "outputs", "multirun", "data", ".pytest_cache")}
    return left_out


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv with ddptrain installed from a wheel built from this repository; its bin dir."""
    root = tmp_path_factory.mktemp("wheel")
    # From a copy of the sources: a build/ folder left in the checkout would mask what the wheel lacks.
    source = shutil.copytree(REPO, root / "src", symlinks=True, ignore=_not_sources)
    _run(
        [
            PYTHON,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(root / "dist"),
            str(source),
        ],
        root,
    )
    wheel = next((root / "dist").glob("ddptrain-*.whl"))
    base_python = Path(sys.base_prefix) / "bin" / "python3"
    _run([str(base_python), "-m", "venv", str(root / "venv")], root)
    venv_python = root / "venv" / "bin" / "python"
    site = _run([str(venv_python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], root).stdout
    (Path(site.strip()) / "reuse_installed_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([str(venv_python), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)], root)
    return root / "venv" / "bin"


def test_the_wheel_carries_configs_and_recipes_and_no_top_level_recipes(installed):
    python = installed / "python"
    code = (
        "import importlib.util, ddptrain, ddptrain.recipes.mnist, ddptrain.conf, pathlib;"
        "print(pathlib.Path(ddptrain.__file__).parent);"
        "print(sorted(p.name for p in pathlib.Path(ddptrain.conf.__file__).parent.glob('*/*.yaml'))[:3]);"
        "print(importlib.util.find_spec('recipes'))"
    )
    out = _run([str(python), "-c", code], installed).stdout.splitlines()
    assert "site-packages" in out[0] and str(REPO) not in out[0], out
    assert out[2] == "None", "a top-level 'recipes' module was installed"


def test_python_m_ddptrain_from_an_empty_directory(installed, tmp_path, mnist_root):
    proc = _run(
        [
            str(installed / "python"),
            "-m",
            "ddptrain",
            "recipe=mnist",
            "trainer=smoke",
            f"data.root={mnist_root}",
            "hydra.run.dir=run",
        ],
        tmp_path,
    )
    assert "smoke check passed" in proc.stdout, proc.stdout
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["params_agree"]


def test_the_console_script_runs_the_users_trainer_from_the_working_directory(installed, tmp_path):
    (tmp_path / "mytask.py").write_text(USER_TRAINER)
    proc = _run(
        [
            str(installed / "ddptrain"),
            "recipe=synthetic",
            "trainer=smoke",
            "recipe.trainer_class=mytask.MyTrainer",
            "hydra.run.dir=run",
        ],
        tmp_path,
    )
    assert "training MyTrainer on 2 rank(s)" in proc.stdout and "smoke check passed" in proc.stdout, proc.stdout
    version = _run([str(installed / "ddptrain"), "--version"], tmp_path).stdout
    assert version.startswith("ddptrain ") and "torch" in version
    assert sys.version_info[:2] >= (3, 10)
