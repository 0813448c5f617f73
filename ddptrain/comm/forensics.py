"""Hang forensics: compare the ranks' collective ledgers and say who diverged, where, and where
the ranks that never arrived are now.

Used by the backends when a collective times out or fails, by the launcher when a rank dies, by
the functional API's periodic ledger check, and by ``python -m ddptrain.dump``. Everything is read
from the ledger directory (:mod:`ddptrain.comm.ledger`): the ranks' ledgers, their processes'
state in ``/proc`` (a stopped rank is named as such), and their Python stacks, which a live rank
writes on ``SIGUSR1``. The ranks must share the directory (one machine, or a shared file system).
"""

from __future__ import annotations

import linecache
import os
import re
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from .ledger import _FALLBACK, _USER, LedgerFile, Record, frame_kind, read_all, short_path
from .stacks import stack_path

TAIL = 5  # ledger records shown per rank by the dump


# -- processes and stacks ------------------------------------------------------------------------
def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of ``pid`` (R, S, D, T stopped, t traced, Z), None if gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()[0]


def request_stacks(directory: str | Path, ranks_pids: dict[int, int], wait_s: float = 1.5) -> dict[int, str]:
    """Ask each live rank (SIGUSR1) for its Python stack; the text each wrote, by rank. (A stopped
    rank is not asked: continuing it for the dump would let it run on into its next collective.)"""
    starts = {}
    for rank, pid in ranks_pids.items():
        if pid == os.getpid():
            continue  # never this process: its stack is the traceback being written
        path = stack_path(directory, rank)
        try:
            starts[rank] = path.stat().st_size if path.exists() else 0
            os.kill(pid, signal.SIGUSR1)
        except OSError:
            continue
    return _collect_stacks(directory, starts, wait_s)


def _collect_stacks(directory, starts: dict[int, int], wait_s: float) -> dict[int, str]:
    got: dict[int, str] = {}
    deadline = time.monotonic() + wait_s
    while starts and time.monotonic() < deadline:
        time.sleep(0.05)
        for rank in list(starts):
            text = _read_from(stack_path(directory, rank), starts[rank])
            if text and text == got.get(rank):  # stopped growing: the dump is complete
                starts.pop(rank)
            elif text:
                got[rank] = text
    return got


def _read_from(path: Path, offset: int) -> str:
    try:
        with open(path, errors="replace") as f:
            f.seek(offset)
            return f.read()
    except OSError:
        return ""


_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+)", re.M)
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$', re.M)


def main_stack(text: str) -> list[tuple[str, int, str]]:
    """The frames (file, line, function), innermost first, of the dumped thread that is not a
    ``threading`` worker (the main thread); the first thread if all are."""
    blocks = [b for b in _THREAD.split(text)]
    stacks = []
    for i in range(3, len(blocks), 3):
        frames = [(f, int(n), fn) for f, n, fn in _FRAME.findall(blocks[i])]
        if frames:
            stacks.append(frames)
    if not stacks:
        frames = [(f, int(n), fn) for f, n, fn in _FRAME.findall(text)]
        return frames
    for frames in stacks:
        if not frames[-1][0].endswith(("threading.py",)):
            return frames
    return stacks[0]


def where(frames: list[tuple[str, int, str]]) -> str:
    """ "my_train.py:57 in main: `time.sleep(100)`", from the first user frame (innermost first)."""
    if not frames:
        return "(no Python stack received)"
    chosen = next((fr for fr in frames if frame_kind(fr[0]) == _USER), None)
    chosen = chosen or next((fr for fr in frames if frame_kind(fr[0]) == _FALLBACK), frames[0])
    filename, line, func = chosen
    source = linecache.getline(filename, line).strip()
    text = f"{short_path(filename)}:{line} in {func}" + (f": `{source}`" if source else "")
    if chosen is not frames[0]:
        inner_file, inner_line, inner_func = frames[0]
        text += f" (innermost: {short_path(inner_file)}:{inner_line} in {inner_func})"
    return text


# -- comparing ledgers ----------------------------------------------------------------------------
@dataclass
class Analysis:
    """The ledgers of one group compared."""

    group: str
    last: dict[int, Record | None]  # each rank's last record of the group
    diverged_at: int = 0  # first sequence number where the ranks' records differ (0: none)
    at: dict[int, Record] = field(default_factory=dict)  # each rank's record there
    culprits: list[int] = field(default_factory=list)  # the odd ones out (empty: no majority)
    behind: list[int] = field(default_factory=list)  # ranks whose last collective is older than others'


def analyze(ledgers: dict[int, LedgerFile], group: str, ranks: list[int]) -> Analysis:
    """Compare the records of ``group`` on ``ranks`` (those with a ledger)."""
    by_rank = {r: {rec.seq: rec for rec in ledgers[r].records if rec.group == group} for r in ranks if r in ledgers}
    last = {r: (recs[max(recs)] if recs else None) for r, recs in by_rank.items()}
    result = Analysis(group, last)
    if not by_rank:
        return result
    tops = {r: (max(recs) if recs else 0) for r, recs in by_rank.items()}
    result.behind = sorted(r for r, top in tops.items() if top < max(tops.values()))
    lo = max((min(recs) if recs else 0) for recs in by_rank.values())
    hi = min(tops.values())
    for key in (Record.fingerprint, lambda rec: rec.site):
        for seq in range(max(lo, 1), hi + 1):
            recs = {r: by_rank[r][seq] for r in by_rank if seq in by_rank[r]}
            if len({key(rec) for rec in recs.values()}) > 1:
                result.diverged_at, result.at = seq, recs
                result.culprits = _odd_ones_out({r: key(rec) for r, rec in recs.items()})
                return result
    return result


def _odd_ones_out(keys: dict[int, object]) -> list[int]:
    """The ranks outside the one strict majority of equal keys ([] if there is none)."""
    (common, n), *rest = Counter(keys.values()).most_common()
    if rest and rest[0][1] == n:
        return []
    return sorted(r for r, k in keys.items() if k != common)


def _ranks_text(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def describe_divergence(a: Analysis) -> list[str]:
    if not a.diverged_at:
        return []
    groups: dict[str, list[int]] = {}
    for r, rec in sorted(a.at.items()):
        groups.setdefault(rec.describe(), []).append(r)
    calls = "; ".join(f"{_ranks_text(rs)} called {d}" for d, rs in groups.items())
    if a.culprits:
        head = f"{_ranks_text(a.culprits)} diverged first, at collective #{a.diverged_at} of group {a.group!r}"
    else:
        head = f"the ranks diverged at collective #{a.diverged_at} of group {a.group!r} (no majority to tell who)"
    return [f"{head}: {calls}."]


def describe_missing(
    a: Analysis, ledgers: dict[int, LedgerFile], directory, me: int | None, stacks: bool = True
) -> list[str]:
    """One line per rank behind the others: stopped, gone, or where its stack says it is."""
    if not a.behind:
        return []
    top = max(rec.seq for rec in a.last.values() if rec is not None)
    live = {}
    lines = {}
    for r in a.behind:
        pid = ledgers[r].pid
        last = a.last.get(r)
        did = f"its last collective: #{last.seq} {last.describe()}" if last else "it called no collective of the group"
        state = process_state(pid)
        head = f"rank {r} (pid {pid}) never arrived at collective #{top}"
        if state is None:
            lines[r] = f"{head}: the process is gone; {did}."
        elif state in "Tt":
            lines[r] = f"{head}: rank {r} is stopped (SIGSTOP, process state {state}); {did}."
        elif state == "Z":
            lines[r] = f"{head}: the process exited (zombie); {did}."
        else:
            lines[r] = f"{head}; {did}."
            if r != me:
                live[r] = pid
    if stacks and live:
        for r, text in request_stacks(directory, live).items():
            lines[r] = lines[r][:-1] + f"; it is now in {where(main_stack(text))}."
    return [lines[r] for r in a.behind]


def explain(directory, group: str, ranks: list[int], me: int | None = None, stacks: bool = True) -> str:
    """The forensic lines for ``group`` ('' when the directory holds nothing to compare)."""
    if not directory or not Path(directory).is_dir():
        return ""
    try:
        ledgers = read_all(directory)
        a = analyze(ledgers, group, ranks)
        # after a divergence, who is "behind" only follows from it: name the divergence alone
        lines = describe_divergence(a) or describe_missing(a, ledgers, directory, me, stacks)
    except Exception as exc:  # noqa: BLE001 - forensics must never hide the error it explains
        return f"\n  (the collective ledgers could not be compared: {type(exc).__name__}: {exc})"
    if not lines:
        return ""
    return "\nCollective ledger:\n" + "\n".join(f"  {line}" for line in lines)


def explain_group(pg) -> str:
    """:func:`explain` for a live group, as seen by this rank (never signals itself)."""
    ledger = pg.ledger
    if ledger.directory is None:
        return ""
    return explain(ledger.directory, pg.name, list(pg.global_ranks), me=ledger.rank)


def explain_job(directory, stacks: bool = True) -> str:
    """Every group's forensic lines for a whole job (the launcher, after a rank died)."""
    if not directory or not Path(directory).is_dir():
        return ""
    ledgers = read_all(directory)
    groups = sorted({rec.group for led in ledgers.values() for rec in led.records})
    parts = [explain(directory, g, sorted(ledgers), stacks=stacks) for g in groups]
    return "".join(parts)


def dump(directory) -> str:
    """Every rank's state, stack and ledger tail, for ``python -m ddptrain.dump`` (stops nothing)."""
    ledgers = read_all(directory)
    if not ledgers:
        return f"no collective ledgers in {directory} (is it a run directory of a job that is running?)"
    live = {r: led.pid for r, led in ledgers.items() if (process_state(led.pid) or "Z") not in "TtZ"}
    stacks = request_stacks(directory, live)
    out = []
    for r, led in sorted(ledgers.items()):
        state = process_state(led.pid)
        if state is None:
            status = "exited"
        elif state in "Tt":
            status = f"stopped (SIGSTOP, process state {state})"
        elif r in stacks:
            status = f"in {where(main_stack(stacks[r]))}"
        else:
            status = f"running (state {state}); no stack received"
        out.append(f"rank {r} (pid {led.pid} on {led.host}): {status}")
        for rec in led.records[-TAIL:]:
            out.append(f"    #{rec.seq} {rec.group}: {rec.describe()}")
        if r in stacks:
            out.append("  stack (most recent call first):")
            out.extend("    " + line for line in stacks[r].strip().splitlines())
    out.append(explain_job(directory, stacks=False).strip("\n"))
    return "\n".join(line for line in out if line)
