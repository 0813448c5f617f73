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

Two bare loops, both as torch users write them, differ only in the dataset the ``DataLoader``
reads: ``transforms`` (the example: ``ToTensor`` + ``Normalize`` per sample, in ``__getitem__``)
and ``preloaded`` (the normalized images as one ``TensorDataset``, built before the clock starts:
the data path ddptrain's recipe takes with ``data.preload``). ``preloaded`` is the anchor for the
loop's own cost; ``transforms`` is what a newcomer compares against. ``lightning`` (when
``pytorch_lightning`` is installed) is Lightning 2's ``Trainer(strategy="ddp", accelerator="cpu")``
over the same preloaded tensors, with its progress bar, logger, checkpointing and sanity check off,
timed from ``on_train_start`` to ``on_train_end`` (its validation each epoch included).

    .venv/bin/python scripts/bench_loop.py [--rounds 3] [--epochs 2] [--world-size 2] [--data-root DIR]
        [--anchors transforms,preloaded,lightning]

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


def bare_worker(rank: int, world_size: int, port: int, args: argparse.Namespace, out: Path, anchor: str) -> None:
    """One rank of the bare torch loop; rank 0 writes ``{"train_s": ..., "accuracy": ...}`` to ``out``."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset
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
    if anchor == "preloaded":  # the same values as ToTensor + Normalize, computed once
        train, test = (
            TensorDataset(d.data.float().div(255).sub(0.1307).div(0.3081).unsqueeze(1), d.targets)
            for d in (train, test)
        )
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


LIGHTNING_SCRIPT = """
import json, sys, time
import torch, torch.nn.functional as F
import pytorch_lightning as pl
from torch.utils.data import DataLoader, TensorDataset
from torchvision import datasets

sys.path.insert(0, {repo!r})
from recipes.mnist import Net


class Task(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = Net()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("acc", (self.net(x).argmax(1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.5)


class Clock(pl.Callback):
    def on_train_start(self, trainer, module):
        self.started = time.perf_counter()

    def on_train_end(self, trainer, module):
        self.train_s = time.perf_counter() - self.started


def tensors(train):
    d = datasets.MNIST({root!r}, train=train, download=False)
    return TensorDataset(d.data.float().div(255).sub(0.1307).div(0.3081).unsqueeze(1), d.targets)


if __name__ == "__main__":
    torch.set_num_threads(max(1, {cores} // {world_size}))
    pl.seed_everything(1234, verbose=False)
    clock = Clock()
    trainer = pl.Trainer(
        accelerator="cpu", devices={world_size}, strategy="ddp", max_epochs={epochs}, num_sanity_val_steps=0,
        enable_progress_bar=False, logger=False, enable_checkpointing=False, enable_model_summary=False,
        callbacks=[clock],
    )
    batch = 128 // {world_size}
    train, val = DataLoader(tensors(True), batch_size=batch, shuffle=True), DataLoader(tensors(False), batch_size=1000)
    trainer.fit(Task(), train, val)
    if trainer.global_rank == 0:
        acc = float(trainer.callback_metrics["acc"])
        open({out!r}, "w").write(json.dumps({{"train_s": clock.train_s, "accuracy": acc}}))
"""


def run_lightning(args: argparse.Namespace, workdir: Path) -> dict:
    """One round of the same task under Lightning's DDP (a script of its own: Lightning re-runs it per rank)."""
    out, script = workdir / "lightning.json", workdir / "lightning_task.py"
    script.write_text(
        LIGHTNING_SCRIPT.format(
            repo=str(REPO),
            root=str(args.data_root),
            cores=os.cpu_count() or 1,
            world_size=args.world_size,
            epochs=args.epochs,
            out=str(out),
        )
    )
    proc = subprocess.run([sys.executable, str(script)], cwd=workdir, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        sys.exit(f"Lightning failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def run_bare(args: argparse.Namespace, workdir: Path, anchor: str) -> dict:
    """One round of the bare torch loop (``anchor``'s dataset) on ``--world-size`` spawned processes."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = workdir / "bare.json"
    mp.spawn(bare_worker, args=(args.world_size, port, args, out, anchor), nprocs=args.world_size, join=True)
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
    parser.add_argument("--anchors", default="transforms,preloaded", help="bare loops to run: transforms, preloaded")
    args = parser.parse_args()
    anchors = [a for a in args.anchors.split(",") if a]
    if not anchors or set(anchors) - {"transforms", "preloaded", "lightning"}:
        sys.exit(f"--anchors={args.anchors}: choose from transforms, preloaded, lightning (comma-separated)")
    args.data_root = args.data_root or default_data_root()
    if args.data_root is None:
        sys.exit("no MNIST found: pass --data-root DIR (holding MNIST/raw) or set DDPTRAIN_DATA_SOURCES")
    times: dict[str, list[float]] = {"ddptrain": [], **{a: [] for a in anchors}}
    with tempfile.TemporaryDirectory() as tmp:
        args.data_root = decompressed(args.data_root, Path(tmp) / "data")
        for round_ in range(args.rounds):
            ours = run_ddptrain(args, Path(tmp), round_)
            times["ddptrain"].append(ours["train_s"])
            line = f"round {round_ + 1}: ddptrain {ours['train_s']:.2f} s (acc {ours['accuracy']:.4f})"
            for anchor in anchors:
                bare = run_lightning(args, Path(tmp)) if anchor == "lightning" else run_bare(args, Path(tmp), anchor)
                times[anchor].append(bare["train_s"])
                line += f", {_name(anchor)} {bare['train_s']:.2f} s (acc {bare['accuracy']:.4f})"
            print(line, flush=True)
    ours_s = statistics.median(times["ddptrain"])
    print(f"median training time of {args.rounds} round(s): ddptrain {ours_s:.2f} s")
    for anchor in anchors:
        torch_s = statistics.median(times[anchor])
        print(f"ratio ddptrain / {_name(anchor)}: {ours_s / torch_s:.3f} (median {torch_s:.2f} s)")


def _name(anchor: str) -> str:
    return "Lightning DDP (preloaded)" if anchor == "lightning" else f"bare torch DDP ({anchor})"


if __name__ == "__main__":
    main()
