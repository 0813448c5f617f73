"""What ``Trainer.fit`` builds before its first step: its place in the job, this rank's seed
and precision, the run directory, the model inside our DDP, the datasets of the data hooks.

Functions here take the trainer's parts and return what it stores; they hold no state.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from ..comm.objects import broadcast_object
from ..comm.process_group import ProcessGroup
from ..comm.ring import RingAllReducer
from ..config import DEFAULT_BUCKET_CAP_MB, Config, ConfigError, DistConfig
from ..ddp import DistributedDataParallel, ring_allreduce_hook
from ..ddp.comm_hooks import COMPRESSIONS
from ..launch.env import detect_environment
from ..launch.join import Membership, RendezvousError, join_process_group
from ..logs import setup_logging
from ..preflight import check_device, resolve_backend
from .callbacks import Callback
from .data import limit_datasets
from .dataloaders import resolve_data_hooks
from .precision import Precision
from .rng import seed_everything, use_deterministic_algorithms
from .summary import model_summary

__all__ = [
    "join_job",
    "prepare_rank",
    "agree_on_directory",
    "ddp_options",
    "wrap_model",
    "build_model",
    "FitData",
    "load_data",
    "check_plugins_served",
]

log = logging.getLogger("ddptrain.trainer")


def join_job(config: Config) -> Membership:
    """Join the job's process group (unless one exists); pick the device and thread count."""
    env = detect_environment()
    check_device(config, env.local_world_size)
    try:
        membership = join_process_group(
            resolve_backend(config, env.name, env.master_addr),
            device_type=config.trainer.device,
            timeout_s=config.dist.timeout_s,
            init_timeout_s=config.dist.init_timeout_s,
            threads_per_worker=config.dist.threads_per_worker or None,
            environment=env,
        )
    except RendezvousError as exc:
        raise ConfigError(str(exc)) from None
    if membership.created and not any(getattr(h, "_ddptrain", False) for h in logging.getLogger("ddptrain").handlers):
        _announce_script_mode(config, membership)
    return membership


def _announce_script_mode(config: Config, membership: Membership) -> None:
    """``fit()`` called from a script of one's own (the CLI and ``ddptrain.run`` set logging up
    before any rank starts): the console gets the run's lines unless the script set up logging
    itself, and a script alone, which starts no workers, says that it trains in one process."""
    if not logging.getLogger("ddptrain").handlers and not logging.getLogger().handlers:
        setup_logging(membership.rank)
    if membership.world_size == 1:
        say = log.warning if config.dist.world_size > 1 else log.info
        say(
            "fit() from a script trains in this process alone (world size 1): it starts no workers. "
            "For dist.world_size=%d ranks run python -m ddptrain (or ddptrain.run(config)), or start the "
            "script under torchrun.",
            config.dist.world_size,
        )


def agree_on_directory(process_group: ProcessGroup, mine: str) -> Path:
    """Rank 0's choice of directory, on every rank (collective); rank 0 creates it."""
    chosen = Path(broadcast_object(process_group, str(Path(mine).resolve()), 0))
    if process_group.rank() == 0:
        chosen.mkdir(parents=True, exist_ok=True)
    return chosen


def ddp_options(dist: DistConfig) -> dict[str, Any]:
    """The keyword arguments of ``DistributedDataParallel`` that the ``dist.*`` settings choose."""
    return {
        "bucket_cap_mb": DEFAULT_BUCKET_CAP_MB if dist.bucket_cap_mb == "auto" else float(dist.bucket_cap_mb),
        # local_sgd/diloco: no collective per forward; buffers are averaged at each outer step
        "broadcast_buffers": dist.broadcast_buffers and dist.sync == "every_step",
        "find_unused_parameters": dist.find_unused_parameters,
        "gradient_as_bucket_view": dist.gradient_as_bucket_view,
    }


def wrap_model(module: nn.Module, config: Config, process_group: ProcessGroup) -> DistributedDataParallel:
    """``module`` (already on its device, compiled in place under ``trainer.compile``) in our DDP,
    with the ring comm hook if ``dist.algorithm=ring``
    or the compression hook of ``dist.grad_compression`` (under ZeRO the step strategy
    reduce-scatters the buckets, over the ring and compressed as asked, instead)."""
    dist = config.dist
    if config.trainer.compile:
        module.compile()  # in place: forward is compiled, parameters and state dict keys stay the module's
        log.info("model compiled with torch.compile (trainer.compile); the first steps include the compilation")
    model = DistributedDataParallel(module, process_group=process_group, **ddp_options(dist))
    if dist.zero_stage:
        return model
    if dist.algorithm == "ring":
        model.register_comm_hook(RingAllReducer(process_group), ring_allreduce_hook)
    elif dist.grad_compression != "none":
        model.register_comm_hook(process_group, COMPRESSIONS[dist.grad_compression][1])
        log.info("gradients travel in %s (dist.grad_compression)", dist.grad_compression)
    return model


_PLUGGED_KEYS = {
    "trainer.doctor": lambda cfg: cfg.trainer.doctor,
    "trainer.lr_find": lambda cfg: cfg.trainer.lr_find,
    "dist.bucket_cap_mb=auto": lambda cfg: cfg.dist.bucket_cap_mb == "auto",
}
"""Config keys whose work a plug-in callback does (``Callback.implements``); the runner adds them."""


def check_plugins_served(config: Config, callbacks: Sequence[Callback], trainer_name: str) -> None:
    """Refuse a config that asks for a plug-in (``trainer.doctor``...) none of ``callbacks`` implements."""
    served = {key for callback in callbacks for key in getattr(callback, "implements", ())}
    missing = [key for key, asked in _PLUGGED_KEYS.items() if asked(config) and key not in served]
    if missing:
        raise ConfigError(
            f"{' and '.join(missing)}: plug-in callbacks do that; ddptrain.run and the command line add "
            f"them. Calling fit() yourself, pass them: {trainer_name}(config, "
            "callbacks=ddptrain.plugin_callbacks(config))"
        )


def prepare_rank(config: Config, device: torch.device, rank: int) -> Precision:
    """This rank's determinism (``trainer.deterministic``) and seed (``trainer.seed + rank``: the
    dropout masks differ per rank, DDP makes the weights equal), and its precision policy
    (autocast, the gradient scaler), before anything random is built."""
    if config.trainer.deterministic:
        use_deterministic_algorithms(device)
    seed_everything(config.trainer.seed + rank)
    return Precision(config.trainer.precision, device)


def build_model(
    module: nn.Module, config: Config, device: torch.device, process_group: ProcessGroup, is_main: bool
) -> DistributedDataParallel:
    """``module`` on ``device``, in our DDP (:func:`wrap_model`); rank 0 logs its summary
    (``trainer.model_summary``), one record per line so that every line of train.log keeps its prefix."""
    model = wrap_model(module.to(device), config, process_group)
    if config.trainer.model_summary and is_main:
        for line in ["model summary:", *model_summary(model.module).splitlines()]:
            log.info("%s", line)
    return model


@dataclass(frozen=True)
class FitData:
    """The datasets of the data hooks, as a fit trains and validates on them."""

    train_set: Dataset
    train_options: Any
    """What a ``train_dataloader`` DataLoader asked for (collate_fn, workers...), or None."""
    val_set: Dataset | None
    val_options: Any
    val_batch_size: int


def load_data(train: Any, val: Any, config: Config, world_size: int) -> FitData:
    """What ``train_dataloader()`` and ``val_dataloader()`` returned (``train``, ``val``), taken
    apart (:mod:`.dataloaders`) and cut by ``trainer.overfit_batches`` / ``limit_val_batches``
    (counted in batches per rank of ``world_size`` ranks)."""
    train_parts, val_parts = resolve_data_hooks(train, val, config, world_size)
    val_batch_size = val_parts.batch_size or config.data.eval_batch_size
    train_set, val_set = limit_datasets(config, train_parts.dataset, val_parts.dataset, world_size, val_batch_size)
    return FitData(train_set, train_parts.options, val_set, val_parts.options, val_batch_size)
