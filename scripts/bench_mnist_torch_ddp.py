"""The tutorial's MNIST setup on ``torch.nn.parallel.DistributedDataParallel``: the reference for
``python -m ddptrain recipe=mnist``.

Same everything except the DDP and the loop around it: the recipe's ``Net`` (dropout 0.5), MNIST
preloaded as normalised tensors, ddptrain's ``DistributedSampler`` (torch's arithmetic), a global
batch of 128 split over the ranks, SGD lr 0.01 momentum 0.5, seed 1234 + rank, ``cores // ranks``
threads per rank, an exact evaluation on the test set after every epoch. Prints the test accuracy,
the training time (epoch loops only) and the wall time, as ``python -m ddptrain`` does.

    .venv/bin/python scripts/bench_mnist_torch_ddp.py [--world-size 2] [--epochs 10] [--max-steps N]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def worker(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as tdist
    import torch.nn.functional as F

    from ddptrain.data import DistributedSampler, mnist
    from ddptrain.recipes.mnist import MnistTrainer, Net, as_normalized_tensors
    from ddptrain.trainer.data import TensorBatches

    started = time.perf_counter()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    tdist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(1234 + rank)
    model = torch.nn.parallel.DistributedDataParallel(Net())
    train = as_normalized_tensors(mnist(args.data_root, train=True), MnistTrainer.mean, MnistTrainer.std)
    test = as_normalized_tensors(mnist(args.data_root, train=False), MnistTrainer.mean, MnistTrainer.std)
    sampler = DistributedSampler(train, world_size, rank, shuffle=True, seed=1234)
    test_sampler = DistributedSampler(test, world_size, rank, shuffle=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
    batch = 128 // world_size
    train_s, step, epochs = 0.0, 0, []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.perf_counter()
        loss_sum, n = 0.0, 0
        for images, labels in TensorBatches(train, sampler, batch):
            optimizer.zero_grad(set_to_none=True)
            loss = F.nll_loss(model(images), labels)
            loss.backward()
            optimizer.step()
            loss_sum, n, step = loss_sum + loss.item(), n + 1, step + 1
            if args.max_steps and step >= args.max_steps:
                break
        epoch_train_s = time.perf_counter() - t0
        train_s += epoch_train_s
        # Exact evaluation: padding duplicates (none for 10000 / 2) masked, sums all-reduced.
        model.eval()
        keep = (~test_sampler.padding_mask()).double()
        sums, pos = torch.zeros(3, dtype=torch.float64), 0
        with torch.no_grad():
            for images, labels in TensorBatches(test, test_sampler, 1000):
                k = keep[pos : pos + len(labels)]
                pos += len(labels)
                out = model.module(images)
                sums += torch.stack(
                    [
                        (F.nll_loss(out, labels, reduction="none").double() * k).sum(),
                        ((out.argmax(1) == labels).double() * k).sum(),
                        k.sum(),
                    ]
                )
        tdist.all_reduce(sums)
        epochs.append(
            {
                "epoch": epoch + 1,
                "train_s": epoch_train_s,
                "train_loss": loss_sum / max(n, 1),
                "eval_loss": (sums[0] / sums[2]).item(),
                "eval_accuracy": (sums[1] / sums[2]).item(),
            }
        )
        if rank == 0:
            print(json.dumps(epochs[-1]), flush=True)
        if args.max_steps and step >= args.max_steps:
            break
    tdist.destroy_process_group()
    return {**epochs[-1], "train_s": train_s, "fit_s": time.perf_counter() - started, "steps": step}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: no limit)")
    parser.add_argument("--data-root", default=None, help="MNIST cache (default: $DDPTRAIN_DATA or ./data)")
    args = parser.parse_args()
    from ddptrain.launch import launch

    wall = time.perf_counter()
    results = launch(worker, args.world_size, args=(args,))
    summary = {
        "impl": "torch.nn.parallel.DistributedDataParallel",
        "world_size": args.world_size,
        **results[0],
        "wall_s": time.perf_counter() - wall,
    }
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
