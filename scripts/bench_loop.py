"""ddptrain's training loop against a bare torch DDP loop written the way a torch user writes it.

The anchor is PyTorch's MNIST example made distributed: torchvision's ``MNIST`` with
``ToTensor`` + ``Normalize``, a ``DataLoader`` over torch's ``DistributedSampler``
(``set_epoch`` every epoch), ``torch.nn.parallel.DistributedDataParallel`` around the recipe's
``Net``, SGD lr 0.01 momentum 0.5, a global batch of 128 split over the ranks, and an evaluation
on the test set after each epoch. The other side is ``python -m ddptrain recipe=mnist`` with the
same epochs and world size. The two alternate, ``--rounds`` times each, in this one invocation (the
machine's speed drifts; alternating spreads the drift over both), and the script prints each
round's training seconds (the epoch loops only, evaluation included for the bare loop as it is for
ddptrain's ``time/train_s``), the medians and the ratio ddptrain / bare torch.

    .venv/bin/python scripts/bench_loop.py [--rounds 3] [--epochs 2] [--world-size 2] [--data-root DIR]

``--data-root`` must hold ``MNIST/raw`` (torchvision's layout); by default the first directory of
``DDPTRAIN_DATA_SOURCES`` that does.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def bare_worker(rank: int, world_size: int, port: int, args: argparse.Namespace, out: Path) -> None:
    """One rank of the bare torch loop; rank 0 writes ``{"train_s": ..., "accuracy": ...}`` to ``out``."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler
    from torchvision import datasets, transforms

    sys.path.insert(0, str(REPO))
    from recipes.mnist import Net  # the recipe's model, so both sides train the same network

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(1234 + rank)
    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    train = datasets.MNIST(args.data_root, train=True, download=False, transform=transform)
    test = datasets.MNIST(args.data_root, train=False, download=False, transform=transform)
    train_sampler = DistributedSampler(train, seed=1234)
    test_sampler = DistributedSampler(test, shuffle=False)
    batch = 128 // world_size
    train_loader = DataLoader(train, batch_size=batch, sampler=train_sampler)
    test_loader = DataLoader(test, batch_size=1000, sampler=test_sampler)
    model = torch.nn.parallel.DistributedDataParallel(Net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
    started = time.perf_counter()
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for inputs, targets in train_loader:
            optimizer.zero_grad()
            F.cross_entropy(model(inputs), targets).backward()
            optimizer.step()
        model.eval()
        correct = torch.zeros(2)
        with torch.no_grad():
            for inputs, targets in test_loader:
                correct += torch.tensor([(model(inputs).argmax(1) == targets).sum().item(), len(targets)])
        dist.all_reduce(correct)
    train_s = time.perf_counter() - started
    if rank == 0:
        out.write_text(json.dumps({"train_s": train_s, "accuracy": float(correct[0] / correct[1])}))
    dist.destroy_process_group()


def run_bare(args: argparse.Namespace, workdir: Path) -> dict:
    """One round of the bare torch loop on ``--world-size`` spawned processes."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = workdir / "bare.json"
    mp.spawn(bare_worker, args=(args.world_size, port, args, out), nprocs=args.world_size, join=True)
    return json.loads(out.read_text())


def run_ddptrain(args: argparse.Namespace, workdir: Path, round_: int) -> dict:
    """One round of ``python -m ddptrain recipe=mnist``; its ``metrics.json`` in our terms."""
    run_dir = workdir / f"ddptrain-{round_}"
    cmd = [sys.executable, "-m", "ddptrain", "recipe=mnist", f"trainer.epochs={args.epochs}"]
    cmd += [f"dist.world_size={args.world_size}", "trainer.progress=false", f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "DDPTRAIN_DATA_SOURCES": str(args.data_root)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        sys.exit(f"ddptrain failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    metrics = json.loads((run_dir / "metrics.json").read_text())
    return {"train_s": metrics["time/train_s"], "accuracy": metrics.get("eval/accuracy")}


def default_data_root() -> Path | None:
    for entry in os.environ.get("DDPTRAIN_DATA_SOURCES", "").split(os.pathsep):
        if entry and (Path(entry) / "MNIST" / "raw").is_dir():
            return Path(entry)
    return None


def decompressed(root: Path, scratch: Path) -> Path:
    """A root whose ``MNIST/raw`` holds the files unzipped, as torchvision's ``MNIST`` reads them
    with ``download=False`` (a source may hold only the ``.gz`` files, read-only)."""
    import gzip
    import shutil

    raw = root / "MNIST" / "raw"
    names = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
    if all((raw / n).is_file() for n in names):
        return root
    target = scratch / "MNIST" / "raw"
    target.mkdir(parents=True)
    for name in names:
        with gzip.open(raw / f"{name}.gz") as src, open(target / name, "wb") as dst:
            shutil.copyfileobj(src, dst)
    return scratch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--data-root", type=Path, default=None)
    args = parser.parse_args()
    args.data_root = args.data_root or default_data_root()
    if args.data_root is None:
        sys.exit("no MNIST found: pass --data-root DIR (holding MNIST/raw) or set DDPTRAIN_DATA_SOURCES")
    times: dict[str, list[float]] = {"ddptrain": [], "torch": []}
    with tempfile.TemporaryDirectory() as tmp:
        args.data_root = decompressed(args.data_root, Path(tmp) / "data")
        for round_ in range(args.rounds):
            ours = run_ddptrain(args, Path(tmp), round_)
            bare = run_bare(args, Path(tmp))
            times["ddptrain"].append(ours["train_s"])
            times["torch"].append(bare["train_s"])
            print(
                f"round {round_ + 1}: ddptrain {ours['train_s']:.2f} s (acc {ours['accuracy']:.4f}), "
                f"bare torch DDP {bare['train_s']:.2f} s (acc {bare['accuracy']:.4f})",
                flush=True,
            )
    ours_s, torch_s = statistics.median(times["ddptrain"]), statistics.median(times["torch"])
    print(f"median training time: ddptrain {ours_s:.2f} s, bare torch DDP {torch_s:.2f} s")
    print(f"ratio ddptrain / bare torch DDP: {ours_s / torch_s:.3f} (at most 1.00 is the target)")


if __name__ == "__main__":
    main()
