"""A worker that runs out of memory ends the job promptly, naming the rank and the cause.

Two ways to run out: Python or torch fail an allocation (``MemoryError`` / torch's "can't allocate
memory" under ``RLIMIT_AS``) and the worker reports it; or the kernel's OOM killer SIGKILLs the
worker, which then reports nothing. The second needs a memory cgroup with a small limit: rank 1
moves itself into one made under this process's own cgroup (v1 ``memory.limit_in_bytes``, or v2
``memory.max``) and allocates past it. Where no cgroup can be made (not root, no writable
cgroupfs) that test skips, saying why.
"""

from __future__ import annotations

import os
import resource
import signal
import time
from pathlib import Path

import pytest

import ddptrain.comm as dist
from ddptrain.comm.forensics import process_state
from ddptrain.launch import WorkerFailedError
from ddptrain.launch.spawn import describe_exitcode
from ddptrain.testing import run_distributed

# timed: its tests bound durations (scripts/test.sh runs this phase after the parallel one)
pytestmark = [pytest.mark.timed, pytest.mark.dist, pytest.mark.timeout(120)]

LIMIT_MIB = 64


def _alive(pid: int) -> bool:
    """A process that still exists and is not a zombie."""
    return process_state(pid) not in (None, "Z")


def _allocate_past_an_address_space_limit(how: str) -> None:
    status = Path("/proc/self/status").read_text()
    vm_bytes = int(next(ln for ln in status.splitlines() if ln.startswith("VmSize")).split()[1]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (vm_bytes + (512 << 20), resource.RLIM_INFINITY))
    if how == "python":
        bytearray(4 << 30)
    else:
        import torch

        torch.empty(4 << 30, dtype=torch.uint8)


def _rank_1_runs_out_of_memory(rank, world_size, how, pid_dir):
    Path(pid_dir, f"rank{rank}.pid").write_text(str(os.getpid()))
    if rank == 1:
        _allocate_past_an_address_space_limit(how)
    dist.barrier()  # rank 0 waits here for a peer that is gone
    time.sleep(60)


@pytest.mark.parametrize(
    "how, cause", [("python", "MemoryError (the worker ran out of memory)"), ("torch", "can't allocate memory")]
)
def test_allocation_failure_in_a_worker_names_the_rank_and_the_cause(tmp_path, how, cause):
    t0 = time.monotonic()
    with pytest.raises(WorkerFailedError) as info:
        run_distributed(_rank_1_runs_out_of_memory, 2, how, str(tmp_path), timeout_s=60)
    assert time.monotonic() - t0 < 30
    err = info.value
    assert err.rank == 1, str(err)
    message = str(err).splitlines()[0]
    assert message.startswith("rank 1 failed: ") and cause in message, str(err)
    assert "_allocate_past_an_address_space_limit" in err.worker_traceback, err.worker_traceback
    left = [pid for pid in (int(p.read_text()) for p in tmp_path.glob("rank*.pid")) if _alive(pid)]
    assert left == [], f"workers {left} outlived the job"


# -- the kernel's OOM killer --------------------------------------------------------------------
def _own_memory_cgroup() -> tuple[str, Path] | None:
    """("v1"|"v2", directory) of this process's memory cgroup, if its cgroupfs is mounted here."""
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            directory = Path("/sys/fs/cgroup/memory" + path)
            if (directory / "memory.limit_in_bytes").exists():
                return "v1", directory
    for line in lines:
        if line.startswith("0::"):
            for root in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"):
                controllers = Path(root + line[3:], "cgroup.controllers")
                if controllers.exists() and "memory" in controllers.read_text().split():
                    return "v2", controllers.parent
    return None


@pytest.fixture
def small_memory_cgroup():
    """A fresh memory cgroup limited to LIMIT_MIB, below this process's own; removed afterwards."""
    own = _own_memory_cgroup()
    if own is None:
        pytest.skip("no memory cgroup (v1 memory controller or v2 memory.max) is mounted for this process")
    version, parent = own
    child = parent / f"ddptrain-oom-test-{os.getpid()}"
    limit_file = "memory.limit_in_bytes" if version == "v1" else "memory.max"
    try:
        if version == "v2":
            (parent / "cgroup.subtree_control").write_text("+memory")
        child.mkdir()
        (child / limit_file).write_text(str(LIMIT_MIB << 20))
    except OSError as exc:
        if child.exists():
            child.rmdir()
        pytest.skip(
            f"cannot make a memory cgroup with a {LIMIT_MIB} MiB limit under {parent} (cgroup {version}): {exc}"
        )
    for name, value in (("memory.swappiness", "0"), ("memory.swap.max", "0")):  # OOM, not swap
        try:
            (child / name).write_text(value)
        except OSError:
            pass
    yield version, child
    for _ in range(50):  # the killed worker leaves the cgroup as it exits; rmdir may race that
        try:
            child.rmdir()
            break
        except OSError:
            time.sleep(0.1)


def _rank_1_is_oom_killed(rank, world_size, cgroup_dir, pid_dir):
    Path(pid_dir, f"rank{rank}.pid").write_text(str(os.getpid()))
    if rank == 1:
        Path(cgroup_dir, "cgroup.procs").write_text(str(os.getpid()))  # the whole process, all threads
        Path(pid_dir, "allocating").write_text(str(time.time()))
        chunks = []
        for _ in range(64):  # 1 GiB in 16 MiB chunks, touched, far past the limit
            chunks.append(b"\x01" * (16 << 20))
        Path(pid_dir, "survived").write_text("the OOM killer never came")
    dist.barrier()
    time.sleep(60)


def _oom_kills(version: str, cgroup_dir: Path) -> int:
    text = (cgroup_dir / ("memory.oom_control" if version == "v1" else "memory.events")).read_text()
    return int(next(ln.split()[1] for ln in text.splitlines() if ln.startswith("oom_kill ")))


def test_kernel_oom_kill_of_rank_1_ends_the_job_naming_rank_and_signal(tmp_path, small_memory_cgroup):
    version, cgroup_dir = small_memory_cgroup
    with pytest.raises(WorkerFailedError) as info:
        run_distributed(_rank_1_is_oom_killed, 2, str(cgroup_dir), str(tmp_path), timeout_s=90)
    ended_at = time.time()
    assert not (tmp_path / "survived").exists(), "rank 1 allocated 1 GiB past the limit and was not killed"
    assert _oom_kills(version, cgroup_dir) == 1, "the kernel's OOM killer did not record a kill in the cgroup"
    assert ended_at - float((tmp_path / "allocating").read_text()) < 15, "the job did not end promptly"
    err = info.value
    assert err.rank == 1 and err.exitcode == -signal.SIGKILL, str(err)
    message = str(err)
    assert message.startswith("rank 1 (pid ") and "killed by signal SIGKILL" in message, message
    assert "out-of-memory killer" in message, message  # at least the hint, even without the kernel log
    pids = {int(p.stem[4:]): int(p.read_text()) for p in tmp_path.glob("rank*.pid")}
    assert f"(pid {pids[1]})" in message, message
    left = [pid for pid in pids.values() if _alive(pid)]
    assert left == [], f"workers {left} outlived the job"
    # Given the dead worker's pid, the description finds the kernel's record of this OOM kill.
    if os.stat("/proc/self/ns/pid").st_ino != 0xEFFFFFFC:
        pytest.skip("in a PID namespace of its own the kernel log's pids are not ours; the kill was checked above")
    try:
        os.close(os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK))
    except OSError as exc:
        pytest.skip(f"the kernel log (/dev/kmsg) cannot be read here ({exc}); the kill was checked above")
    assert "from the kernel's out-of-memory killer" in message, message  # the launcher itself says so
    described = describe_exitcode(-signal.SIGKILL, pids[1])
    assert described.startswith("killed by signal SIGKILL from the kernel's out-of-memory killer"), described
    assert f"Killed process {pids[1]} " in described and cgroup_dir.name in described, described
    assert f"limit {LIMIT_MIB} MiB" in described, described


def test_sigkill_without_an_oom_record_hints_at_the_oom_killer():
    plain = describe_exitcode(-signal.SIGKILL)
    assert plain.startswith("killed by signal SIGKILL (") and "out-of-memory killer" in plain and "dmesg" in plain
    assert "'Killed process 4194999'" in describe_exitcode(-signal.SIGKILL, 4194999)  # no such process ever ran
    assert describe_exitcode(-signal.SIGTERM, 123) == "killed by signal SIGTERM"
    assert describe_exitcode(3) == "exited with code 3" and describe_exitcode(None) == "still running"
