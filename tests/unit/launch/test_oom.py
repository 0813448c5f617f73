"""Unit tests for ddptrain.launch.oom: finding the kernel's OOM kill of one pid among kernel log
records. Reading the real ``/dev/kmsg`` after a real OOM kill is tests/e2e/test_faults_oom.py."""

from __future__ import annotations

from ddptrain.launch.oom import find_oom_kill

# The two records mm/oom_kill.c writes for one kill (a memory cgroup over its limit), as
# /dev/kmsg gives them: "<priority>,<sequence>,<µs since boot>,<flags>;<text>".
SUMMARY = (
    "6,1200,5000000,-;oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,"
    "oom_memcg=/ddptrain-no-such-cgroup,task_memcg=/ddptrain-no-such-cgroup,task=python,pid=4242,uid=0\n"
)
KILLED = (
    "3,1201,5000100,-;Memory cgroup out of memory: Killed process 4242 (python) total-vm:2097152kB, "
    "anon-rss:65536kB, file-rss:0kB, shmem-rss:0kB, UID:0 pgtables:200kB oom_score_adj:0\n"
)
NOW_US = 6_000_000  # one second after the kill


def test_both_records_give_the_kernels_line_and_the_cgroup():
    got = find_oom_kill(["6,1,10,-;some other message\n", SUMMARY, KILLED], 4242, NOW_US)
    assert got == (
        "kernel log: Memory cgroup out of memory: Killed process 4242 (python) total-vm:2097152kB, "
        "anon-rss:65536kB; memory cgroup /ddptrain-no-such-cgroup"  # no limit: that cgroup cannot be read
    )


def test_a_system_wide_oom_kill_is_found_too():
    line = "3,7,5000000,-;Out of memory: Killed process 4242 (python) total-vm:100kB, anon-rss:50kB, file-rss:0kB\n"
    assert find_oom_kill([line], 4242, NOW_US) == (
        "kernel log: Out of memory: Killed process 4242 (python) total-vm:100kB, anon-rss:50kB"
    )


def test_the_summary_alone_still_names_the_kill():
    assert find_oom_kill([SUMMARY], 4242, NOW_US) == (
        "kernel log: oom-kill of pid 4242; memory cgroup /ddptrain-no-such-cgroup"
    )


def test_another_pid_an_old_record_or_a_malformed_one_is_not_evidence():
    assert find_oom_kill([SUMMARY, KILLED], 4243, NOW_US) is None
    assert find_oom_kill([SUMMARY, KILLED], 424, NOW_US) is None  # a prefix of the pid is another pid
    assert find_oom_kill([SUMMARY, KILLED], 4242, 5_000_100 + 601e6) is None  # pids are reused: 10 min max
    assert find_oom_kill([SUMMARY, KILLED], 4242, 5_000_100 + 30e6, max_age_s=10) is None
    assert find_oom_kill(["garbage;" + KILLED.split(";", 1)[1], "3,1;no timestamp"], 4242, NOW_US) is None
