"""Injected faults for the hang-forensics tests: each body runs on every rank; ``culprit`` misbehaves.

The lines that the messages must name are marked ``# LINE:<tag>`` (the tests look them up).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import torch
from torch.utils.data import DataLoader, Dataset

import ddptrain.comm as dist


def _warm_up():
    t = torch.ones(4)
    dist.all_reduce(t)  # LINE:warmup
    return t


def skip(rank, ws, culprit):
    t = _warm_up()
    if rank != culprit:
        dist.broadcast(t, 0)  # LINE:skipped
    dist.all_reduce(t)  # LINE:after_skip
    dist.barrier()


def extra(rank, ws, culprit):
    t = _warm_up()
    if rank == culprit:
        dist.all_reduce(torch.ones(2))  # LINE:extra
    dist.broadcast(t, 0)  # LINE:regular
    dist.barrier()


def shapes(rank, ws, culprit):
    t = _warm_up()
    x = torch.ones(6 if rank == culprit else 4)
    dist.all_reduce(x)  # LINE:shapes
    dist.all_reduce(t)
    dist.barrier()


def order(rank, ws, culprit):
    t = _warm_up()
    if rank == culprit:
        dist.broadcast(t, 0)  # LINE:order_culprit
        dist.all_reduce(torch.ones(2))
    else:
        dist.all_reduce(torch.ones(2))  # LINE:order_others
        dist.broadcast(t, 0)
    dist.barrier()


def sleep(rank, ws, culprit):
    t = _warm_up()
    if rank == culprit:
        time.sleep(120)  # LINE:sleep
    dist.all_reduce(t)
    dist.barrier()


def loop(rank, ws, culprit):
    t = _warm_up()
    n = 0
    while rank == culprit:  # LINE:loop_head
        n += 1  # LINE:loop
    dist.all_reduce(t)
    dist.barrier()


def sigstop(rank, ws, culprit):
    t = _warm_up()
    if rank == culprit:
        os.kill(os.getpid(), signal.SIGSTOP)  # LINE:sigstop
    dist.all_reduce(t)
    dist.barrier()


class _BlockingDataset(Dataset):
    """Item 3 never comes on the culprit (a stuck file system, a dead data server)."""

    def __init__(self, blocks: bool):
        self.blocks = blocks

    def __len__(self):
        return 8

    def __getitem__(self, i):
        if self.blocks and i == 3:
            threading.Event().wait()  # LINE:dataloader
        return torch.full((4,), float(i))


def dataloader(rank, ws, culprit):
    _warm_up()
    for batch in DataLoader(_BlockingDataset(rank == culprit), batch_size=1):
        dist.all_reduce(batch)  # LINE:data_step
    dist.barrier()


FAULTS = {f.__name__: f for f in (skip, extra, shapes, order, sleep, loop, sigstop, dataloader)}


def run_fault(rank, ws, fault, culprit, marks=None):
    """Run ``fault``; with ``marks`` (a directory), each rank writes when its fault began to it."""
    if marks:
        _warm_up()  # every rank is up and connected: the clock starts now
        with open(os.path.join(marks, f"rank{rank}.t"), "w") as f:
            f.write(str(time.time()))
    FAULTS[fault](rank, ws, culprit)


def line_of(tag: str) -> str:
    """``hang_faults.py:<line>`` of the line marked ``# LINE:<tag>``."""
    with open(__file__) as f:
        for n, line in enumerate(f, 1):
            if line.rstrip().endswith(f"# LINE:{tag}"):
                return f"hang_faults.py:{n}"
    raise KeyError(tag)
