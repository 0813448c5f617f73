"""The suite's own scheduling, which scripts/test.sh relies on to answer in minutes.

- ``--dist loadgroup`` keeps the tests of one ``xdist_group`` on one worker, so a launch or module
  fixture they share is made once. pytest-xdist stops doing that without a word on some pytest
  versions (pytest-dev/pytest-xdist#1386); this test sees it from outside, in a real pytest run.
- A phase holds whole modules, each marked by its own ``pytestmark`` (no hand-kept list).
"""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest

from tests.conftest import PYTHON, REPO

pytestmark = pytest.mark.timeout(120)


def test_loadgroup_runs_a_group_on_one_worker_and_builds_its_module_fixture_once(tmp_path):
    (tmp_path / "test_grouped.py").write_text(
        textwrap.dedent(
            """
            import os
            import pytest

            pytestmark = pytest.mark.xdist_group("shared")

            @pytest.fixture(scope="module")
            def shared():
                with open("built.log", "a") as log:
                    log.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")

            @pytest.mark.parametrize("i", range(6))
            def test_reads_it(shared, i):
                pass
            """
        )
    )
    (tmp_path / "test_others.py").write_text(
        "import pytest\n\n@pytest.mark.parametrize('i', range(12))\ndef test_x(i):\n    pass\n"
    )
    done = subprocess.run(
        [PYTHON, "-m", "pytest", "-q", "-n", "3", "--dist", "loadgroup", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    built = (tmp_path / "built.log").read_text().split()
    assert len(built) == 1, (
        f"the grouped module's fixture was built on {built}: --dist loadgroup did not keep the group on "
        "one worker (pytest-xdist#1386 on pytest 9.2; pyproject.toml pins pytest below it)"
    )


def test_no_test_is_in_two_phases():
    """A module says which phase it needs with its own ``pytestmark``; no list elsewhere can go stale."""
    done = subprocess.run(
        [PYTHON, "-m", "pytest", "--collect-only", "-q", "-m", "timed and alone", "-p", "no:cacheprovider"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode == 5, "some test is marked both timed and alone:\n" + done.stdout[-3000:]


def test_the_scheduling_marks_are_declared():
    text = Path(REPO / "pyproject.toml").read_text()
    for marker in ("timed:", "alone:"):
        assert f'"{marker}' in text, f"pytest marker {marker[:-1]!r} is not declared in pyproject.toml"
