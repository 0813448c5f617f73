"""Callbacks: the interface and the three built-ins (checkpoints, TensorBoard, progress)."""

from .base import Callback
from .checkpoint import CheckpointCallback
from .progress import ProgressCallback
from .tensorboard import TensorBoardCallback

__all__ = ["Callback", "CheckpointCallback", "ProgressCallback", "TensorBoardCallback"]
