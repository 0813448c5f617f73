"""Inference from a finished run: ``ddptrain.load_model(run_dir_or_checkpoint)``.

A checkpoint stores the run's configuration and the dotted name of its Trainer class, so the
model is rebuilt exactly as the run built it (``Trainer.configure_model``: the recipe's network,
``model.*`` settings included), then given the checkpoint's weights and put in eval mode::

    model = ddptrain.load_model("outputs/mnist/2026-12-01_10-00-00", which="best")
    with torch.no_grad():
        predictions = model(images).argmax(1)

The file is read with ``torch.load(weights_only=True)`` (no code from it runs) and verified
against its ``.sha256``. Plain ``torch.load(path, weights_only=True)`` works on it too: the
weights are under ``"model"``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from .config import Config, ConfigError
from .objects import locate
from .trainer.checkpoint import find_checkpoint, load_checkpoint, model_weights

__all__ = ["load_model", "find_checkpoint", "model_weights"]


def load_model(
    source: str | Path,
    which: str = "latest",
    trainer_class: type | str | None = None,
    map_location: Any = "cpu",
    ema: bool = False,
) -> nn.Module:
    """The user's model of a run, with a checkpoint's weights, in eval mode, for inference.

    Args:
        source: a run directory (e.g. ``outputs/mnist/<date>``), its ``checkpoints/`` or
            ``checkpoints/best``, or a checkpoint file.
        which: ``latest`` (the newest valid checkpoint) or ``best`` (by ``trainer.checkpoint.monitor``).
        trainer_class: the Trainer subclass whose ``configure_model`` builds the network (a class
            or a dotted path); default: the one that wrote the checkpoint.
        map_location: where the weights go (``"cpu"``, ``"cuda:0"``...).
        ema: the exponential moving average of the weights (``trainer.ema.decay``) instead of
            the trained weights.

    Raises:
        CheckpointError: no such checkpoint, or a corrupt one.
        ConfigError: the Trainer class cannot be imported here (pass ``trainer_class``), or
            ``ema=True`` and the run kept no EMA weights.
    """
    path = find_checkpoint(source, which)  # the one resolver of trainer.resume, trainer.init_from, test()
    checkpoint = load_checkpoint(path, map_location=map_location)
    cls = _trainer_class(trainer_class or checkpoint.get("trainer_class"), path)
    trainer = cls(Config.from_dict(checkpoint["config"]))
    model = trainer.configure_model()
    model.load_state_dict(model_weights(checkpoint, path, ema))
    return model.to(map_location).eval()


def _trainer_class(spec: type | str | None, path: Path) -> type:
    from .trainer import Trainer

    if isinstance(spec, type):
        return spec
    try:
        cls = locate(spec, "the checkpoint's trainer_class")
    except ConfigError as exc:
        raise ConfigError(
            f"{path} was written by Trainer class {spec!r}, which cannot be imported here ({exc}). "
            "Pass it: ddptrain.load_model(..., trainer_class=YourTrainer)."
        ) from None
    if not (isinstance(cls, type) and issubclass(cls, Trainer)):
        raise ConfigError(f"{path}: trainer_class {spec!r} is {cls!r}, not a ddptrain.Trainer subclass")
    return cls
