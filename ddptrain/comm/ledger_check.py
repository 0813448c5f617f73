"""The functional API's default collective check: compare ledgers, every N collectives, off the
critical path.

Every ``N`` collectives of a group (``DDPTRAIN_CHECK_EVERY``), a rank reads the records its peers
have written since the last check straight from their memory-mapped ledgers (no message, no
waiting: a peer that is behind is checked next time) and compares operation, dtype, size and
root/reduce op per sequence number. A mismatch that the backend let pass silently (a longer
non-root ``broadcast``, a different reduce op, two collectives swapped with equal sizes) raises
:class:`CollectiveMismatchError` naming the rank that diverged, the sequence number, what each
side called there and from which file:line. Mismatches that make the backend hang or fail are
explained by the timeout's forensics (:mod:`ddptrain.comm.forensics`) from the same ledgers.
"""

from __future__ import annotations

import mmap
import struct

from .forensics import Analysis, _odd_ones_out, describe_divergence
from .ledger import _COUNT_OFFSET, _HEADER, _RECORD, HEADER_SIZE, _record_from, ledger_path
from .types import CommError


class CollectiveMismatchError(CommError, ValueError):
    """Ranks called different collectives (operation, size, dtype or root) at the same point."""


class PeerCheck:
    """The hook ``ProcessGroup`` calls after each ledger record (``hook(group, seq)``)."""

    def __init__(self, directory, every: int):
        self.directory = directory
        self.every = max(1, every)
        self._peers: dict[int, mmap.mmap] = {}
        self._checked: dict[str, int] = {}  # group -> sequence number checked up to

    def __call__(self, group, seq: int) -> None:
        if seq % self.every or group.size() == 1:
            return
        self.check(group, seq)

    def _peer(self, rank: int):
        buf = self._peers.get(rank)
        if buf is None:
            try:
                with open(ledger_path(self.directory, rank), "rb") as f:
                    buf = self._peers[rank] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError):
                return None
        return buf

    def _since(self, buf, group: bytes, after: int) -> dict:
        """Raw records of ``group`` with seq > ``after``, newest first, from one ledger."""
        capacity, count = _HEADER.unpack_from(buf, 0)[4], struct.unpack_from("<q", buf, _COUNT_OFFSET)[0]
        found = {}
        for i in range(count - 1, max(-1, count - capacity - 1), -1):
            raw = _RECORD.unpack_from(buf, HEADER_SIZE + (i % capacity) * _RECORD.size)
            if raw[1].rstrip(b"\0") != group:
                continue
            if raw[0] <= after:
                break
            found[raw[0]] = raw
        return found

    def check(self, group, seq: int) -> None:
        """Compare every sequence number all members have reached since the last check."""
        name = group.name.encode()[:24]
        after = self._checked.get(group.name, 0)
        views = {}
        for rank in group.global_ranks:
            buf = self._peer(rank)
            if buf is None:
                return  # a member without a readable ledger: nothing to compare with
            views[rank] = self._since(buf, name, after)
        upto = min((max(v) if v else after) for v in views.values())
        for s in range(after + 1, upto + 1):
            raws = {r: v[s] for r, v in views.items() if s in v}
            keys = {r: (raw[2], raw[3], raw[6], raw[7]) for r, raw in raws.items()}
            if len(set(keys.values())) > 1:
                self._raise(group, s, raws, keys)
        self._checked[group.name] = max(after, upto)

    def _raise(self, group, seq: int, raws: dict, keys: dict) -> None:
        at = {r: _record_from(raw) for r, raw in raws.items()}
        a = Analysis(group.name, {}, diverged_at=seq, at=at, culprits=_odd_ones_out(keys))
        raise CollectiveMismatchError(
            f"mismatched collectives on group {group.name!r} (found by the ledger check): "
            + describe_divergence(a)[0]
            + " Every rank must call the same collectives in the same order, with tensors of the same "
            "size and dtype and the same root/op. (DDPTRAIN_CHECK_COLLECTIVES=sync checks each call "
            "before it runs, at the price of one small all-reduce per call.)"
        )
