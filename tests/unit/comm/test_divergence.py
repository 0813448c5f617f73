"""What the divergence analysis compares, on ledgers written without a job: the call site
(forensics of a hang), and the reduce op and the root (the functional API's periodic ledger check
and the forensics alike).

The op/root ledgers are written by real groups: several handles on one
:class:`~ddptrain.testing.ThreadedWorld`, driven from this thread, each with a file ledger of its
own rank. The ledger records each call when it is made, so no rank thread has to wait for a
collective that (with mismatched arguments) the threaded world fails anyway.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ddptrain.comm import ReduceOp, forensics
from ddptrain.comm.ledger import Ledger, read_all
from ddptrain.comm.ledger_check import CollectiveMismatchError, PeerCheck
from ddptrain.testing import ThreadedProcessGroup, ThreadedWorld

pytestmark = pytest.mark.timeout(60)


def _write(directory, rank, ws, calls):
    """A ledger of ``(op, numel, detail, site)`` records, sequence numbers from 1."""
    led = Ledger(rank, ws, directory)
    for seq, (op, n, detail, site) in enumerate(calls, 1):
        led.record(seq, "world", op, torch.ones(n), detail, site.encode())
    return led


# -- the call site -------------------------------------------------------------------------------
def test_the_same_collective_from_another_line_is_a_divergence_naming_both_sites(tmp_path):
    """Same op, size, dtype and root, but rank 1 got there from another line: in a hang, that is
    where the ranks' paths through the user's code parted."""
    same = [("all_reduce", 4, 0, "train.py:10 in step"), ("broadcast", 4, 0, "train.py:11 in step")]
    _write(tmp_path, 0, 3, same)
    _write(tmp_path, 1, 3, [same[0], ("broadcast", 4, 0, "train.py:30 in evaluate")])
    _write(tmp_path, 2, 3, same)
    a = forensics.analyze(read_all(tmp_path), "world", [0, 1, 2])
    assert (a.diverged_at, a.culprits) == (2, [1])
    text = forensics.explain(tmp_path, "world", [0, 1, 2])
    assert "rank 1 diverged first, at collective #2 of group 'world'" in text, text
    assert "ranks [0, 2] called broadcast of float32[4] root 0 from train.py:11 in step" in text, text
    assert "rank 1 called broadcast of float32[4] root 0 from train.py:30 in evaluate" in text, text


def test_two_ranks_at_different_sites_are_both_named_without_blame(tmp_path):
    _write(tmp_path, 0, 2, [("barrier", 0, 0, "train.py:10 in main")])
    _write(tmp_path, 1, 2, [("barrier", 0, 0, "train.py:20 in main")])
    text = forensics.explain(tmp_path, "world", [0, 1])
    assert "the ranks diverged at collective #1 of group 'world' (no majority to tell who)" in text, text
    assert "rank 0 called barrier from train.py:10 in main" in text, text
    assert "rank 1 called barrier from train.py:20 in main" in text, text


def test_a_different_collective_later_outranks_a_different_site_earlier(tmp_path):
    """A site difference can be harmless (the same call written twice, in two branches); a
    different operation cannot: the analysis names the first of those when there is one."""
    _write(tmp_path, 0, 2, [("all_reduce", 4, 0, "t.py:10 in f"), ("all_reduce", 4, 0, "t.py:12 in f")])
    _write(tmp_path, 1, 2, [("all_reduce", 4, 0, "t.py:11 in f"), ("all_reduce", 8, 0, "t.py:12 in f")])
    a = forensics.analyze(read_all(tmp_path), "world", [0, 1])
    assert a.diverged_at == 2
    assert {r: rec.numel for r, rec in a.at.items()} == {0: 4, 1: 8}


def test_the_ledger_check_lets_the_same_collective_from_another_line_pass(tmp_path):
    """The periodic check compares what the backends need to agree on, not the lines: ranks may
    issue one collective from two branches of their code."""
    _write(tmp_path, 0, 2, [("all_reduce", 4, 0, "t.py:10 in f")])
    _write(tmp_path, 1, 2, [("all_reduce", 4, 0, "t.py:11 in f")])
    group = SimpleNamespace(name="world", global_ranks=[0, 1], size=lambda: 2)
    PeerCheck(tmp_path, every=1)(group, 1)


# -- the reduce op and the root ------------------------------------------------------------------
def _groups(directory, size):
    """``size`` handles, one per rank, on one threaded world; rank r records to ``rank<r>.ledger``."""
    world = ThreadedWorld(size, timeout=5)
    groups = [ThreadedProcessGroup(world, r) for r in range(size)]
    for r, pg in enumerate(groups):
        pg.ledger = Ledger(r, size, directory)
    return groups


def _check(groups, directory) -> str:
    """The ledger check of the group as rank 0 runs it after the last record: the error it raises."""
    with pytest.raises(CollectiveMismatchError) as info:
        PeerCheck(directory, every=1).check(groups[0], groups[0].ledger.records()[-1].seq)
    return str(info.value)


ALL_REDUCE_OPS = [ReduceOp.SUM, ReduceOp.MAX, ReduceOp.SUM]
BROADCAST_ROOTS = [0, 1, 0]


def _issue(groups, call):
    """``call(rank, group)`` for each rank, from this one line: every record has the same call
    site, so only the arguments can tell the ranks apart."""
    for r, pg in enumerate(groups):
        call(r, pg)


def test_the_ledger_check_names_a_different_reduce_op(tmp_path):
    groups = _groups(tmp_path, 3)
    _issue(groups, lambda r, pg: pg.all_reduce(torch.ones(2), ALL_REDUCE_OPS[r]))
    msg = _check(groups, tmp_path)
    assert "rank 1 diverged first, at collective #1 of group 'world'" in msg, msg
    assert "rank 1 called all_reduce of float32[2] MAX from" in msg, msg
    assert "ranks [0, 2] called all_reduce of float32[2] SUM from" in msg, msg


def test_the_ledger_check_names_a_different_root(tmp_path):
    groups = _groups(tmp_path, 3)
    _issue(groups, lambda r, pg: pg.broadcast(torch.ones(2), BROADCAST_ROOTS[r]))
    msg = _check(groups, tmp_path)
    assert "rank 1 diverged first, at collective #1" in msg, msg
    assert "rank 1 called broadcast of float32[2] root 1 from" in msg, msg
    assert "ranks [0, 2] called broadcast of float32[2] root 0 from" in msg, msg


def test_the_ledger_check_names_a_different_reduce_root(tmp_path):
    """``reduce`` packs its root and its op into one field: a different root alone is a mismatch."""
    groups = _groups(tmp_path, 3)
    _issue(groups, lambda r, pg: pg.reduce(torch.ones(2), BROADCAST_ROOTS[r], ReduceOp.MIN))
    msg = _check(groups, tmp_path)
    assert "rank 1 called reduce of float32[2] root 1 MIN from" in msg, msg
    assert "ranks [0, 2] called reduce of float32[2] root 0 MIN from" in msg, msg


def test_the_ledger_check_passes_when_op_and_root_agree(tmp_path):
    groups = _groups(tmp_path, 3)
    _issue(groups, lambda r, pg: pg.all_reduce(torch.ones(2), ReduceOp.MAX))
    _issue(groups, lambda r, pg: pg.broadcast(torch.ones(2), 1))
    check = PeerCheck(tmp_path, every=1)
    check.check(groups[0], 2)
    assert check._checked["world"] == 2


@pytest.mark.parametrize(
    "call,op,theirs,mine",
    [
        (lambda r, pg: pg.all_reduce(torch.ones(2), ALL_REDUCE_OPS[r]), "all_reduce", "SUM", "MAX"),
        (lambda r, pg: pg.broadcast(torch.ones(2), BROADCAST_ROOTS[r]), "broadcast", "root 0", "root 1"),
    ],
    ids=["reduce op", "root"],
)
def test_the_forensics_name_a_different_reduce_op_or_root(tmp_path, call, op, theirs, mine):
    groups = _groups(tmp_path, 3)
    _issue(groups, call)
    text = forensics.explain(tmp_path, "world", [0, 1, 2], stacks=False)
    assert "rank 1 diverged first, at collective #1 of group 'world'" in text, text
    assert f"rank 1 called {op} of float32[2] {mine} from" in text, text
    assert f"ranks [0, 2] called {op} of float32[2] {theirs} from" in text, text
