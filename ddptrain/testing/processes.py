"""Helpers for testing distributed code: run a body on N ranks with a hard timeout.

Usable from pytest in ddptrain's own suite and in users' CI::

    def body(rank, world_size):
        t = torch.ones(1)
        ddptrain.comm.all_reduce(t)
        return t.item()

    assert run_distributed(body, 2) == [2.0, 2.0]

A failing rank fails the call with that rank's traceback; a stuck job is killed at ``timeout_s``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..launch import launch


def run_distributed(
    fn: Callable,
    world_size: int,
    *args,
    backend: str = "gloo",
    timeout_s: float = 120.0,
    comm_timeout_s: float | None = None,
    threads_per_worker: int = 1,
    env: dict | None = None,
    **kwargs,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks joined by ``backend``.

    Collectives time out after ``comm_timeout_s`` (default: ``timeout_s`` minus a margin), so a
    mismatched collective surfaces as an error naming the operation rather than as a kill.
    """
    if comm_timeout_s is None:
        comm_timeout_s = max(5.0, timeout_s * 0.75)
    return launch(
        fn,
        world_size,
        args,
        kwargs,
        backend=backend,
        timeout_s=timeout_s,
        comm_timeout_s=comm_timeout_s,
        threads_per_worker=threads_per_worker,
        env=env,
    )
