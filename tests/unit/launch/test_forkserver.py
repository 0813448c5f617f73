"""The local launcher's preloaded fork server, through the Python API (real processes): workers
see the launcher's environment and ``sys.path`` as they are when the job starts, are the
launcher's own children, the next job forks from the same idle server, and nothing but that idle
server outlives a job."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

import pytest

from ddptrain.launch import WorkerFailedError, forkserver
from ddptrain.launch.spawn import spawn_workers
from tests.conftest import children

pytestmark = pytest.mark.timeout(180)


def _where_am_i(rank: int, world_size: int) -> dict:
    import late_module  # only importable through a sys.path entry added after the server started

    return {
        "rank": os.environ["RANK"],
        "late": os.environ.get("DDPTRAIN_TEST_LATE"),
        "parent": os.getppid(),
        "module": late_module.VALUE,
        "cwd": os.getcwd(),
    }


def _fail(rank: int, world_size: int) -> None:
    if rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    time.sleep(30)


def _idle_server_pid() -> int | None:
    server = forkserver._server
    return server.process.pid if server is not None else None


def _live_children() -> list[str]:
    """This process's live children, but multiprocessing's resource tracker and the idle fork
    server (both live as long as we do)."""
    deadline = time.monotonic() + 5
    while True:
        alive = []
        for pid in children(os.getpid()):
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue  # ended meanwhile
            if state != "Z" and "resource_tracker" not in cmdline and pid != _idle_server_pid():
                alive.append(f"{pid} {cmdline[:100]}")
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def _zombies_of(pid: int) -> list[str]:
    zombies = []
    for child in children(pid):
        try:
            stat = Path(f"/proc/{child}/stat").read_text()
            if stat.rsplit(")", 1)[1].split()[0] == "Z":
                zombies.append(f"{child} {stat.split('(', 1)[1].rsplit(')', 1)[0]}")
        except OSError:
            pass  # reaped meanwhile
    return zombies


@pytest.mark.skipif(not forkserver.available(), reason="the fork server needs Linux with pidfd_open")
def test_forked_workers_get_the_launchers_environment_at_job_start(tmp_path, monkeypatch):
    forkserver.start()  # as the CLI does, before anything below is set
    (tmp_path / "late_module.py").write_text("VALUE = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("DDPTRAIN_TEST_LATE", "set after the server started")
    monkeypatch.chdir(tmp_path)
    results = spawn_workers(_where_am_i, 2, threads=1)
    assert [r["rank"] for r in results] == ["0", "1"]
    assert {r["late"] for r in results} == {"set after the server started"}
    assert {r["parent"] for r in results} == {os.getpid()}  # children of the launcher, not of the server
    assert {r["module"] for r in results} == {42}
    assert {r["cwd"] for r in results} == {str(tmp_path)}
    assert _live_children() == [], "a worker outlived the job"


def _pid_and_late(rank: int, world_size: int) -> tuple[int, int, str | None]:
    return os.getpid(), os.getppid(), os.environ.get("DDPTRAIN_TEST_LATE")


@pytest.mark.skipif(not forkserver.available(), reason="the fork server needs Linux with pidfd_open")
def test_the_next_job_forks_from_the_same_idle_server_with_its_own_environment(monkeypatch):
    forkserver.discard()
    spawn_workers(_pid_and_late, 2, threads=1)
    server = _idle_server_pid()
    assert server is not None, "no server was kept idle after the job"
    open_fds = sorted(os.listdir(f"/proc/{server}/fd"))
    monkeypatch.setenv("DDPTRAIN_TEST_LATE", "second job")
    second = spawn_workers(_pid_and_late, 3, threads=1)
    assert _idle_server_pid() == server, "the second job started another server"
    assert sorted(os.listdir(f"/proc/{server}/fd")) == open_fds, "the server kept descriptors of the job"
    assert {parent for _, parent, _ in second} == {os.getpid()}
    assert {late for _, _, late in second} == {"second job"}
    assert len({pid for pid, _, _ in second}) == 3
    assert _live_children() == [], "a worker outlived the job"
    forkserver.discard()
    assert not Path(f"/proc/{server}").exists() or "Z" in Path(f"/proc/{server}/stat").read_text().rsplit(")", 1)[1][:3]


@pytest.mark.skipif(not forkserver.available(), reason="the fork server needs Linux with pidfd_open")
def test_an_idle_server_that_was_killed_is_replaced():
    spawn_workers(_pid_and_late, 2, threads=1)
    server = _idle_server_pid()
    assert server is not None
    os.kill(server, 9)
    deadline = time.monotonic() + 5
    while forkserver._server.process.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    results = spawn_workers(_pid_and_late, 2, threads=1)
    assert {parent for _, parent, _ in results} == {os.getpid()}
    assert _idle_server_pid() not in (None, server)


def _builds_an_optimizer(rank: int, world_size: int) -> float:
    """CPU seconds this worker spends building its first torch optimizer."""
    import torch

    started = time.process_time()
    torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    return time.process_time() - started


@pytest.mark.skipif(not forkserver.available(), reason="the fork server needs Linux with pidfd_open")
def test_a_server_started_for_a_job_preloads_what_building_an_optimizer_imports():
    """Building any torch optimizer imports torch._dynamo: over a second of CPU in every worker
    (1.3-1.5 s measured here) unless the server imported it once before forking them."""
    forkserver.discard()  # the server of this job is started for it, with the job's preload
    cpu_s = spawn_workers(_builds_an_optimizer, 2, threads=1, timeout_s=60)
    assert max(cpu_s) < 0.3, f"building an SGD took {cpu_s} s of CPU in the workers"


def _preloaded(rank: int, world_size: int) -> dict:
    return {name: name in sys.modules for name in ("torch", "ddptrain.runner", "torch._dynamo")}


@pytest.mark.skipif(not forkserver.available(), reason="the fork server needs Linux with pidfd_open")
def test_a_job_that_needs_part_of_the_preload_starts_while_the_server_imports_the_rest():
    """The launcher's checks need torch and the trainer, not torch._dynamo (1.2-1.5 s here): they
    run while the server imports it, and the next job, which needs everything, gets everything."""
    forkserver.discard()
    forkserver.start()  # as the CLI does: the checks arrive while it is still importing torch
    early = spawn_workers(_preloaded, 1, threads=1, timeout_s=60, needs=forkserver.CHECKS)[0]
    assert early == {"torch": True, "ddptrain.runner": True, "torch._dynamo": False}
    full = spawn_workers(_preloaded, 2, threads=1, timeout_s=60)
    assert full == [{"torch": True, "ddptrain.runner": True, "torch._dynamo": True}] * 2


def test_a_failing_worker_is_reported_and_nothing_is_left(tmp_path):
    for method in ("forkserver", "spawn"):
        with pytest.raises(WorkerFailedError) as err:
            spawn_workers(_fail, 2, threads=1, start_method=method)
        assert err.value.rank == 1 and "rank 1 fails on purpose" in str(err.value), method
        assert _live_children() == [], method


def test_an_unknown_start_method_is_refused():
    with pytest.raises(ValueError, match="start_method='fork'.*'forkserver' or 'spawn'"):
        spawn_workers(_fail, 2, threads=1, start_method="fork")


def test_an_idle_server_is_stopped_by_discard():
    forkserver.start()
    server = forkserver._server
    assert server is not None and server.process.is_alive()
    forkserver.discard()
    assert not server.process.is_alive()
    assert sys.modules["ddptrain.launch.forkserver"]._server is None


def _adopts_orphans() -> bool:
    """Whether this process adopts the orphan of a grandchild (it is a child subreaper), seen from
    outside: a shell's background job outlives the shell, and its parent is then read from /proc."""
    import subprocess

    shell = subprocess.run(
        ["bash", "-c", "sleep 30 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True, timeout=10
    )
    orphan = int(shell.stdout)
    try:
        return int(Path(f"/proc/{orphan}/stat").read_text().rsplit(")", 1)[1].split()[1]) == os.getpid()
    finally:
        os.kill(orphan, 9)
        if orphan in children(os.getpid()):
            os.waitpid(orphan, 0)


@pytest.mark.skipif(not forkserver.available(), reason="the fork server needs Linux with pidfd_open")
def test_after_a_job_the_launcher_adopts_no_other_childs_orphans():
    """Between jobs the launcher is an ordinary process again: the orphan of a child it started
    for something else (a killed ``mpiexec``'s ranks, a shell's background job) goes to init, which
    reaps it, instead of staying this process's zombie forever."""
    spawn_workers(_pid_and_late, 2, threads=1)
    assert _idle_server_pid() is not None  # the server idles for the next job
    assert not _adopts_orphans(), "the launcher adopted another child's orphan after its job had ended"


@pytest.mark.skipif(not forkserver.available(), reason="the fork server needs Linux with pidfd_open")
def test_the_server_lives_in_its_own_process_group():
    """A Ctrl-C at the terminal goes to the launcher's process group: the launcher passes it on to
    the workers (and stops them) itself; the server must not get it."""
    spawn_workers(_pid_and_late, 2, threads=1)
    server = _idle_server_pid()
    assert os.getpgid(server) == server != os.getpgid(0)


@pytest.fixture
def pids_cgroup():
    """A pids cgroup (v1) whose ``pids.max`` the test sets: forks beyond it fail with EAGAIN, as on a
    host out of processes. Its processes go back to the root cgroup at the end."""
    root = Path("/sys/fs/cgroup/pids")
    if os.geteuid() != 0 or not (root / "cgroup.procs").exists():
        pytest.skip("needs root and a cgroup v1 pids controller at /sys/fs/cgroup/pids (to make fork fail)")
    group = root / f"ddptrain-test-{os.getpid()}"
    group.mkdir()
    yield group
    for pid in (group / "cgroup.procs").read_text().split():
        with contextlib.suppress(OSError):
            (root / "cgroup.procs").write_text(pid)
    group.rmdir()


@pytest.mark.skipif(not forkserver.available(), reason="the fork server needs Linux with pidfd_open")
def test_a_fork_that_fails_in_the_server_is_reported_and_the_job_runs_with_spawn(pids_cgroup, caplog):
    """The host is out of processes for the server: its job leader forks the first worker, not the
    second. It kills the first, says why at once (not after the launcher's 60 s wait for an answer),
    and the job runs with spawn, leaving nothing behind."""
    import logging

    spawn_workers(_pid_and_late, 2, threads=1)  # the server, preloaded, idles for the next job
    server = _idle_server_pid()
    (pids_cgroup / "cgroup.procs").write_text(str(server))
    tasks = int((pids_cgroup / "pids.current").read_text())
    (pids_cgroup / "pids.max").write_text(str(tasks + 2))  # the leader and one worker
    caplog.set_level(logging.WARNING, logger="ddptrain.launch")
    started = time.monotonic()
    results = spawn_workers(_pid_and_late, 2, threads=1)
    assert time.monotonic() - started < 30
    assert {parent for _, parent, _ in results} == {os.getpid()}
    warned = [r.getMessage() for r in caplog.records]
    assert any(
        "the fork server could not fork the workers: BlockingIOError" in m and "with spawn instead" in m for m in warned
    ), warned
    assert _live_children() == [], "a worker of the failed fork outlived the job"
    time.sleep(0.2)
    assert _zombies_of(os.getpid()) == [], "the failed fork's first worker became the launcher's zombie"


@pytest.mark.skipif(not forkserver.available(), reason="the fork server needs Linux with pidfd_open")
def test_a_server_that_dies_during_a_request_leaves_the_launcher_an_ordinary_process(caplog):
    """While a job waits for its workers the launcher adopts orphans (so that the forked workers
    become its children). A server killed mid-request must not leave it adopting them for good."""
    import logging
    import signal
    import threading

    spawn_workers(_pid_and_late, 2, threads=1)
    server = _idle_server_pid()
    os.kill(server, signal.SIGSTOP)  # it takes the request but cannot answer ...
    threading.Timer(1.0, os.kill, args=(server, signal.SIGKILL)).start()  # ... and dies
    caplog.set_level(logging.WARNING, logger="ddptrain.launch")
    results = spawn_workers(_pid_and_late, 2, threads=1)
    assert {parent for _, parent, _ in results} == {os.getpid()}
    warned = [r.getMessage() for r in caplog.records]
    assert any("the fork server is gone" in m for m in warned), warned
    assert not _adopts_orphans(), "the launcher still adopts orphans after the server died mid-request"


@pytest.mark.skipif(not forkserver.available(), reason="the fork server needs Linux with pidfd_open")
def test_jobs_leave_no_zombies_in_the_launcher_or_the_idle_server():
    """Each job's leader exits in the server and its workers end in the launcher: both reap them,
    or an idle server (and a notebook's launcher) would collect a zombie per job."""
    first = spawn_workers(_pid_and_late, 2, threads=1)
    server = _idle_server_pid()
    second = spawn_workers(_pid_and_late, 2, threads=1)
    assert _idle_server_pid() == server
    time.sleep(0.2)  # a reap that is due has happened by now
    assert _zombies_of(server) == [], "the idle server kept its job leaders as zombies"
    workers = {pid for pid, _, _ in first + second}
    assert _zombies_of(os.getpid()) == [], ("the launcher kept its ended workers as zombies", workers)


_CRASHES_IN_THE_SERVER = """
import multiprocessing
import os

if multiprocessing.current_process().name == "ddptrain-forkserver":
    os._exit(3)  # as an extension module that crashes at import would, once the server has the job


def where(rank, world_size):
    return os.getpid(), os.getppid()
"""


@pytest.mark.skipif(not forkserver.available(), reason="the fork server needs Linux with pidfd_open")
def test_a_server_that_dies_preloading_a_job_it_has_read_is_noticed_at_once(tmp_path, monkeypatch, caplog):
    """The server reads the job while it imports torch, then dies importing the job's module: the
    launcher hears its end at once (it keeps no copy of the server's end of the pipe) and runs the
    job with spawn, instead of waiting out the answer's 60 s."""
    import importlib
    import logging

    (tmp_path / "crashes_in_the_server.py").write_text(_CRASHES_IN_THE_SERVER)
    monkeypatch.syspath_prepend(str(tmp_path))
    job = importlib.import_module("crashes_in_the_server")
    forkserver.discard()  # the server of this job is started for it, preloading its module
    caplog.set_level(logging.WARNING, logger="ddptrain.launch")
    started = time.monotonic()
    results = spawn_workers(job.where, 2, threads=1, timeout_s=120)
    assert time.monotonic() - started < 30
    assert {parent for _, parent in results} == {os.getpid()}
    assert any("the fork server is gone" in r.getMessage() for r in caplog.records), caplog.records
