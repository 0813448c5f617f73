"""A training script written the way PyTorch's DDP tutorial writes one, run under torchrun.

``--impl torch`` uses torch.distributed, torch's DistributedDataParallel and DistributedSampler;
``--impl ddptrain`` switches only those imports to ddptrain's. Everything else is left to the
defaults (env:// rendezvous, the sampler's rank and world size, DDP's options). Rank 0 prints the
SHA-256 of the final weights.
"""

import argparse
import hashlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--impl", choices=["torch", "ddptrain"], required=True)
IMPL = parser.parse_args().impl

if IMPL == "torch":
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data.distributed import DistributedSampler
else:
    import ddptrain.comm as dist
    from ddptrain import DistributedDataParallel as DDP
    from ddptrain.data import DistributedSampler


def main() -> None:
    dist.init_process_group(backend="gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 64), nn.ReLU(), nn.Linear(64, 10))
    ddp_model = DDP(model)
    g = torch.Generator().manual_seed(1)
    dataset = TensorDataset(torch.randn(1000, 1, 28, 28, generator=g), torch.randint(0, 10, (1000,), generator=g))
    sampler = DistributedSampler(dataset)
    loader = DataLoader(dataset, batch_size=25, sampler=sampler)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.1, momentum=0.9)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for inputs, targets in loader:
            optimizer.zero_grad()
            F.cross_entropy(ddp_model(inputs), targets).backward()
            optimizer.step()
    if dist.get_rank() == 0:
        digest = hashlib.sha256()
        for tensor in model.state_dict().values():
            digest.update(tensor.numpy().tobytes())
        print(f"weights sha256 {digest.hexdigest()} ({IMPL}, {dist.get_world_size()} ranks)")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
