"""Checkpoints, in one place. Open :mod:`.checkpointer` first.

- :mod:`.checkpointer`: the :class:`Checkpointer`, the one owner of a fit's checkpoints: what a
  checkpoint holds, the step checkpoint (named, written, verified, pruned), the one taken at a
  stop signal, the best ones, resuming and ``trainer.init_from``; the world-size rule
  (:func:`check_world_size`), restarts, and the launcher's early check (:func:`preflight_resume`).
- :mod:`.resolve`: which file ``latest`` / ``auto`` / ``best`` / a directory / a file means, for
  the Checkpointer, the launcher and ``ddptrain.load_model`` alike.
- :mod:`.files`: one checkpoint file on disk: its name, the atomic write with its SHA-256, the
  verified load, listing and pruning a directory of them (of either format).
- :mod:`.dcp`: ``trainer.checkpoint.format=dcp``: a checkpoint directory in torch's distributed
  format, each rank writing its part; read back as the same dict a ``.pt`` file holds.
- :mod:`.background`: ``trainer.checkpoint.async_save``: the host snapshot and the writer thread.

The run directory's layout (``checkpoints/``, ``checkpoints/best/``) is :class:`ddptrain.rundir.RunDir`'s.
The callbacks decide only *when* to save (:class:`~ddptrain.trainer.CheckpointCallback`,
:class:`~ddptrain.trainer.BestCheckpoints`).
"""

from .checkpointer import (
    Checkpointer,
    TrainState,
    check_world_size,
    elastic_restart_resume,
    preflight_resume,
    resume_after_restart,
)
from .files import (
    FORMAT_VERSION,
    CheckpointError,
    CheckpointWarning,
    NothingToResumeError,
    checkpoint_name,
    list_checkpoints,
    load_checkpoint,
    model_weights,
    prune_checkpoints,
    save_checkpoint,
)
from .resolve import (
    agree_on_checkpoint,
    best_checkpoint,
    find_checkpoint,
    latest_valid_checkpoint,
    resolve_checkpoint,
)

__all__ = [
    "Checkpointer",
    "TrainState",
    "check_world_size",
    "elastic_restart_resume",
    "preflight_resume",
    "resume_after_restart",
    "FORMAT_VERSION",
    "CheckpointError",
    "CheckpointWarning",
    "NothingToResumeError",
    "checkpoint_name",
    "list_checkpoints",
    "load_checkpoint",
    "model_weights",
    "prune_checkpoints",
    "save_checkpoint",
    "agree_on_checkpoint",
    "best_checkpoint",
    "find_checkpoint",
    "latest_valid_checkpoint",
    "resolve_checkpoint",
]
