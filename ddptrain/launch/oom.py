"""Evidence that the kernel's out-of-memory killer ended a process: its log, and memory cgroups.

A worker killed by SIGKILL may have been killed by a person, a scheduler or the OOM killer; only
the kernel knows. :func:`kernel_oom_kill` reads the kernel log (``/dev/kmsg``: root, or
``kernel.dmesg_restrict=0``) for the kill of one pid; :func:`memory_cgroup_oom_kills` reads how
many OOM kills this process's memory cgroup (which workers inherit) has counted. Both answer
None when the system does not let them see (no ``/dev/kmsg`` in the container, no permission,
no cgroupfs): the evidence is a courtesy, never a reason to fail.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable, Iterator

# The kernel's OOM-kill records (mm/oom_kill.c): the first is logged before the SIGKILL is sent,
# the second right after it.
_OOM_SUMMARY = re.compile(r"oom-kill:.*?task_memcg=([^,]*),task=.*,pid=(\d+),uid=\d+")
_OOM_KILLED = re.compile(
    r"((?:Memory cgroup out of memory|Out of memory[^:]*): Killed process (\d+) \(.*?\)"
    r"(?: total-vm:\d+kB, anon-rss:\d+kB)?)"
)

_INITIAL_PID_NAMESPACE = 0xEFFFFFFC  # the inode of the host's PID namespace (PROC_PID_INIT_INO)


def kernel_oom_kill(pid: int, max_age_s: float = 600.0) -> str | None:
    """What the kernel log says about its OOM killer ending ``pid`` recently, or None.

    None also when the log cannot be read (no ``/dev/kmsg`` in the container, no permission), and
    in a PID namespace other than the host's: the log's pids are the host's, so ``pid`` could
    name some other process there.
    """
    try:
        if os.stat("/proc/self/ns/pid").st_ino != _INITIAL_PID_NAMESPACE:
            return None
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    now_us = time.clock_gettime(time.CLOCK_MONOTONIC) * 1e6  # the clock of the log's timestamps
    try:
        return find_oom_kill(_kmsg_records(fd), pid, now_us, max_age_s)
    finally:
        os.close(fd)


def _kmsg_records(fd: int) -> Iterator[str]:
    """The records of ``/dev/kmsg`` open at ``fd``, oldest first, up to the end of the log."""
    for _ in range(1_000_000):  # a bound, not a limit: the log holds far fewer records
        try:
            yield os.read(fd, 8192).decode("utf-8", "replace")
        except BrokenPipeError:  # the oldest records were overwritten while we read: go on
            continue
        except OSError:  # EAGAIN: the end of the log
            return


def find_oom_kill(records: Iterable[str], pid: int, now_us: float, max_age_s: float = 600.0) -> str | None:
    """The kernel's account of the OOM kill of ``pid`` among ``/dev/kmsg`` ``records``, or None.

    A record is ``"<prio>,<seq>,<usec since boot>,<flags>;<text>"``; records older than
    ``max_age_s`` before ``now_us`` (the monotonic clock, in µs) are ignored: pids are reused.
    The answer quotes the kernel's "Killed process" line and names the memory cgroup, with its
    limit when it can be read.
    """
    found: tuple | None = None  # (memory cgroup, "Killed process ..." text): the latest for pid
    for record in records:
        header, _, text = record.partition(";")
        text = text.split("\n", 1)[0]
        fields = header.split(",")
        if len(fields) < 3 or not fields[2].isdigit() or now_us - int(fields[2]) > max_age_s * 1e6:
            continue
        summary = _OOM_SUMMARY.search(text)
        if summary and int(summary.group(2)) == pid:
            found = (summary.group(1), None)
        killed = _OOM_KILLED.search(text)
        if killed and int(killed.group(2)) == pid:
            found = (found[0] if found else None, killed.group(1))
    if found is None:
        return None
    memcg, text = found
    parts = [f"kernel log: {text}" if text else f"kernel log: oom-kill of pid {pid}"]
    if memcg:
        limit = memory_cgroup_limit(memcg)
        parts.append(f"memory cgroup {memcg}" + (f", limit {limit / 2**20:.0f} MiB" if limit else ""))
    return "; ".join(parts)


def _memory_cgroup_file(path: str, v1_name: str, v2_name: str) -> str | None:
    """The text of a memory cgroup's file (cgroup v1 or v2 name), or None if it cannot be read."""
    for root, name in (
        ("/sys/fs/cgroup/memory", v1_name),
        ("/sys/fs/cgroup", v2_name),
        ("/sys/fs/cgroup/unified", v2_name),
    ):
        try:
            with open(f"{root}{path.rstrip('/')}/{name}") as f:
                return f.read()
        except OSError:
            continue
    return None


def memory_cgroup_limit(path: str) -> int | None:
    """A memory cgroup's limit in bytes; None if it has none or it cannot be read."""
    text = _memory_cgroup_file(path, "memory.limit_in_bytes", "memory.max")
    if text is None or not text.strip().isdigit() or int(text) >= 2**62:  # "max" or v1's "unlimited"
        return None
    return int(text)


def memory_cgroup_oom_kills(pid: str = "self") -> tuple[str, int] | None:
    """``pid``'s memory cgroup and the OOM kills it has counted (v1 ``memory.oom_control``, v2
    ``memory.events``); None if that cannot be read."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    v1 = [ln.split(":", 2)[2] for ln in lines if "memory" in ln.split(":", 2)[1].split(",")]
    v2 = [ln.split(":", 2)[2] for ln in lines if ln.startswith("0::")]
    for path, names in [(p, ("memory.oom_control", "-")) for p in v1] + [(p, ("-", "memory.events")) for p in v2]:
        text = _memory_cgroup_file(path, *names)
        for line in (text or "").splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return path, int(value)
    return None
