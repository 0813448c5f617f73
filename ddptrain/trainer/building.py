"""What ``Trainer.fit`` builds before its first step: its place in the job, the run directory,
the model inside our DDP, and the end of a fit (final metrics, ``metrics.json``, smoke check).

Functions here take the trainer (or its parts) and return what it stores; they hold no state.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from torch import nn

from ..comm.objects import broadcast_object
from ..comm.process_group import ProcessGroup
from ..comm.ring import RingAllReducer
from ..config import Config, ConfigError, check_device, resolve_backend
from ..ddp import DistributedDataParallel, ring_allreduce_hook
from ..launch.env import detect_environment
from ..launch.join import Membership, RendezvousError, join_process_group
from .stopping import checkpoint_now

__all__ = ["join_job", "agree_on_directory", "wrap_model", "finish_fit"]

log = logging.getLogger("ddptrain.trainer")


def join_job(config: Config) -> Membership:
    """Join the job's process group (unless one exists); pick the device and thread count."""
    env = detect_environment()
    check_device(config, env.local_world_size)
    try:
        return join_process_group(
            resolve_backend(config, env.name, env.master_addr),
            device_type=config.trainer.device,
            timeout_s=config.dist.timeout_s,
            init_timeout_s=config.dist.init_timeout_s,
            threads_per_worker=config.dist.threads_per_worker or None,
            environment=env,
        )
    except RendezvousError as exc:
        raise ConfigError(str(exc)) from None


def agree_on_directory(process_group: ProcessGroup, mine: str) -> Path:
    """Rank 0's choice of directory, on every rank (collective); rank 0 creates it."""
    chosen = Path(broadcast_object(process_group, str(Path(mine).resolve()), 0))
    if process_group.rank() == 0:
        chosen.mkdir(parents=True, exist_ok=True)
    return chosen


def wrap_model(module: nn.Module, config: Config, process_group: ProcessGroup) -> DistributedDataParallel:
    """``module`` (already on its device) in our DDP, with the ring comm hook if ``dist.algorithm=ring``."""
    model = DistributedDataParallel(module, process_group=process_group, **config.dist.ddp_options())
    if config.dist.algorithm == "ring":
        model.register_comm_hook(RingAllReducer(process_group), ring_allreduce_hook)
    return model


def finish_fit(trainer: Any, fit_s: float) -> dict[str, Any]:
    """The end of a fit (collective): the last logging window, the final evaluation, the final
    metrics (written to ``metrics.json`` on rank 0), ``on_fit_end`` and the smoke check.

    After a signal (``trainer.stopped_by``) there is no final evaluation and a checkpoint of the
    current step is written.
    """
    trainer._stop.finish()  # the last stop request, posted after the last step (collective)
    if trainer.metrics.window.steps:
        trainer._call("on_log", trainer._reduce_window())
    stopped = trainer.stopped_by is not None  # by a signal: no evaluation, a checkpoint now
    if not stopped and trainer.val_set is not None:
        trainer._evaluate_once()
    step, epoch, module = trainer.state.step, trainer.state.epoch, trainer.model.module
    trainer.model.sync_buffers()  # the digest is of the model rank 0 checkpoints, on every rank
    final = trainer.metrics.final(module, step=step, epoch=epoch, fit_s=fit_s)  # collective
    if stopped:
        final.update(stopped_by=trainer.stopped_by, checkpoint=str(checkpoint_now(trainer, trainer.callbacks)))
    final["stopped_early"] = trainer.stopped_early
    if trainer.is_main:
        (trainer.output_dir / "metrics.json").write_text(json.dumps(final, indent=2) + "\n")
    trainer._call("on_fit_end", final)
    if trainer.smoke_probe is not None and not stopped:
        passed = trainer.smoke_probe.check(trainer.metrics, module, final)
        if trainer.is_main:
            log.info(passed)
    return final
