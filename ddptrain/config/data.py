"""``data.*``: datasets and batches (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass

from .schema import bounded

__all__ = ["DataConfig"]


@dataclass
class DataConfig:
    """Datasets and batches."""

    name: str = "mnist"
    """Dataset for the default ``Trainer.train_dataloader``: ``mnist``, ``fashion_mnist`` or ``synthetic``."""
    root: str | None = None
    """Data root (a writable cache); ``None`` means ``$DDPTRAIN_DATA``, else ``./data``."""
    download: bool = True
    """Download a dataset found nowhere locally (through torchvision), as the PyTorch tutorial
    does; ``false`` forbids it (offline machines, or to be sure which copy is used)."""
    global_batch_size: int = bounded(128, at_least=1)
    """Samples per optimizer step over all ranks; each rank takes
    ``global_batch_size / (world_size * trainer.grad_accum_steps)`` per micro-batch."""
    eval_batch_size: int = bounded(1000, at_least=1)
    """Evaluation batch size per rank."""
    num_workers: int = bounded(0, at_least=0)
    """DataLoader worker processes per rank (datasets held as tensors skip the DataLoader)."""
    preload: bool = True
    """Hold the datasets as tensors in memory and index them by batch (much faster than
    per-item transforms for MNIST-sized data)."""
    drop_last: bool = False
    """Cut the epoch's tail so ranks need no padding duplicates, instead of repeating samples."""
    num_train_samples: int = bounded(10000, at_least=1)
    """``synthetic`` only: training samples."""
    num_val_samples: int = bounded(2000, at_least=1)
    """``synthetic`` only: validation samples."""
