"""``python -m ddptrain.export RUN_DIR --format safetensors|torch``: a run's weights, for use outside ddptrain.

Writes one checkpoint's model weights as a flat ``{name: tensor}`` file, with the keys of the
bare network (no ``module.`` DDP prefix): the recipe's model takes it with
``model.load_state_dict(weights, strict=True)``. Only the weights: no optimizer, config or code
(to rebuild the model inside ddptrain, use ``ddptrain.load_model``).

- ``--which latest`` (default: the newest valid checkpoint) or ``best`` (by ``trainer.checkpoint.monitor``);
  RUN_DIR may also be a checkpoint file or a ``checkpoints/`` directory.
- ``--ema``: the moving average of the weights (``trainer.ema.decay``) instead of the trained ones.
- ``--format torch``: ``torch.save`` of the dict; read it with ``torch.load(path, weights_only=True)``.
- ``--format safetensors``: read it with ``safetensors.torch.load_file(path)``; needs
  ``pip install 'ddptrain[export]'``. Its metadata (strings) holds ``step``, ``source_checkpoint``,
  ``trainer_class`` and ``ema``. Tensors that shared storage (tied weights) are stored as copies.
- Output: ``--out PATH``, default ``<RUN_DIR>/export/model[-ema].safetensors`` or ``.pt``; an
  existing file is replaced.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch

from .config import ConfigError
from .loading import find_checkpoint, model_weights
from .rundir import BEST_DIR, CHECKPOINTS_DIR
from .trainer.checkpoint import CheckpointError, load_checkpoint
from .trainer.checkpoint.dcp import is_dcp_checkpoint

__all__ = ["bare_weights", "export", "main"]

SUFFIXES = {"safetensors": ".safetensors", "torch": ".pt"}
DDP_PREFIX = "module."


def bare_weights(weights: dict[str, Any]) -> dict[str, Any]:
    """``weights`` without a leading ``module.`` when every key has one (a DDP-wrapped state dict).

    ddptrain's checkpoints already hold the bare module's state dict; this only guards the export."""
    if weights and all(key.startswith(DDP_PREFIX) for key in weights):
        return {key[len(DDP_PREFIX) :]: value for key, value in weights.items()}
    return dict(weights)


def default_output(source: str | Path, fmt: str, ema: bool) -> Path:
    """``<run dir>/export/model[-ema].<suffix>``; the run directory of a checkpoint file or of
    ``checkpoints/`` (``best/``) is the one above them."""
    path = Path(source).expanduser()
    path = path if path.is_dir() and not is_dcp_checkpoint(path) else path.parent  # a run, or a checkpoint in it
    if path.name == BEST_DIR and path.parent.name == CHECKPOINTS_DIR:
        path = path.parent
    if path.name == CHECKPOINTS_DIR:
        path = path.parent
    return path / "export" / f"model{'-ema' if ema else ''}{SUFFIXES[fmt]}"


def export(source: str | Path, fmt: str, which: str = "latest", ema: bool = False, out: str | Path | None = None):
    """Write the weights of ``source``'s checkpoint to ``out``; returns ``(out, checkpoint path, step)``.

    Raises:
        CheckpointError: no such run or checkpoint, or a corrupt one.
        ConfigError: ``ema`` and the run kept no EMA weights; ``safetensors`` not installed, or
            weights it cannot hold.
    """
    save_file = _safetensors_save_file() if fmt == "safetensors" else None  # before any reading
    path = find_checkpoint(source, which)
    checkpoint = load_checkpoint(path)
    weights = bare_weights(model_weights(checkpoint, path, ema))
    out = Path(out).expanduser() if out is not None else default_output(source, fmt, ema)
    out.parent.mkdir(parents=True, exist_ok=True)
    if save_file is None:
        torch.save(weights, out)
    else:
        others = sorted(k for k, v in weights.items() if not isinstance(v, torch.Tensor))
        if others:
            raise ConfigError(f"{path}: {others} are not tensors, which safetensors cannot hold: use --format torch")
        metadata = {
            "step": str(checkpoint["step"]),
            "source_checkpoint": str(path),
            "trainer_class": str(checkpoint.get("trainer_class")),
            "ema": str(ema).lower(),
        }
        # Copies: contiguous, and no two tensors share storage (safetensors refuses tied weights).
        save_file({k: v.detach().clone().contiguous() for k, v in weights.items()}, str(out), metadata=metadata)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(out, 0o666 & ~umask)  # a file others may read, as the shell makes one (safetensors wrote 0600)
    return out, path, checkpoint["step"]


def _safetensors_save_file():
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise ConfigError(
            "--format safetensors needs the safetensors package: pip install 'ddptrain[export]' "
            "(or write a torch file instead: --format torch)"
        ) from None
    return save_file


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ddptrain.export",
        description="Write a finished run's model weights, without any DDP prefix, for use outside ddptrain.",
    )
    parser.add_argument(
        "run_dir", metavar="RUN_DIR", help="a run directory (outputs/<recipe>/<date>) or a checkpoint file"
    )
    parser.add_argument(
        "--which", choices=["latest", "best"], default="latest", help="the checkpoint (default: latest)"
    )
    parser.add_argument("--ema", action="store_true", help="the EMA weights (trainer.ema.decay), not the trained ones")
    parser.add_argument("--format", choices=sorted(SUFFIXES), required=True, help="file format")
    parser.add_argument("--out", help="output file (default: <RUN_DIR>/export/model[-ema].safetensors or .pt)")
    args = parser.parse_args(argv)
    try:
        out, path, step = export(args.run_dir, args.format, args.which, args.ema, args.out)
    except (CheckpointError, ConfigError) as exc:
        print(f"ddptrain: error: {exc}", file=sys.stderr, flush=True)
        return 2
    print(f"exported {'EMA ' if args.ema else ''}weights to {out} from {path} (step {step})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
