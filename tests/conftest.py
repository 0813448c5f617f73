"""What many test files need, written once: paths, the CLI runner, process listings, MNIST.

Plain helpers are importable (``from tests.conftest import run_cli``) as well as the fixtures
pytest finds here by itself.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
"""The repository's root (``tests/`` lives there)."""
PYTHON = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv" / "bin" / "python").exists() else sys.executable
"""One interpreter for every subprocess the tests start: the project's venv when there is one."""
BIN = Path(PYTHON).parent
TORCHRUN = str(BIN / "torchrun")
MPIEXEC = shutil.which("mpiexec", path=str(BIN)) or shutil.which("mpiexec")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
"""In CI a test that needs something missing (the real MNIST) fails instead of skipping."""

# Variables of a launcher around the test run: a CLI started by a test must not take itself for a rank.
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")


def merged(base: dict, changes: dict) -> dict:
    """``base`` with ``changes`` applied section by section: a nested dictionary (``checkpoint``)
    updates the one in ``base`` instead of replacing it."""
    out = dict(base)
    for key, value in changes.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def cli_env(**extra: str) -> dict[str, str]:
    """The environment for a CLI subprocess: ours, unbuffered, without launcher variables."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def run_cli(*args: str, cwd, timeout: float = 150, env: dict | None = None, prefix: list[str] | None = None):
    """Run ``python -m ddptrain *args`` (or ``prefix + args``) to the end; the CompletedProcess."""
    command = (prefix or [PYTHON, "-m", "ddptrain"]) + list(args)
    return subprocess.run(command, cwd=cwd, env=cli_env(**(env or {})), capture_output=True, text=True, timeout=timeout)


def sigint_at_default() -> None:
    """``preexec_fn`` of a job a test signals as a terminal would: SIGINT at its default, as a
    terminal's foreground job has it. pytest itself may run with SIGINT ignored (a background job
    of a non-interactive shell), and SIG_IGN is inherited across exec: the CLI keeps ignoring it."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def children(pid: int) -> list[int]:
    """The live child processes of ``pid``."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children, their children, ...)."""
    found, todo = [], [pid]
    while todo:
        for child in children(todo.pop()):
            found.append(child)
            todo.append(child)
    return found


def spawned_workers(pid: int | None = None) -> list[int]:
    """``pid``'s live multiprocessing-spawned workers (default: this process's), oldest first,
    i.e. in rank order for the local launcher; multiprocessing's resource tracker and the idle
    fork server (named ``ddptrain.launch.forkserver.SERVER_NAME``) are not ones."""
    from ddptrain.launch.forkserver import SERVER_NAME

    found = []
    for child in children(os.getpid() if pid is None else pid):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            name = Path(f"/proc/{child}/comm").read_text().strip()
            started = int(Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[19])
        except OSError:
            continue
        if b"spawn_main" in cmdline and name != SERVER_NAME:
            found.append((started, child))
    return [child for _, child in sorted(found)]


LOG_LINE = r"^\[\d\d:\d\d:\d\d\]\[(rank \d+|launcher)\]\[(INFO|WARNING|ERROR)\] "
"""The one line format of ddptrain's log, on the console and in ``train.log``."""


def check_run_log(run_dir: Path, output: str, steps_logged: list[int]) -> None:
    """One ``train.log`` in the run directory (no second log file), every line in the one format,
    with the step lines of ``steps_logged``; the console's ddptrain lines in the same format."""
    import re

    logs = sorted(p.name for p in Path(run_dir).iterdir() if p.suffix == ".log" and p.name != "error.log")
    assert logs == ["train.log"], logs
    lines = (Path(run_dir) / "train.log").read_text().splitlines()
    assert lines and all(re.match(LOG_LINE, line) for line in lines), lines
    for step in steps_logged:
        assert any(
            re.search(rf"\[rank 0\]\[INFO\] step {step}/\d+ \(epoch \d+\): loss [\d.]+, \d+ samples/s", ln)
            for ln in lines
        ), (step, lines)
    console = [ln for ln in output.splitlines() if ln.startswith("[") and "][" in ln[:30]]
    assert console and all(re.match(LOG_LINE, ln) for ln in console), console


def missing(reason: str):
    """Skip for a missing resource, but fail in CI, where everything must be there."""
    if IN_CI:
        pytest.fail(f"CI=true and {reason}: CI must provide it (scripts/test.sh sets it up)")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def mnist_root(tmp_path_factory) -> Path:
    """A data root holding MNIST, prepared once per session by ddptrain's own loader.

    The loader looks where a user's run would (``$DDPTRAIN_DATA_SOURCES``, which
    ``scripts/test.sh`` points at this repository's CI copy), without downloading. Pass the
    returned path as ``data.root`` or ``DDPTRAIN_DATA``. No MNIST: skip, or fail when ``CI=true``.
    """
    from ddptrain.data import DatasetNotFoundError, mnist

    root = tmp_path_factory.mktemp("mnist-root")
    try:
        for train in (True, False):
            mnist(root, train=train, download=False)
    except DatasetNotFoundError as exc:
        missing(f"the real MNIST is not available to ddptrain's loader ({str(exc).splitlines()[0]})")
    return root


def made_once(tmp_path_factory, name: str, make):
    """``make(directory)``'s result (JSON-serialisable), made once per test session even when
    pytest-xdist spreads the tests that need it over several workers: the first worker to ask makes
    it, under a lock, in the session's shared temporary directory; the others read it. A ``make``
    that raises leaves nothing behind, so the next worker to ask tries again."""
    import json

    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's directory, above each worker's own
    result = root / f"made-once-{name}.json"
    with FileLock(str(root / f"made-once-{name}.lock")):
        if not result.exists():
            directory = root / f"made-once-{name}"
            directory.mkdir(exist_ok=True)
            result.write_text(json.dumps(make(directory)))
    return json.loads(result.read_text())


@pytest.fixture(autouse=True)
def _stop_signal_handlers_unchanged(request):
    """Every test leaves SIGINT and SIGTERM as it found them, handlers and signal mask. SIG_IGN and
    a blocked mask are inherited across exec: left behind, they would change how every later
    test's subprocesses on this pytest worker take Ctrl-C."""
    import signal

    stops = (signal.SIGINT, signal.SIGTERM)
    before = {sig: signal.getsignal(sig) for sig in stops}
    blocked_before = signal.pthread_sigmask(signal.SIG_BLOCK, []) & set(stops)
    yield
    changed = {sig.name: signal.getsignal(sig) for sig, h in before.items() if signal.getsignal(sig) is not h}
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, []) & set(stops)
    for sig, handler in before.items():
        signal.signal(sig, handler)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    signal.pthread_sigmask(signal.SIG_SETMASK, (mask - set(stops)) | blocked_before)
    assert not changed, f"{request.node.nodeid} left stop-signal handlers changed: {changed}"
    assert blocked == blocked_before, f"{request.node.nodeid} left {blocked} blocked, was {blocked_before}"
