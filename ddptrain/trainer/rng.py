"""Capture and restore every random number generator a training step may draw from.

States are stored as tensors and plain Python types only, so a checkpoint holding them loads
with ``torch.load(weights_only=True)``: Python's ``random`` state becomes an int64 tensor, numpy's
its key tensor plus integers.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator
from typing import Any

import torch

try:  # numpy is optional: torch runs without it
    import numpy as np
except ImportError:  # pragma: no cover - numpy ships with torchvision
    np = None

__all__ = [
    "seed_everything",
    "use_deterministic_algorithms",
    "capture_rng_state",
    "restore_rng_state",
    "preserved_rng_state",
]


def seed_everything(seed: int) -> None:
    """Seed torch (CPU and CUDA), Python's ``random`` and numpy with ``seed``."""
    torch.manual_seed(seed)  # also seeds every CUDA device
    random.seed(seed)
    if np is not None:
        np.random.seed(seed % 2**32)


def use_deterministic_algorithms(device: torch.device) -> None:
    """``trainer.deterministic``: torch's deterministic kernels (an operation without one raises),
    and on CUDA what they need: cuBLAS's fixed workspace (set before its first use) and cuDNN's
    deterministic, non-benchmarking mode."""
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True)


def capture_rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """This process's generator states, as tensors and plain types."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
        "numpy": None,
        "cuda": None,
    }
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {
            "name": str(name),
            "keys": torch.from_numpy(keys.astype("int64")),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        }
    if device is not None and device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng_state(state: dict[str, Any], device: torch.device | None = None) -> None:
    """Put back what :func:`capture_rng_state` returned."""
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    if np is not None and state.get("numpy") is not None:
        n = state["numpy"]
        np.random.set_state((n["name"], n["keys"].numpy().astype("uint32"), n["pos"], n["has_gauss"], n["cached"]))
    if device is not None and device.type == "cuda" and state.get("cuda") is not None:
        torch.cuda.set_rng_state(state["cuda"], device)


@contextlib.contextmanager
def preserved_rng_state(device: torch.device | None = None) -> Iterator[None]:
    """Run a block without moving any generator: whatever it draws is put back afterwards.

    For work outside the training stream (a measurement, a probe), so that a run with it and a
    run without it, or a resumed run, draw the same numbers.
    """
    state = capture_rng_state(device)
    try:
        yield
    finally:
        restore_rng_state(state, device)
