"""One rank of a 2-rank gloo job that ends right after its last collective.

``python exit_after_collective.py URL RANK``: the last all_gather is asynchronous and never
waited, and the program ends without destroying the group, so gloo's worker thread releases that
work's tensors (which takes the GIL) while Python is finalizing: that ended the process with
SIGABRT. A long switch interval keeps the GIL with the main thread meanwhile.
"""

import sys

import torch

import ddptrain.comm as dist

if __name__ == "__main__":
    url, rank = sys.argv[1], int(sys.argv[2])
    sys.setswitchinterval(1.0)
    group = dist.init_process_group("gloo", init_method=url, world_size=2, rank=rank, timeout=30)
    x = torch.full((1000,), float(rank))
    for _ in range(20):
        outs = [torch.empty(1000) for _ in range(2)]
        dist.all_gather(outs, x)
        assert [o[0].item() for o in outs] == [0.0, 1.0]
    dist.all_gather([torch.empty(1000) for _ in range(2)], x, async_op=True)
