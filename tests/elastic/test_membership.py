"""Elastic membership (``ddptrain.comm.elastic``) with real processes, a real store process and
real kills: the survivors of a SIGKILL go on in the same processes with renumbered ranks, rank 0
included; a restarted member rejoins; a stopped member is fenced (killed) and left out.

Each member is ``python -m ddptrain.testing.elastic_member``: an all-reduce of ones per step (its
sum must be the generation's size), a regroup on a failed collective or when rank 0 sees a
newcomer, and one JSON line per event in a shared log, which the tests read from outside.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from ddptrain.testing.elastic_member import check_events
from tests.conftest import PYTHON, REPO

# timed: its tests bound durations (scripts/test.sh runs this phase after the parallel one)
pytestmark = [pytest.mark.timed, pytest.mark.dist, pytest.mark.timeout(180)]


class Job:
    """A store process and the members the test starts, all killed at the end whatever happened."""

    def __init__(self, tmp_path: Path, steps: int):
        self.tmp_path, self.steps = tmp_path, steps
        self.log = tmp_path / "events.jsonl"
        self.env = {**os.environ, "PYTHONPATH": str(REPO), "DDPTRAIN_LEDGER_DIR": "off"}
        self.store = subprocess.Popen(
            [PYTHON, "-m", "ddptrain.store", "--port", "0"], stdout=subprocess.PIPE, text=True, env=self.env
        )
        line = self.store.stdout.readline()
        assert line.startswith("ddptrain store: serving on 127.0.0.1:"), line
        self.port = int(line.rsplit(":", 1)[1])
        self.members: dict[str, subprocess.Popen] = {}

    def start(self, member: str, world_size: int = 3, extra: tuple[str, ...] = (), other_host: bool = False) -> None:
        """``other_host``: run the member in its own pid namespace, where the others cannot read its
        ``/proc`` (the membership's test for "on this host"): they judge it by its heartbeat alone,
        as members on another machine are judged."""
        args = ["--store", f"127.0.0.1:{self.port}", "--id", member, "--world-size", str(world_size)]
        args += ["--steps", str(self.steps), "--log", str(self.log), *extra]
        namespace = ["unshare", "--pid", "--fork", "--kill-child"] if other_host else []
        self.members[member] = subprocess.Popen(
            [*namespace, PYTHON, "-m", "ddptrain.testing.elastic_member", *args],
            env=self.env,
            stderr=open(self.tmp_path / f"{member}.stderr", "w"),  # noqa: SIM115 - closed with the process
        )

    def python_pid(self, member: str) -> int:
        """The pid of ``member``'s Python process, as this process sees it (for an ``other_host``
        member, the child of ``unshare``)."""
        pid = self.members[member].pid
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        return int(children[0]) if children else pid

    def events(self) -> list[dict]:
        return [json.loads(line) for line in self.log.read_text().splitlines()] if self.log.exists() else []

    def wait_for(self, what, timeout_s: float = 60):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = what(self.events())
            if found:
                return found
            time.sleep(0.05)
        raise AssertionError(f"timed out; the last events: {self.events()[-12:]}")

    def finish(self, timeout_s: float = 90) -> dict[str, int]:
        codes = {}
        for member, proc in self.members.items():
            try:
                proc.wait(timeout=timeout_s)
            finally:
                if proc.poll() is None:
                    proc.kill()
            codes[member] = proc.returncode
        return codes

    def close(self) -> None:
        for proc in [*self.members.values(), self.store]:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)


@pytest.fixture
def job(tmp_path):
    made = []

    def make(steps: int) -> Job:
        made.append(Job(tmp_path, steps))
        return made[-1]

    yield make
    for j in made:
        j.close()


def _generation(number: int, size: int):
    """The events of the first generation from ``number`` on with ``size`` members, once every one
    of its members has logged it (None before)."""

    def found(events):
        numbers = sorted({e["number"] for e in events if e["event"] == "generation" and e["number"] >= number})
        for n in numbers:
            logged = [e for e in events if e["event"] == "generation" and e["number"] == n]
            if logged[0]["size"] == size and len({e["member"] for e in logged}) == size:
                return logged
        return None

    return found


def _steps_after(t: float, size: int):
    return lambda events: [e for e in events if e["event"] == "step" and e["t"] > t and e["size"] == size]


def test_survivors_go_on_in_place_rank_0_included_and_a_restarted_member_rejoins(job):
    j = job(steps=500)
    for member in ("a", "b", "c"):
        j.start(member)
    j.wait_for(lambda ev: len({e["member"] for e in ev if e["event"] == "step" and e["step"] >= 20}) == 3)
    first = {e["rank"]: e["member"] for e in j.events() if e["event"] == "generation"}  # who registered first
    recovery_s = {}

    killed_at = time.time()
    j.members[first[1]].send_signal(signal.SIGKILL)
    after = j.wait_for(_steps_after(killed_at, 2))
    recovery_s["rank 1"] = min(e["t"] for e in after) - killed_at

    j.start("new")  # its launcher restarts it: a newcomer, admitted at a step boundary
    regrown = j.wait_for(_generation(2, 3))
    assert {e["member"]: e["rank"] for e in regrown} == {first[0]: 0, first[2]: 1, "new": 2}  # survivors first

    killed_at = time.time()
    j.members[first[0]].send_signal(signal.SIGKILL)  # rank 0: its number goes to the lowest survivor
    again = j.wait_for(_generation(3, 2))
    assert {e["member"]: e["rank"] for e in again} == {first[2]: 0, "new": 1}
    recovery_s["rank 0"] = min(e["t"] for e in j.wait_for(_steps_after(killed_at, 2))) - killed_at

    codes = j.finish()
    assert codes == {first[0]: -signal.SIGKILL, first[1]: -signal.SIGKILL, first[2]: 0, "new": 0}, codes
    events = j.events()
    # every step's sum counted exactly its generation's members, and each member's steps followed
    # each other (a new generation goes on from the furthest step any member completed)
    assert check_events(events) == []
    for member in (first[2], "new"):
        assert [e for e in events if e["member"] == member and e["event"] == "done"][0]["step"] == 500
    print(f"SIGKILL to the survivors' next step: {recovery_s}")
    assert max(recovery_s.values()) < 2, recovery_s  # below the group's 3 s timeout: nobody waited it out


def test_a_stopped_member_is_fenced_and_the_others_go_on(job):
    j = job(steps=300)
    for member in ("a", "b", "c"):
        j.start(member)
    j.wait_for(lambda ev: len({e["member"] for e in ev if e["event"] == "step" and e["step"] >= 20}) == 3)
    stopped_at = time.time()
    j.members["c"].send_signal(signal.SIGSTOP)  # alive but silent: the others time out (3 s), then fence it
    regrouped = j.wait_for(_generation(1, 2))
    assert {e["member"] for e in regrouped} == {"a", "b"}
    assert j.members["c"].wait(timeout=30) == -signal.SIGKILL  # fenced: it cannot come back with stale state
    codes = j.finish()
    assert codes["a"] == codes["b"] == 0, codes
    failed = [e for e in j.events() if e["event"] == "failed" and e["t"] > stopped_at]
    assert failed and all("timed out" in e["error"].lower() or "timeout" in e["error"].lower() for e in failed), failed


def test_a_coordinator_that_dies_before_deciding_is_replaced_and_can_rejoin(job):
    from ddptrain.comm.store import connect

    j = job(steps=200)
    j.start("a")
    j.start("b")
    # c computes for 6 s before step 30 (alive, heartbeat and all): the others time out on it after
    # 3 s, and the one that coordinates generation 1 waits for it (up to 5 s) ...
    j.start("c", extra=("--stall-at-step", "30", "--stall-s", "6"))
    store = connect(f"127.0.0.1:{j.port}").prefixed("elastic")
    coordinator = store.get("gen/1/coordinated_by", timeout=60).decode()
    assert coordinator in ("a", "b")
    killed_at = time.time()
    j.members[coordinator].send_signal(signal.SIGKILL)  # ... and dies before deciding
    survivor = "b" if coordinator == "a" else "a"
    final = j.wait_for(_generation(2, 2))  # generation 1 is never written: the others agree on 2
    assert {e["member"] for e in final} == {survivor, "c"}
    # as soon as c is back (6 s after its stall began), not after waiting out the dead coordinator (~13 s)
    assert min(e["t"] for e in final) - killed_at < 8, min(e["t"] for e in final) - killed_at
    assert not store.check(["gen/1"])
    # the dead coordinator's restart joins past the number that was never written
    j.start("d")
    joined = j.wait_for(_generation(3, 3))
    assert {e["member"] for e in joined} == {survivor, "c", "d"}
    codes = j.finish()
    assert codes == {coordinator: -signal.SIGKILL, survivor: 0, "c": 0, "d": 0}, codes
    assert check_events(j.events()) == []
    assert max(e["step"] for e in j.events() if e["event"] == "step") == 200


def _needs_pid_namespaces():
    if not shutil.which("unshare") or subprocess.run(["unshare", "--pid", "--fork", "true"]).returncode:
        pytest.skip("needs root with unshare --pid (a member whose /proc the others cannot read)")


def test_a_member_on_another_host_that_leaves_is_known_gone_at_once(job):
    """A member that closes says so in the store (``left/<id>``): the others regroup at once,
    without waiting out its heartbeat (10 s here) or the regroup's deadline (7 s)."""
    _needs_pid_namespaces()
    j = job(steps=300)
    wait_long = ("--timeout-s", "5", "--dead-after-s", "10")
    j.start("a", extra=wait_long)
    j.start("b", extra=wait_long)
    j.start("c", extra=(*wait_long, "--steps", "30"), other_host=True)
    done = j.wait_for(lambda ev: [e for e in ev if e["event"] == "done" and e["member"] == "c"])[0]
    assert done["step"] == 30
    regrouped = j.wait_for(_generation(1, 2))
    assert {e["member"] for e in regrouped} == {"a", "b"}
    first_step = min(e["t"] for e in j.wait_for(_steps_after(done["t"], 2)))
    assert first_step - done["t"] < 3, f"{first_step - done['t']:.1f} s from c's close to the next step of two"
    assert j.finish() == {"a": 0, "b": 0, "c": 0}
    assert check_events(j.events()) == []


def test_a_member_on_another_host_late_to_regroup_but_beating_is_waited_for(job):
    """Its heartbeat changes while it computes, so the coordinator waits for it (up to the regroup's
    deadline, 4 s here) instead of declaring it dead: the job goes on with all three."""
    _needs_pid_namespaces()
    j = job(steps=100)
    j.start("a", extra=("--timeout-s", "2"))
    j.start("b", extra=("--timeout-s", "2"))
    # c computes 3 s before step 30: the others' collective times out after 2 s and they regroup
    j.start("c", extra=("--timeout-s", "2", "--stall-at-step", "30", "--stall-s", "3"), other_host=True)
    regrouped = j.wait_for(_generation(1, 3))
    assert {e["member"] for e in regrouped} == {"a", "b", "c"}
    assert j.finish() == {"a": 0, "b": 0, "c": 0}
    assert check_events(j.events()) == []


def test_a_stopped_member_on_another_host_is_declared_dead_by_its_heartbeat_and_exits_when_woken(job):
    """Nobody can kill it from here (another host): it is fenced once its heartbeat has been still
    for ``dead_after_s``, and the first heartbeat after it wakes ends it, before it acts on stale state."""
    _needs_pid_namespaces()
    j = job(steps=200)
    quick = ("--timeout-s", "2", "--dead-after-s", "1")
    j.start("a", extra=quick)
    j.start("b", extra=quick)
    j.start("c", extra=quick, other_host=True)
    j.wait_for(lambda ev: len({e["member"] for e in ev if e["event"] == "step" and e["step"] >= 20}) == 3)
    c = j.python_pid("c")
    os.kill(c, signal.SIGSTOP)
    regrouped = j.wait_for(_generation(1, 2))
    assert {e["member"] for e in regrouped} == {"a", "b"}
    assert j.members["c"].poll() is None  # alive, stopped: no /proc of it here, so not killed
    woken_at = time.time()
    os.kill(c, signal.SIGCONT)
    assert j.members["c"].wait(timeout=30) == 1
    assert not [e for e in j.events() if e["member"] == "c" and e["t"] > woken_at and e["event"] == "step"]
    codes = j.finish()
    assert codes["a"] == codes["b"] == 0, codes
    assert check_events(j.events()) == []


def test_the_store_process_serves_until_stopped_and_names_a_busy_port():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [PYTHON, "-m", "ddptrain.store", "--port", "0"]
    store = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = store.stdout.readline()
        port = int(line.rsplit(":", 1)[1])
        busy = subprocess.run(
            [PYTHON, "-m", "ddptrain.store", "--port", str(port)], capture_output=True, text=True, env=env, timeout=60
        )
        assert busy.returncode == 1
        assert f"ddptrain store: cannot listen on 127.0.0.1:{port}" in busy.stderr, busy.stderr
        assert "--port 0 chooses one" in busy.stderr
        store.send_signal(signal.SIGTERM)
        assert store.wait(timeout=30) == 0
    finally:
        if store.poll() is None:
            store.kill()


def _abort_a_wait_that_would_last(rank, world_size):
    import threading

    import torch

    import ddptrain.comm as dist

    group = dist.get_process_group()
    group.abortable = True
    if rank == 1:
        time.sleep(3.0)  # never joins in time: rank 0's all-reduce could only end by its 20 s timeout
        return None
    threading.Timer(0.3, group.abort, args=("the members are agreeing on generation 1",)).start()
    started = time.monotonic()
    try:
        dist.all_reduce(torch.ones(2))
    except dist.CommError as exc:
        return time.monotonic() - started, str(exc)
    return None


def test_abort_ends_a_wait_on_an_abortable_group_at_once():
    from ddptrain.testing import run_distributed

    waited_s, error = run_distributed(_abort_a_wait_that_would_last, 2, timeout_s=90, comm_timeout_s=20)[0]
    assert waited_s < 2.0, waited_s
    assert "all_reduce on group 'world' was aborted: the members are agreeing on generation 1" in error, error


def _launched_member(slot, world_size, steps, log):
    from ddptrain.comm.elastic import ElasticMembership
    from ddptrain.testing.elastic_member import run_member

    return run_member(ElasticMembership.from_environment(dead_after_s=3.0), world_size, steps, log)


def test_the_elastic_launcher_restarts_a_dead_worker_and_it_rejoins_then_goes_on_without_one(tmp_path, caplog):
    import logging
    import threading

    from ddptrain.launch.spawn import spawn_elastic

    log = tmp_path / "events.jsonl"
    box = {}

    def launch():
        try:
            box["results"] = spawn_elastic(
                _launched_member, 3, (400, str(log)), threads=1, max_restarts=1, timeout_s=150
            )
        except BaseException as exc:  # noqa: BLE001 - the test thread reports it
            box["error"] = exc

    def events():
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    def wait_for(what, timeout_s=60):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if found := what(events()):
                return found
            time.sleep(0.05)
        raise AssertionError(f"timed out; box {box}; the last events: {events()[-12:]}")

    caplog.set_level(logging.WARNING, logger="ddptrain.launch")
    launcher = threading.Thread(target=launch)
    launcher.start()
    try:
        wait_for(lambda ev: len({e["member"] for e in ev if e["event"] == "step" and e["step"] >= 20}) == 3)
        pids = {e["rank"]: (e["member"], e["pid"]) for e in events() if e["event"] == "generation"}
        victim, pid = pids[1]
        os.kill(pid, signal.SIGKILL)
        slot = victim.split(".")[0]
        # the launcher starts the slot's next attempt, admitted as soon as it has registered (by the
        # survivors' regroup itself when it registers in time, else at the next step boundary)
        rejoined = wait_for(_generation(1, 3))
        assert f"{slot}.1" in {e["member"] for e in rejoined}
        now = {e["rank"]: (e["member"], e["pid"]) for e in rejoined}
        os.kill(now[0][1], signal.SIGKILL)  # no restart left: the job goes on with two
        wait_for(_generation(rejoined[0]["number"] + 1, 2))
    finally:
        launcher.join(150)
    assert "error" not in box, box.get("error")
    from tests.conftest import children

    def command(pid):
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return b""  # ended meanwhile

    assert [c for c in children(os.getpid()) if b"ddptrain.store" in command(c)] == [], "the store outlived the job"
    finished = {r["member"] for r in box["results"]}
    assert len(finished) == 2 and now[0][0] not in finished and victim not in finished, box["results"]
    assert all(r["step"] == 400 for r in box["results"]), box["results"]
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == [
        f"member {victim} (slot {slot}, pid {pid}) killed by signal SIGKILL (SIGKILL is also what the kernel's "
        f"out-of-memory killer sends: check `dmesg` for 'Killed process {pid}' and the memory limit); the others "
        f"go on, and slot {slot} starts again as member {slot}.1",
        f"member {now[0][0]} (slot {now[0][0].split('.')[0]}, pid {now[0][1]}) killed by signal SIGKILL (SIGKILL "
        f"is also what the kernel's out-of-memory killer sends: check `dmesg` for 'Killed process {now[0][1]}' and "
        "the memory limit); the others go on without it (no restart left)",
    ], warnings


_WAITING_NEWCOMER = """
import sys
from ddptrain.comm.elastic import ElasticMembership
from ddptrain.comm.store import connect
m = ElasticMembership(connect(sys.argv[1]), "late")
print("registered", flush=True)
m.join(2, timeout_s=60)
"""


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_newcomer_waiting_to_be_admitted_costs_little_cpu(job):
    """A hot spare or a restarted member may wait long for the next regroup, on a host whose cores
    train: it polls the store every few milliseconds, it does not spin."""
    import threading

    from ddptrain.comm.elastic import ElasticMembership
    from ddptrain.comm.store import connect

    j = job(steps=1)
    address = f"127.0.0.1:{j.port}"
    members = [ElasticMembership(connect(address), name) for name in ("a", "b")]
    joins = [threading.Thread(target=m.join, args=(2, 60)) for m in members]
    for t in joins:
        t.start()
    for t in joins:
        t.join(60)
    late = subprocess.Popen([PYTHON, "-c", _WAITING_NEWCOMER, address], env=j.env, stdout=subprocess.PIPE, text=True)
    try:
        assert late.stdout.readline().strip() == "registered"
        time.sleep(0.5)  # into its wait
        before, started = _cpu_s(late.pid), time.monotonic()
        time.sleep(3.0)
        share = (_cpu_s(late.pid) - before) / (time.monotonic() - started)
        assert late.poll() is None, "the newcomer stopped waiting"
        assert share < 0.1, f"a waiting newcomer used {share:.0%} of a core (0.3% measured when it polls)"
    finally:
        late.kill()
        late.wait(10)
        for m in members:
            m.close()
