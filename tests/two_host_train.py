"""A small DDP training run for launcher tests (torchrun, two hosts): prints a parameter digest.

Run by `torchrun ... tests/two_host_train.py`; ranks come from torchrun's environment.
"""

import hashlib
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ddptrain.comm as dist  # noqa: E402
from ddptrain.ddp import DistributedDataParallel as DDP  # noqa: E402
from ddptrain.launch.env import detect_environment  # noqa: E402


def main():
    env = detect_environment()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=60)
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    ddp = DDP(model, bucket_cap_mb=0.001)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)
    w = torch.randn(20, 4, generator=torch.Generator().manual_seed(0))
    first = last = None
    for _step in range(30):
        x = torch.randn(16, 20, generator=g)
        loss = F.cross_entropy(ddp(x), (x @ w).argmax(1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = loss.item() if first is None else first
        last = loss.item()
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    print(
        f"RESULT launcher={env.name} rank={rank} world={ws} node={env.node_rank} first={first:.4f} "
        f"last={last:.4f} digest={digest}",
        flush=True,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
