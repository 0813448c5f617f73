"""One launch per key, whose per-rank results several tests read (spawning a world costs seconds).

A failed launch is remembered and reported by every test that asks for it, not run again.
"""

from __future__ import annotations

import pickle

import pytest

from ddptrain.testing import run_distributed

_RESULTS: dict = {}


def launch_once(
    key,
    fn,
    world_size: int,
    *args,
    backend: str = "gloo",
    timeout_s: float = 120.0,
    comm_timeout_s: float | None = None,
    env: dict | None = None,
) -> list:
    """``fn``'s unpickled results per rank (``fn`` returns pickled bytes) for ``key``."""
    if key not in _RESULTS:
        try:
            raw = run_distributed(
                fn, world_size, *args, backend=backend, timeout_s=timeout_s, comm_timeout_s=comm_timeout_s, env=env
            )
            _RESULTS[key] = [pickle.loads(r) for r in raw]
        except Exception as exc:  # noqa: BLE001 - every test of this launch reports it
            _RESULTS[key] = exc
    got = _RESULTS[key]
    if isinstance(got, Exception):
        pytest.fail(f"the shared launch {key!r} ({backend}, {world_size} ranks) failed: {type(got).__name__}: {got}")
    return got
