"""The collective ledger, its comparison and the stack dumps, without a job: real files, real
processes for the stacks, synthetic ledgers for the comparisons."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import pytest
import torch

from ddptrain.comm import forensics
from ddptrain.comm.ledger import Ledger, call_site, read_all, read_ledger
from ddptrain.comm.ledger_check import CollectiveMismatchError, PeerCheck
from ddptrain.testing import run_threaded

pytestmark = pytest.mark.timeout(60)


def test_records_round_trip_through_the_file_and_the_ring_keeps_the_newest(tmp_path):
    led = Ledger(2, 4, tmp_path, capacity=4)
    for seq in range(1, 7):
        led.label = "DDP bucket 0" if seq == 6 else ""
        led.record(seq, "world", "all_reduce", torch.ones(3, 5, dtype=torch.float64), 0, b"train.py:12 in step")
    led.record(1, "group1", "broadcast", torch.ones(2, dtype=torch.int64), 1, b"train.py:13 in step")
    got = read_ledger(tmp_path / "rank2.ledger")
    assert (got.rank, got.world_size, got.pid) == (2, 4, os.getpid())
    assert [r.seq for r in got.records] == [4, 5, 6, 1]  # capacity 4: the oldest three are gone
    last_world = got.records[2]
    assert last_world.describe() == "all_reduce of float64[3, 5] SUM [DDP bucket 0] from train.py:12 in step"
    assert got.records[3].describe() == "broadcast of int64[2] root 1 from train.py:13 in step"


def test_call_site_is_the_users_frame():
    """The first frame outside ddptrain and torch (here: this test)."""
    line = sys._getframe().f_lineno + 1
    site = call_site(1).decode()
    assert site == f"tests/unit/comm/test_ledger.py:{line} in test_call_site_is_the_users_frame"


def test_collectives_through_the_group_are_recorded_with_the_users_line():
    def body(rank, ws):
        import ddptrain.comm as dist

        dist.all_reduce(torch.ones(2))
        dist.broadcast(torch.ones(3), 1)
        return [r.describe() for r in dist.get_process_group().ledger.records()]

    line = body.__code__.co_firstlineno
    for records in run_threaded(body, 2):
        assert records[-2:] == [
            f"all_reduce of float32[2] SUM from tests/unit/comm/test_ledger.py:{line + 3} in body",
            f"broadcast of float32[3] root 1 from tests/unit/comm/test_ledger.py:{line + 4} in body",
        ], records


def _write(directory, rank, ws, calls):
    led = Ledger(rank, ws, directory)
    for seq, (op, n, site) in enumerate(calls, 1):
        led.record(seq, "world", op, torch.ones(n), 0, site.encode())
    return led


def test_the_odd_rank_out_is_named_with_both_calls(tmp_path):
    same = [("all_reduce", 4, "t.py:10 in f"), ("broadcast", 4, "t.py:11 in f")]
    _write(tmp_path, 0, 3, same)
    _write(tmp_path, 1, 3, [same[0], ("all_reduce", 4, "t.py:12 in f")])
    _write(tmp_path, 2, 3, same)
    text = forensics.explain(tmp_path, "world", [0, 1, 2])
    assert "rank 1 diverged first, at collective #2 of group 'world'" in text, text
    assert "ranks [0, 2] called broadcast of float32[4] root 0 from t.py:11 in f" in text, text
    assert "rank 1 called all_reduce of float32[4] SUM from t.py:12 in f" in text, text


def test_two_ranks_that_disagree_are_both_named_without_blame(tmp_path):
    _write(tmp_path, 0, 2, [("all_reduce", 4, "t.py:10 in f")])
    _write(tmp_path, 1, 2, [("all_reduce", 6, "t.py:10 in f")])
    a = forensics.analyze(read_all(tmp_path), "world", [0, 1])
    assert a.diverged_at == 1 and a.culprits == []
    text = forensics.describe_divergence(a)[0]
    assert "no majority" in text and "rank 0 called all_reduce of float32[4]" in text and "float32[6]" in text


def test_a_rank_behind_that_is_gone_is_named(tmp_path):
    _write(tmp_path, 0, 2, [("all_reduce", 4, "t.py:10 in f"), ("all_reduce", 4, "t.py:20 in f")])
    led = _write(tmp_path, 1, 2, [("all_reduce", 4, "t.py:10 in f")])
    led.close()
    # rank 1's pid is this process: pretend it is gone by rewriting the header's pid
    data = bytearray((tmp_path / "rank1.ledger").read_bytes())
    data[16:20] = (2**31 - 2).to_bytes(4, "little")
    (tmp_path / "rank1.ledger").write_bytes(bytes(data))
    text = forensics.explain(tmp_path, "world", [0, 1], me=0)
    assert "rank 1 (pid 2147483646) never arrived at collective #2: the process is gone" in text, text
    assert "its last collective: #1 all_reduce of float32[4] SUM from t.py:10 in f" in text, text


def test_the_ledger_check_raises_on_a_mismatch_the_backend_let_pass(tmp_path):
    leds = [_write(tmp_path, r, 3, [("all_reduce", 4, "t.py:10 in f")]) for r in range(3)]
    for r, led in enumerate(leds):
        led.record(2, "world", "broadcast", torch.ones(6 if r == 1 else 4), 0, b"t.py:11 in f")
    group = SimpleNamespace(name="world", global_ranks=[0, 1, 2], size=lambda: 3)
    check = PeerCheck(tmp_path, every=2)
    check(group, 1)  # not a multiple of 2: nothing read
    with pytest.raises(CollectiveMismatchError) as info:
        check(group, 2)
    msg = str(info.value)
    assert "rank 1 diverged first, at collective #2" in msg and "broadcast of float32[6] root 0 from t.py:11" in msg


def test_the_ledger_check_waits_for_a_rank_that_is_behind(tmp_path):
    _write(tmp_path, 0, 2, [("all_reduce", 4, "t.py:10 in f"), ("all_reduce", 4, "t.py:11 in f")])
    _write(tmp_path, 1, 2, [("all_reduce", 4, "t.py:10 in f")])
    group = SimpleNamespace(name="world", global_ranks=[0, 1], size=lambda: 2)
    check = PeerCheck(tmp_path, every=1)
    check(group, 2)  # rank 1 has not reached #2: compared up to #1 only, no error
    assert check._checked["world"] == 1


SLEEPER = """
import sys, time
from ddptrain.comm.ledger import Ledger
from ddptrain.comm.stacks import enable_stack_dumps
import torch
enable_stack_dumps(sys.argv[1], 0)
led = Ledger(0, 1, sys.argv[1])
led.record(1, "world", "all_reduce", torch.ones(2), 0, b"sleeper.py:7 in <module>")
print("ready", flush=True)


def main():
    time.sleep(60)


main()
"""


def test_dump_shows_a_live_ranks_stack_and_ledger_and_names_a_stopped_one(tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text(textwrap.dedent(SLEEPER))
    ledgers = tmp_path / "ledger"
    ledgers.mkdir()
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen([sys.executable, str(script), str(ledgers)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.5)  # into main's sleep
        out = forensics.dump(ledgers)
        assert f"rank 0 (pid {proc.pid} on " in out, out
        assert "sleeper.py:13 in main: `time.sleep(60)`" in out, out
        assert "#1 world: all_reduce of float32[2] SUM from sleeper.py:7" in out, out
        assert proc.poll() is None  # the dump stopped nothing
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(0.2)
        assert "stopped (SIGSTOP, process state T)" in forensics.dump(ledgers)
    finally:
        proc.kill()
        proc.wait(10)


def test_a_subgroup_records_to_its_parents_ledger_under_its_own_name():
    from datetime import timedelta

    import ddptrain.comm as dist

    def body(rank, ws):
        world = dist.get_process_group()
        dist.barrier()
        sub = world.new_subgroup([0, 1], "pair", timedelta(seconds=20))
        if sub is not None:
            sub.all_reduce(torch.ones(2)).wait()
        return [(r.group, r.seq, r.op) for r in world.ledger.records()]

    got = run_threaded(body, 3, timeout_s=30)
    for member in got[:2]:  # the pair's own sequence, after the world's barrier, in the one ledger
        assert member[-1] == ("pair", 1, "all_reduce") and member[-2][::2] == ("world", "barrier"), got
    assert {group for group, _, _ in got[2]} == {"world"}, got


def test_a_ledger_directory_the_group_made_itself_is_removed_when_the_group_is_destroyed(tmp_path, monkeypatch):
    """A user's own script under torchrun or mpirun sets no DDPTRAIN_LEDGER_DIR: rank 0 makes one in
    the temporary folder, and a clean shutdown must not leave it behind, run after run."""
    import tempfile

    import ddptrain.comm as dist

    monkeypatch.delenv("DDPTRAIN_LEDGER_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        made = list(tmp_path.glob("ddptrain-ledger-*"))
        assert [p.name for p in made[0].iterdir()] == ["rank0.ledger"], made
    finally:
        dist.destroy_process_group()
    assert not list(tmp_path.glob("ddptrain-ledger-*"))


def test_a_ledger_directory_the_user_named_is_kept_after_the_group_is_destroyed(tmp_path, monkeypatch):
    import ddptrain.comm as dist

    monkeypatch.setenv("DDPTRAIN_LEDGER_DIR", str(tmp_path / "mine"))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    dist.destroy_process_group()
    assert (tmp_path / "mine" / "rank0.ledger").is_file()
