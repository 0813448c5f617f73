"""One rank of a 2-rank gloo job whose rank 0 is stopped by SIGTERM while it waits in a collective.

``python stop_while_waiting.py URL RANK``: rank 1 joins the group and then never takes part, so
rank 0's all_reduce stays stuck on it; the test SIGTERMs rank 0 there. Rank 0 must then destroy
its group at once (its stuck work is abandoned, not joined) and print how long that took. A plain
group's wait blocks in C++ until the collective timeout, signals or not; an elastic job's group
waits in slices, as here.
"""

import os
import signal
import sys
import time

import torch

import ddptrain.comm as dist


class Stopped(Exception):
    pass


def _stop(signum, frame):
    raise Stopped


if __name__ == "__main__":
    url, rank = sys.argv[1], int(sys.argv[2])
    group = dist.init_process_group("gloo", init_method=url, world_size=2, rank=rank, timeout=60)
    group.abortable = True  # as an elastic job's group: its waits let signal handlers run
    if rank == 1:
        time.sleep(120)
    signal.signal(signal.SIGTERM, _stop)
    print("waiting", flush=True)
    try:
        dist.all_reduce(torch.ones(4))
    except Stopped:
        started = time.monotonic()
        dist.destroy_process_group()
        print(f"destroyed in {time.monotonic() - started:.2f} s", flush=True)
        os._exit(0)  # as a stopped ddptrain worker ends: the stuck work's thread is never joined
