"""What every launched rank does, whoever started it (the local spawner or ``mpiexec``).

:func:`run_rank` sets the rank's torch threads, joins the default process group if asked, calls
``fn(rank, world_size, *args, **kwargs)`` and leaves the group; :func:`report` hands the
outcome to the launcher and ends a failed rank at once, so that its launcher (or ``mpiexec``)
stops the others instead of leaving them waiting in a collective.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from .failures import WorkerOutcome, encode_outcome


def run_rank(
    fn: Callable,
    rank: int,
    world_size: int,
    args: Sequence,
    kwargs: dict,
    *,
    threads: int,
    group_backend: str | None,
    comm_timeout_s: float | None,
) -> Any:
    """``fn(rank, world_size, *args, **kwargs)`` with ``threads`` torch threads, inside the default
    process group on ``group_backend`` when that is set (None: ``fn`` joins by itself, or not)."""
    import torch

    torch.set_num_threads(threads)
    if group_backend:
        from ..comm import destroy_process_group, init_process_group

        init_process_group(group_backend, timeout=comm_timeout_s)
    try:
        return fn(rank, world_size, *args, **kwargs)
    finally:
        if group_backend:
            destroy_process_group()


def report(outcome: WorkerOutcome, rank: int, send: Callable[[bytes], None]) -> None:
    """Give ``outcome`` to the launcher through ``send``; after a failure, end this process now.

    ``os._exit`` skips atexit handlers that could block on dead peers (MPI's finalize among them),
    and its non-zero code is what makes ``mpiexec`` stop the other ranks.
    """
    payload, failed = encode_outcome(outcome, rank)
    send(payload)
    if failed:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
