"""A torch-style DDP script with only its imports switched to ddptrain trains bitwise like torch."""

import re
import subprocess

import pytest

from tests.conftest import REPO, TORCHRUN, cli_env

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def _final_weights(impl: str, tmp_path) -> str:
    command = [
        TORCHRUN,
        "--standalone",
        "--nproc-per-node=2",
        str(REPO / "tests" / "e2e" / "torch_style_train.py"),
        "--impl",
        impl,
    ]
    proc = subprocess.run(command, cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return re.search(rf"weights sha256 (\w+) \({impl}, 2 ranks\)", proc.stdout).group(1)


def test_switching_the_imports_keeps_the_weights_bitwise(tmp_path):
    assert _final_weights("ddptrain", tmp_path) == _final_weights("torch", tmp_path)
