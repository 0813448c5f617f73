"""The Trainer: ddptrain's distributed training loop, made to be subclassed.

``fit`` reads top to bottom like nanoGPT's ``train.py``: find the ranks, seed per rank, build the
model inside our ``DistributedDataParallel``, build data and optimizer, resume if asked, then
epochs of steps with ``set_epoch``, gradient accumulation under ``no_sync()``, clipping, the
schedule, evaluation reduced exactly across ranks, and file I/O on rank 0 only.

Synchronisation points (every rank must reach them together, which the loop guarantees because
all ranks run the same number of steps): DDP's construction and every synchronised backward;
the logging all-reduce every ``trainer.log_every_steps`` steps and at the end of each epoch; one
all-reduce per evaluation; one all-gather per checkpoint (RNG states); a few small broadcasts at
start-up (output directory, resume path) and one all-gather at the end (parameter checksums).

Subclasses override any of: ``configure_model``, ``configure_optimizers``, ``train_dataset``,
``val_dataset``, ``training_step``, ``validation_step``, ``configure_callbacks`` and the class
method ``prepare_data`` (runs once, before workers start).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from .. import comm as dist
from ..comm.objects import all_gather_object, broadcast_object
from ..comm.ring import RingAllReducer
from ..comm.types import ReduceOp
from ..data import DistributedSampler, build_dataset
from ..ddp import DistributedDataParallel, ring_allreduce_hook
from ..launch.env import detect_environment
from ..launch.spawn import find_free_port
from .callbacks import Callback, CheckpointCallback, ProgressCallback, TensorBoardCallback
from .checkpoint_io import FORMAT_VERSION, CheckpointError, load_checkpoint, resolve_resume_path, save_checkpoint
from .config import Config, ConfigError, check_device, locate, per_rank_batch_size, resolve_backend
from .data import batch_size_of, make_batches, move_to, num_batches, preload
from .optim import build_optimizer, build_scheduler
from .rng import capture_rng_state, restore_rng_state, seed_everything

__all__ = ["Trainer", "TrainState", "SmokeCheckError", "check_world_size"]

log = logging.getLogger("ddptrain.trainer")


class SmokeCheckError(RuntimeError):
    """``trainer.smoke_check``: the loss did not fall, or the ranks' parameters differ."""


@dataclass
class TrainState:
    """Where training stands; saved in every checkpoint."""

    step: int = 0
    """Optimizer steps done (over the whole run, across resumes)."""
    epoch: int = 0
    """Current epoch, 0-based (after the last epoch it equals ``trainer.epochs``)."""
    samples_in_epoch: int = 0
    """This rank's training samples already consumed in the current epoch."""

    def position(self) -> tuple[int, int, int]:
        return (self.step, self.epoch, self.samples_in_epoch)


def check_world_size(saved: int, current: int, allow: bool, path: str | Path) -> None:
    """Refuse a checkpoint of another world size unless ``trainer.allow_world_size_change``."""
    if saved != current and not allow:
        raise CheckpointError(
            f"checkpoint {path} was written by a job of {saved} rank(s), but this job has {current}: "
            f"each rank's position in the epoch and its RNG state only continue exactly on the same "
            f"world size. Relaunch with dist.world_size={saved}, or set trainer.allow_world_size_change=true "
            f"to continue from the same global sample position (ranks beyond the saved ones get fresh "
            f"RNG seeds; at most {current - 1} sample(s) of the epoch are seen twice)."
        )


class _Window:
    """Training scalars accumulated between two logging points."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.loss_sum, self.steps, self.samples, self.comm_wait_s = 0.0, 0, 0, 0.0
        self.start = time.perf_counter()


class Trainer:
    """Distributed data-parallel training of one model; subclass it for your task.

    The defaults build the model from ``config.model['_target_']``, the datasets from
    ``config.data`` (``ddptrain.data.build_dataset``), SGD/Adam/AdamW from ``config.optimizer``,
    and train with cross-entropy. Run it on every rank (``python -m ddptrain`` does that), or
    call ``fit()`` in a process whose ranks come from torchrun/mpirun/srun, or inside an
    existing ``ddptrain.comm`` process group.

    Args:
        config: the run's configuration (default: ``Config()``).
        callbacks: extra callbacks, run after those of ``configure_callbacks``.

    Attributes (set by ``fit``): ``rank``, ``world_size``, ``local_rank``, ``device``,
    ``process_group``, ``model`` (the DDP wrapper; ``model.module`` is yours), ``optimizer``,
    ``scheduler``, ``train_sampler``, ``val_sampler``, ``batch_size`` (per rank per micro-batch),
    ``steps_per_epoch``, ``total_steps``, ``state`` (:class:`TrainState`), ``output_dir``.
    """

    def __init__(self, config: Config | None = None, callbacks: Sequence[Callback] = ()):
        self.config = config if config is not None else Config()
        self.extra_callbacks = list(callbacks)
        self.rank, self.world_size, self.local_rank = 0, 1, 0
        self.device = torch.device("cpu")
        self.process_group = None
        self.model: DistributedDataParallel | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler = None
        self.train_sampler: DistributedSampler | None = None
        self.val_sampler: DistributedSampler | None = None
        self.output_dir = Path(self.config.trainer.output_dir or os.getcwd())
        self.state = TrainState()
        self.callbacks: list[Callback] = []
        self.loss_history: list[tuple[int, float]] = []
        """``(step, train/loss)`` at every logging point of the current fit."""
        self.last_eval: dict[str, float] = {}
        self._reset()

    # == hooks for subclasses =====================================================================
    @classmethod
    def prepare_data(cls, config: Config) -> None:
        """Make the data available once, before any worker starts (locate, decompress, fail early).

        Runs in the launching process (or on every rank under an external launcher, so it must be
        safe to run concurrently). The default builds both splits of ``config.data.name``.
        """
        if config.data.name in ("mnist", "fashion_mnist"):
            for train in (True, False):
                build_dataset(config.data.name, config.data.root, train=train, download=config.data.download)

    def configure_model(self) -> nn.Module:
        """The model to train (on CPU; ``fit`` moves it). Default: ``config.model['_target_'](**rest)``."""
        spec = dict(self.config.model)
        target = spec.pop("_target_", None)
        if not target:
            raise ConfigError(
                "model._target_ is not set: choose a model (e.g. model=tutorial_net) or override "
                f"{type(self).__name__}.configure_model"
            )
        kwargs = {k: v for k, v in spec.items() if not k.startswith("_")}
        return locate(target, "model._target_")(**kwargs)

    def configure_optimizers(self, model: nn.Module):
        """An optimizer, or ``(optimizer, scheduler)`` with a scheduler stepped per optimizer step."""
        optimizer = build_optimizer(self.config.optimizer, model.parameters())
        return optimizer, build_scheduler(self.config.optimizer, optimizer, self.total_steps)

    def train_dataset(self) -> Dataset:
        """The training set (every rank builds all of it; the sampler picks this rank's share)."""
        return self._default_dataset(train=True)

    def val_dataset(self) -> Dataset | None:
        """The evaluation set, or ``None`` for no evaluation."""
        return self._default_dataset(train=False)

    def training_step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """The loss of one micro-batch (a scalar). ``model`` is the DDP wrapper: call it."""
        inputs, targets = batch
        return F.cross_entropy(model(inputs), targets)

    def validation_step(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        """Per-sample metrics of one batch: ``{name: tensor of shape [batch]}``.

        The Trainer drops padding duplicates and averages each metric over exactly the whole
        validation set across ranks. ``model`` is the bare module, in eval mode, under no_grad.
        """
        inputs, targets = batch
        logits = model(inputs)
        return {
            "loss": F.cross_entropy(logits, targets, reduction="none"),
            "accuracy": (logits.argmax(dim=1) == targets).float(),
        }

    def configure_callbacks(self) -> list[Callback]:
        """The built-in callbacks the config asks for: progress, TensorBoard, checkpoints."""
        t = self.config.trainer
        callbacks: list[Callback] = [ProgressCallback(bar=None if t.progress else False)]
        if t.tensorboard:
            callbacks.append(TensorBoardCallback())
        if t.checkpoint_every_epochs or t.checkpoint_every_steps or t.checkpoint_at_end:
            callbacks.append(
                CheckpointCallback(
                    every_epochs=t.checkpoint_every_epochs,
                    every_steps=t.checkpoint_every_steps,
                    at_end=t.checkpoint_at_end,
                    keep_last=t.keep_last_checkpoints,
                )
            )
        return callbacks

    # == the loop =================================================================================
    def fit(self) -> dict[str, Any]:
        """Train to the end (epochs, ``max_steps`` or ``stop_after_steps``); the final metrics on every rank."""
        cfg = self.config
        fit_start = time.perf_counter()
        self._reset()  # a Trainer may fit more than once
        owns_group = self.setup_distributed()  # ranks: launcher env, or an existing group
        try:
            seed_everything(cfg.trainer.seed + self.rank)  # per-rank seed (dropout); DDP syncs weights
            self.output_dir = self._agree_on_output_dir()  # rank 0's choice, on every rank
            self.model = DistributedDataParallel(
                self.configure_model().to(self.device),
                process_group=self.process_group,
                bucket_cap_mb=cfg.dist.bucket_cap_mb,
                broadcast_buffers=cfg.dist.broadcast_buffers,
                find_unused_parameters=cfg.dist.find_unused_parameters,
                gradient_as_bucket_view=cfg.dist.gradient_as_bucket_view,
            )
            if cfg.dist.algorithm == "ring":
                self.model.register_comm_hook(RingAllReducer(self.process_group), ring_allreduce_hook)
            self._setup_data()  # datasets, samplers, batch sizes, step counts
            self.optimizer, self.scheduler = self._optimizers()
            self.callbacks = [*self.configure_callbacks(), *self.extra_callbacks]
            resume = cfg.trainer.resume or self._elastic_restart_resume()
            if resume:
                self.resume(resume)  # weights, optimizer, sampler, step, RNG
            self._call("on_fit_start")
            metrics: dict[str, Any] = {}
            while self.state.epoch < cfg.trainer.epochs and not self.should_stop():
                epoch = self.state.epoch
                self.train_sampler.set_epoch(epoch)  # new shuffle per epoch; keeps a resumed position
                self._call("on_epoch_start", epoch)
                metrics = {"epoch": epoch + 1}
                finished = self.train_epoch(metrics)
                if not finished:
                    break  # stopped mid-epoch (max_steps / stop_after_steps)
                self.state.epoch, self.state.samples_in_epoch = epoch + 1, 0
                self.train_sampler.set_epoch(epoch + 1)  # a checkpoint now resumes at the next epoch's start
                if cfg.trainer.eval_every_epochs and (epoch + 1) % cfg.trainer.eval_every_epochs == 0:
                    metrics.update(self.evaluate())  # exact over the validation set, all ranks
                self._call("on_epoch_end", epoch, metrics)
            final = self._final_metrics(fit_start)
            self._call("on_fit_end", final)
            if cfg.trainer.smoke_check:
                self._smoke_check(final)
            return final
        except BaseException as exc:
            for callback in self.callbacks:
                with contextlib.suppress(Exception):  # never hide the original error
                    callback.on_exception(self, exc)
            raise
        finally:
            if owns_group:
                dist.destroy_process_group()

    def train_epoch(self, metrics: dict[str, Any]) -> bool:
        """Run the rest of the current epoch; False if training must stop before its end."""
        accum = self.config.trainer.grad_accum_steps
        clip = self.config.trainer.grad_clip_norm
        remaining = len(self.train_sampler) - self.state.samples_in_epoch
        micro_total = num_batches(max(0, remaining), self.batch_size)
        epoch_loss, epoch_steps, step_loss, step_samples = 0.0, 0, 0.0, 0
        started = time.perf_counter()
        self.model.train()
        for i, batch in enumerate(self.train_batches()):
            group_start = i - i % accum
            group_size = min(accum, micro_total - group_start)  # a short last group at the epoch's end
            sync = i - group_start == group_size - 1
            batch = move_to(batch, self.device, non_blocking=True)
            with contextlib.nullcontext() if sync else self.model.no_sync():
                loss = self.training_step(self.model, batch)
                (loss / group_size).backward()
            step_loss += loss.item() / group_size
            step_samples += batch_size_of(batch)
            self.state.samples_in_epoch += batch_size_of(batch)
            if not sync:
                continue
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
            self.optimizer.step()
            if self.scheduler is not None:
                self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.state.step += 1
            epoch_loss, epoch_steps = epoch_loss + step_loss, epoch_steps + 1
            self._record_step(step_loss, step_samples)
            step_loss, step_samples = 0.0, 0
            every = self.config.trainer.check_sync_every_n_steps
            if every and self.state.step % every == 0:
                self.model.check_parameters_in_sync()  # collective: every rank reaches this step
            if self.should_stop():
                break
        self._times["train_s"] += time.perf_counter() - started
        totals = self._all_reduce_sum([epoch_loss, epoch_steps])
        if totals[1] > 0:
            metrics["train/epoch_loss"] = totals[0] / totals[1]
        return self.state.samples_in_epoch >= len(self.train_sampler)

    @staticmethod
    def _elastic_restart_resume() -> str | None:
        """Under ``torchrun --max-restarts``, a restarted worker resumes from the run's last checkpoint.

        torchrun restarts every worker with the same arguments and counts restarts in
        ``TORCHELASTIC_RESTART_COUNT``; a fixed ``hydra.run.dir`` makes the restart find the
        checkpoints of the attempt that failed.
        """
        if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
            log.info(
                "torchrun restart %s: resuming from the latest checkpoint", os.environ["TORCHELASTIC_RESTART_COUNT"]
            )
            return "latest"
        return None

    def should_stop(self) -> bool:
        """Whether ``trainer.max_steps`` or ``trainer.stop_after_steps`` is reached."""
        t = self.config.trainer
        return any(limit is not None and self.state.step >= limit for limit in (t.max_steps, t.stop_after_steps))

    def evaluate(self) -> dict[str, float]:
        """Metrics of ``validation_step`` averaged over exactly the validation set, on every rank.

        The sampler pads ranks with duplicates so all take the same number of batches; those
        positions are masked out, so each sample counts exactly once.
        """
        if self.val_set is None:
            return {}
        started = time.perf_counter()
        module = self.model.module
        was_training = module.training
        module.eval()
        padding = self.val_sampler.padding_mask()
        sums: dict[str, float] = {}
        position = 0
        with torch.no_grad():
            for batch in make_batches(
                self.val_set,
                self.val_sampler,
                self.config.data.eval_batch_size,
                self.config.data.num_workers,
                self.device.type == "cuda",
            ):
                n = batch_size_of(batch)
                keep = (~padding[position : position + n]).to(torch.float64)
                position += n
                for name, values in self.validation_step(module, move_to(batch, self.device)).items():
                    values = values.detach().reshape(-1).to("cpu", torch.float64)
                    if len(values) != n:
                        raise ValueError(
                            f"validation_step returned {len(values)} value(s) for metric {name!r} on a "
                            f"batch of {n}: return one value per sample (reduction='none')"
                        )
                    sums[name] = sums.get(name, 0.0) + float((values * keep).sum())
                sums[" count"] = sums.get(" count", 0.0) + float(keep.sum())
        module.train(was_training)
        names = sorted(sums)  # the same keys in the same order on every rank
        totals = self._all_reduce_sum([sums[k] for k in names])
        count = totals[names.index(" count")]
        metrics = {f"eval/{k}": totals[i] / count for i, k in enumerate(names) if k != " count"}
        metrics["eval/samples"] = int(round(count))
        self.last_eval, self._last_eval_step = metrics, self.state.step
        self._times["eval_s"] += time.perf_counter() - started
        self._call("on_validation_end", metrics)
        return metrics

    # == checkpoints ==============================================================================
    @property
    def checkpoint_dir(self) -> Path:
        return self.output_dir / "checkpoints"

    def checkpoint_state(self) -> dict[str, Any]:
        """Everything needed to continue exactly. Collective: gathers every rank's RNG states."""
        rng_states = all_gather_object(self.process_group, capture_rng_state(self.device))
        self.train_sampler.set_consumed(self.state.samples_in_epoch)  # trained-on, not fetched-ahead
        cls = type(self)
        return {
            "format_version": FORMAT_VERSION,
            "step": self.state.step,
            "epoch": self.state.epoch,
            "samples_in_epoch": self.state.samples_in_epoch,
            "world_size": self.world_size,
            "model": self.model.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "sampler": self.train_sampler.state_dict(),
            "rng": rng_states,
            "metrics": {k: float(v) for k, v in self.last_eval.items()},
            "loss_history": [[step, float(loss)] for step, loss in self.loss_history],
            "config": self.config.to_dict(),
            "trainer_class": f"{cls.__module__}.{cls.__qualname__}",
        }

    def save_checkpoint(self, path: str | Path) -> Path:
        """Write a checkpoint (collective; rank 0 writes, atomically). Returns ``path``."""
        state = self.checkpoint_state()
        path = Path(path)
        if self.is_main:
            save_checkpoint(path, state)
            log.info("checkpoint saved: %s (step %d)", path, self.state.step)
        return path

    def resume(self, resume: str) -> bool:
        """Continue from ``trainer.resume`` (a file, a directory, or ``latest``); False if nothing to resume."""
        if self.is_main:
            try:
                found, error = resolve_resume_path(resume, self.checkpoint_dir), None
            except CheckpointError as exc:
                found, error = None, str(exc)
            choice = (None if found is None else str(found), error)
        else:
            choice = None
        path, error = broadcast_object(self.process_group, choice, 0)  # every rank agrees, or fails together
        if error:
            raise CheckpointError(error)
        if path is None:
            if self.is_main:
                log.warning(
                    "trainer.resume=latest: no checkpoint in %s yet; starting from scratch", self.checkpoint_dir
                )
            return False
        self.load_checkpoint_state(load_checkpoint(path), path)
        if self.is_main:
            log.info("resumed from %s: step %d, epoch %d", path, self.state.step, self.state.epoch + 1)
        return True

    def load_checkpoint_state(self, ckpt: dict[str, Any], path: str | Path = "<checkpoint>") -> None:
        """Restore weights, optimizer, schedule, sampler position, step and this rank's RNG."""
        allow = self.config.trainer.allow_world_size_change
        check_world_size(ckpt["world_size"], self.world_size, allow, path)
        self.model.module.load_state_dict(ckpt["model"])
        self.optimizer.load_state_dict(ckpt["optimizer"])
        if self.scheduler is not None and ckpt.get("scheduler") is not None:
            self.scheduler.load_state_dict(ckpt["scheduler"])
        self.train_sampler.load_state_dict(ckpt["sampler"], allow_world_size_change=allow)
        same_epoch = self.train_sampler.epoch == ckpt["epoch"]
        self.state = TrainState(
            step=ckpt["step"], epoch=ckpt["epoch"], samples_in_epoch=self.train_sampler.consumed if same_epoch else 0
        )
        self.last_eval = dict(ckpt.get("metrics") or {})
        # the logged losses so far: a resumed run reports the run's first loss, not its own
        self.loss_history = [(int(step), float(loss)) for step, loss in ckpt.get("loss_history") or []]
        self._last_eval_step = ckpt["step"] if self.last_eval else -1
        if self.rank < len(ckpt["rng"]):
            restore_rng_state(ckpt["rng"][self.rank], self.device)  # last: nothing may draw after it
        else:
            seed_everything(self.config.trainer.seed + self.rank + 1_000_003 * ckpt["step"])

    # == helpers ==================================================================================
    def _reset(self) -> None:
        self.state = TrainState()
        self.callbacks, self.loss_history, self.last_eval = [], [], {}
        self._last_eval_step = -1
        self._window = _Window()
        self._times = {"train_s": 0.0, "eval_s": 0.0}

    @property
    def is_main(self) -> bool:
        """True on rank 0, the rank that writes files and prints."""
        return self.rank == 0

    @property
    def steps_done_in_epoch(self) -> int:
        return num_batches(self.state.samples_in_epoch, self.batch_size) // self.config.trainer.grad_accum_steps

    def setup_distributed(self) -> bool:
        """Join the job's process group (unless one exists); pick the device and thread count.

        Returns:
            True if this call created the group (``fit`` then destroys it at the end).
        """
        cfg = self.config
        env = detect_environment()
        self.local_rank = env.local_rank
        if cfg.trainer.device == "cuda":
            check_device(cfg, env.local_world_size)
            self.device = torch.device("cuda", env.local_rank)
            torch.cuda.set_device(self.device)  # before NCCL starts: one GPU per rank
        else:
            check_device(cfg)
            self.device = torch.device("cpu")
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        torch.set_num_threads(cfg.dist.threads_per_worker or max(1, cores // env.local_world_size))
        owns = not dist.is_initialized()
        if owns:
            backend = resolve_backend(cfg, env.name, env.master_addr)
            timeout, init_timeout = cfg.dist.timeout_s, cfg.dist.init_timeout_s
            if not env.is_launched_externally():
                # A plain `python script.py`: a job of one, so the same code runs unchanged.
                dist.init_process_group(
                    backend, f"tcp://127.0.0.1:{find_free_port()}", timeout, 1, 0, init_timeout=init_timeout
                )
            elif backend == "mpi":
                dist.init_process_group("mpi", timeout=timeout)
            elif env.name == "torchrun":
                # env://, not tcp://: under torchrun the agent already serves the store on
                # MASTER_PORT and the comm layer joins it as a client (TORCHELASTIC_USE_AGENT_STORE).
                dist.init_process_group(backend, "env://", timeout, init_timeout=init_timeout)
            elif env.master_addr is None or env.master_port is None:
                raise ConfigError(
                    f"the {env.name} launcher gave no rendezvous address: set MASTER_ADDR and "
                    "MASTER_PORT for every rank (mpirun -x MASTER_ADDR=<host of rank 0> -x "
                    "MASTER_PORT=29500), or use dist.backend=mpi"
                )
            else:
                dist.init_process_group(
                    backend,
                    f"tcp://{env.master_addr}:{env.master_port}",
                    timeout,
                    env.world_size,
                    env.rank,
                    init_timeout=init_timeout,
                )
        self.process_group = dist.get_process_group()
        self.rank, self.world_size = self.process_group.rank(), self.process_group.size()
        return owns

    def _agree_on_output_dir(self) -> Path:
        mine = str(Path(self.config.trainer.output_dir or os.getcwd()).resolve())
        chosen = Path(broadcast_object(self.process_group, mine, 0))
        if self.is_main:
            chosen.mkdir(parents=True, exist_ok=True)
        return chosen

    def _default_dataset(self, train: bool) -> Dataset:
        d = self.config.data
        extra = {}
        if d.name == "synthetic":
            extra = {"num_samples": d.num_train_samples if train else d.num_val_samples}
        dataset = build_dataset(d.name, d.root, train=train, download=d.download, **extra)
        return preload(dataset) if d.preload else dataset

    def _setup_data(self) -> None:
        cfg = self.config
        self.batch_size = per_rank_batch_size(cfg, self.world_size)
        self.train_set = self.train_dataset()
        self.val_set = self.val_dataset()
        self.train_sampler = DistributedSampler(
            self.train_set,
            self.world_size,
            self.rank,
            shuffle=True,
            seed=cfg.trainer.seed,
            drop_last=cfg.data.drop_last,
        )
        self.val_sampler = (
            None
            if self.val_set is None
            else DistributedSampler(self.val_set, self.world_size, self.rank, shuffle=False)
        )
        micro = num_batches(len(self.train_sampler), self.batch_size)
        self.steps_per_epoch = num_batches(micro, cfg.trainer.grad_accum_steps)
        self.total_steps = self.steps_per_epoch * cfg.trainer.epochs
        if cfg.trainer.max_steps is not None:
            self.total_steps = min(self.total_steps, cfg.trainer.max_steps)

    def train_batches(self):
        """The rest of this epoch's micro-batches for this rank (``iter`` once per epoch)."""
        return make_batches(
            self.train_set,
            self.train_sampler,
            self.batch_size,
            self.config.data.num_workers,
            self.device.type == "cuda",
            seed=self.config.trainer.seed + self.rank,
        )

    def _optimizers(self):
        result = self.configure_optimizers(self.model.module)
        if isinstance(result, (tuple, list)):
            optimizer, scheduler = result
        else:
            optimizer, scheduler = result, None
        return optimizer, scheduler

    def _call(self, hook: str, *args: Any) -> None:
        for callback in self.callbacks:
            getattr(callback, hook)(self, *args)

    def _all_reduce_sum(self, values: Sequence[float]) -> list[float]:
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.process_group.device)
        self.process_group.all_reduce(t, ReduceOp.SUM).wait()
        return t.cpu().tolist()

    def _record_step(self, loss: float, samples: int) -> None:
        w = self._window
        w.loss_sum, w.steps, w.samples = w.loss_sum + loss, w.steps + 1, w.samples + samples
        stats = self.model.last_iteration_stats
        if stats is not None:
            w.comm_wait_s += stats.finalize_wait_s
        self._call("on_train_batch_end", loss)
        if self.state.step % self.config.trainer.log_every_steps == 0:
            self._log_window()

    def _log_window(self) -> None:
        """Reduce the window's scalars over ranks and hand them to the callbacks (collective)."""
        w = self._window
        loss_sum, steps, samples = self._all_reduce_sum([w.loss_sum, w.steps, w.samples])
        elapsed = max(time.perf_counter() - w.start, 1e-9)
        scalars = {
            "train/loss": loss_sum / max(steps, 1),
            "train/lr": float(self.optimizer.param_groups[0]["lr"]),
            "train/samples_per_s": samples / elapsed,
            "train/comm_wait_s": w.comm_wait_s / max(w.steps, 1),
        }
        self.loss_history.append((self.state.step, scalars["train/loss"]))
        w.reset()
        self._call("on_log", scalars)

    def _parameters_digest(self) -> str:
        digest = hashlib.sha256()
        for name, tensor in self.model.module.state_dict().items():
            digest.update(name.encode())
            digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()

    def _final_metrics(self, fit_start: float) -> dict[str, Any]:
        if self._window.steps:
            self._log_window()
        if self.val_set is not None and self._last_eval_step != self.state.step:
            self.evaluate()
        digests = all_gather_object(self.process_group, self._parameters_digest())
        final: dict[str, Any] = {"step": self.state.step, "epoch": self.state.epoch, "world_size": self.world_size}
        final.update(self.last_eval)
        if self.loss_history:
            final["train/loss_first"] = self.loss_history[0][1]
            final["train/loss_last"] = self.loss_history[-1][1]
        final["time/train_s"] = self._times["train_s"]
        final["time/eval_s"] = self._times["eval_s"]
        final["time/fit_s"] = time.perf_counter() - fit_start
        final["params_sha256"] = digests[0]
        final["params_agree"] = all(d == digests[0] for d in digests)
        if self.is_main:
            (self.output_dir / "metrics.json").write_text(json.dumps(final, indent=2) + "\n")
        return final

    def _smoke_check(self, final: dict[str, Any]) -> None:
        problems = []
        if not final["params_agree"]:
            problems.append("the parameters differ between ranks (checksums all-gathered at the end)")
        first, last = final.get("train/loss_first"), final.get("train/loss_last")
        if first is None or len(self.loss_history) < 2:
            problems.append(
                f"fewer than two logged losses ({len(self.loss_history)}); run more steps than "
                f"trainer.log_every_steps={self.config.trainer.log_every_steps}"
            )
        elif not last < first:
            problems.append(
                f"the training loss did not fall: {first:.4f} at step {self.loss_history[0][0]} -> "
                f"{last:.4f} at step {self.loss_history[-1][0]}"
            )
        if problems:
            raise SmokeCheckError("smoke check failed: " + "; ".join(problems))
        if self.is_main:
            log.info(
                "smoke check passed: loss %.4f -> %.4f, parameters identical on %d rank(s)",
                first,
                last,
                self.world_size,
            )
