"""The Trainer: ddptrain's distributed training loop, made to be subclassed.

``fit`` reads top to bottom like nanoGPT's ``train.py``: join the job's process group, seed per
rank, build the model inside our ``DistributedDataParallel``, data and optimizer, resume if
asked, then epochs of optimizer steps, evaluation reduced exactly across ranks, and file I/O on
rank 0 only. Like torchtitan's trainer it runs over seams that a subclass overrides one at a time:

- ``train_step(micro_batches)``: forward and backward of one optimizer step's micro-batches
  (all but the last under ``no_sync()``), returning the step's loss;
- ``optimizer_step()``: clip, step, schedule, zero the gradients;
- ``evaluate()``: the validation metrics, exact over the whole set;
- ``should_stop()``: whether to stop after the current step;

and the user hooks ``configure_model``, ``configure_optimizers``, ``train_dataset``,
``val_dataset``, ``training_step``, ``validation_step``, ``configure_callbacks`` and the class
method ``prepare_data`` (runs once, before workers start). The rest lives in objects of its own:
joining in :mod:`ddptrain.launch.join`, checkpoint state in :mod:`.checkpointing`, logging, final
metrics and the smoke check in :mod:`.metrics`. The epoch and the position in it belong to the
training sampler; the loop reports each step's samples to it (``advance``).

Synchronisation points (every rank must reach them together, which the loop guarantees because
all ranks run the same number of steps): DDP's construction and every synchronised backward;
the logging all-reduce every ``trainer.log_every_steps`` steps and at the end of each epoch; one
all-reduce per evaluation; one all-gather per checkpoint (RNG states); a few small broadcasts at
start-up (output directory, resume path) and one all-gather at the end (parameter checksums).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from ..comm.objects import broadcast_object
from ..comm.process_group import ProcessGroup
from ..comm.ring import RingAllReducer
from ..config import Config, ConfigError, check_device, instantiate, resolve_backend
from ..data import DistributedSampler, build_dataset
from ..ddp import DistributedDataParallel, ring_allreduce_hook
from ..launch.env import detect_environment
from ..launch.join import Membership, RendezvousError, join_process_group
from .callbacks import Callback
from .callbacks import from_config as callbacks_from_config
from .checkpointing import Checkpointer, TrainState, check_world_size
from .data import batch_size_of, default_dataset, group_micro_batches, make_batches, move_to, num_batches, plan_epochs
from .metrics import ExactMean, SmokeCheckError, SmokeProbe, TrainingMetrics
from .optim import build_optimizer, build_scheduler
from .rng import seed_everything
from .stopping import GracefulStop, checkpoint_now

# check_world_size: runner.preflight_resume imports it from here.
__all__ = ["Trainer", "TrainState", "SmokeCheckError", "check_world_size"]

log = logging.getLogger("ddptrain.trainer")


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
    ``scheduler``, ``train_set``, ``val_set``, ``train_sampler``, ``val_sampler``, ``batch_size``
    (per rank per micro-batch), ``steps_per_epoch``, ``total_steps``, ``state``
    (:class:`TrainState`), ``output_dir``, ``callbacks``, ``metrics`` (:class:`.metrics.TrainingMetrics`),
    ``checkpointer`` (:class:`.checkpointing.Checkpointer`).
    """

    def __init__(self, config: Config | None = None, callbacks: Sequence[Callback] = ()):
        self.config = config if config is not None else Config()
        self.extra_callbacks = list(callbacks)
        # This rank's place in the job (setup_distributed).
        self.rank, self.world_size, self.local_rank = 0, 1, 0
        self.device = torch.device("cpu")
        self.process_group = None
        self._membership: Membership | None = None
        # What trains, on what (setup).
        self.model: DistributedDataParallel | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler = None
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self.train_sampler: DistributedSampler | None = None
        self.val_sampler: DistributedSampler | None = None
        self.batch_size = self.steps_per_epoch = self.total_steps = 0
        # Progress, reports, files.
        self.output_dir = Path(self.config.trainer.output_dir or os.getcwd())
        self.checkpointer: Checkpointer | None = None
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
        return instantiate(self.config.model, "model", f"override {type(self).__name__}.configure_model")

    def configure_optimizers(self, model: nn.Module):
        """An optimizer, or ``(optimizer, scheduler)`` with a scheduler stepped per optimizer step."""
        optimizer = build_optimizer(self.config.optimizer, model.parameters())
        return optimizer, build_scheduler(self.config.optimizer, optimizer, self.total_steps)

    def train_dataset(self) -> Dataset:
        """The training set (every rank builds all of it; the sampler picks this rank's share)."""
        return default_dataset(self.config.data, train=True)

    def val_dataset(self) -> Dataset | None:
        """The evaluation set, or ``None`` for no evaluation."""
        return default_dataset(self.config.data, train=False)

    def training_step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """The loss of one micro-batch (a scalar). ``model`` is the DDP wrapper: call it.

        The smoke check (``trainer.smoke_check``) also calls it with the bare module, in eval mode
        and under ``no_grad``, to measure the loss on fixed samples before and after training.
        """
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
        return callbacks_from_config(self.config.trainer)

    # == the loop =================================================================================
    def fit(self) -> dict[str, Any]:
        """Train to the end (epochs, ``max_steps`` or ``stop_after_steps``); the final metrics on every rank."""
        fit_start = time.perf_counter()
        self._reset()  # a Trainer may fit more than once
        owns_group = self.setup_distributed()  # ranks: launcher env, or an existing group
        self._stop.install()  # SIGINT/SIGTERM: stop at an agreed step, with a checkpoint
        try:
            self.setup()  # model in DDP, data, optimizer, callbacks; resumed if asked
            self._call("on_fit_start")
            while self.state.epoch < self.config.trainer.epochs and not self.should_stop():
                if not self.train_epoch():
                    break  # stopped mid-epoch (max_steps / stop_after_steps)
            return self._finish(fit_start)
        except BaseException as exc:
            for callback in self.callbacks:
                with contextlib.suppress(Exception):  # never hide the original error
                    callback.on_exception(self, exc)
            raise
        finally:
            self._stop.uninstall()
            if owns_group:
                self._membership.leave()

    def train_epoch(self) -> bool:
        """The rest of the current epoch, its evaluation and ``on_epoch_end``; False if stopped before its end."""
        epoch = self.state.epoch
        self._call("on_epoch_start", epoch)
        metrics: dict[str, Any] = {"epoch": epoch + 1}
        started, loss_sum, steps = time.perf_counter(), 0.0, 0
        self.model.train()
        for micro_batches in self.step_batches():
            loss = self.train_step(micro_batches)
            self.optimizer_step()
            samples = sum(batch_size_of(b) for b in micro_batches)
            self.train_sampler.advance(samples)  # trained on: the sampler owns the position
            self.state.step += 1
            loss_sum, steps = loss_sum + loss, steps + 1
            self._after_step(loss, samples)
            if self.should_stop():
                break
        metrics.update(self.metrics.end_epoch(loss_sum, steps, time.perf_counter() - started))  # collective
        if self.state.samples_in_epoch < len(self.train_sampler):
            return False
        self.train_sampler.set_epoch(epoch + 1)  # a checkpoint now resumes at the next epoch's start
        every = self.config.trainer.eval_every_epochs
        if every and (epoch + 1) % every == 0:
            metrics.update(self.evaluate())  # exact over the validation set, all ranks
        self._call("on_epoch_end", epoch, metrics)
        return True

    def step_batches(self) -> Iterator[list[Any]]:
        """The rest of this epoch as one list of micro-batches per optimizer step.

        ``trainer.grad_accum_steps`` micro-batches per step; the last step of an epoch may get fewer.
        """
        return group_micro_batches(self.train_batches(), self.config.trainer.grad_accum_steps)

    def train_step(self, micro_batches: Sequence[Any]) -> float:
        """Forward and backward of one optimizer step; this rank's mean loss over its micro-batches.

        Gradients accumulate locally under ``no_sync()`` and are averaged over ranks in the last
        micro-batch's backward. Each loss is divided by the number of micro-batches, so the
        gradient is that of their mean.
        """
        count, step_loss = len(micro_batches), 0.0
        for i, batch in enumerate(micro_batches):
            sync = i == count - 1
            with contextlib.nullcontext() if sync else self.model.no_sync():
                loss = self.training_step(self.model, move_to(batch, self.device, non_blocking=True))
                (loss / count).backward()
            step_loss += loss.item() / count
        return step_loss

    def optimizer_step(self) -> None:
        """Apply the averaged gradients: clip (``trainer.grad_clip_norm``), step, schedule, zero."""
        clip = self.config.trainer.grad_clip_norm
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def should_stop(self) -> bool:
        """Whether to stop now: ``trainer.max_steps`` or ``trainer.stop_after_steps`` is reached, or
        every rank agreed to stop for a signal (``stopped_by``).

        Asked before every epoch and after every optimizer step, on every rank: an override must
        answer the same on all ranks (decide on reduced values, e.g. in ``on_log``).
        """
        t = self.config.trainer
        limits = (t.max_steps, t.stop_after_steps)
        return self.stopped_by is not None or any(n is not None and self.state.step >= n for n in limits)

    def evaluate(self) -> dict[str, float]:
        """Metrics of ``validation_step`` averaged over exactly the validation set, on every rank.

        The sampler pads ranks with duplicates so all take the same number of batches; those
        positions are masked out, so each sample counts exactly once.
        """
        if self.val_set is None:
            return {}
        started = time.perf_counter()
        self.model.sync_buffers()  # rank 0's BatchNorm statistics on every rank: one model is evaluated
        module = self.model.module
        was_training = module.training
        module.eval()
        mean = ExactMean(self.val_sampler.padding_mask())
        with torch.no_grad():
            for batch in self.val_batches():
                mean.add(self.validation_step(module, move_to(batch, self.device)), batch_size_of(batch))
        module.train(was_training)
        metrics = mean.reduce(self.process_group)
        self.metrics.record_eval(metrics, self.state.step, time.perf_counter() - started)
        self._call("on_validation_end", metrics)
        return metrics

    # == building =================================================================================
    def setup_distributed(self) -> bool:
        """Join the job's process group (unless one exists); pick the device and thread count.

        Returns:
            True if this call created the group (``fit`` then destroys it at the end).
        """
        cfg = self.config
        env = detect_environment()
        check_device(cfg, env.local_world_size)
        try:
            self._membership = join_process_group(
                resolve_backend(cfg, env.name, env.master_addr),
                device_type=cfg.trainer.device,
                timeout_s=cfg.dist.timeout_s,
                init_timeout_s=cfg.dist.init_timeout_s,
                threads_per_worker=cfg.dist.threads_per_worker or None,
                environment=env,
            )
        except RendezvousError as exc:
            raise ConfigError(str(exc)) from None
        m = self._membership
        self.process_group, self.device, self.local_rank = m.process_group, m.device, m.local_rank
        self.rank, self.world_size = m.rank, m.world_size
        self.metrics.process_group = self.process_group
        return m.created

    def setup(self) -> None:
        """Build what a fit needs, then resume if asked: model in DDP, data, optimizer, callbacks."""
        cfg = self.config
        seed_everything(cfg.trainer.seed + self.rank)  # per-rank seed (dropout); DDP syncs weights
        self.output_dir = _agree_on_directory(self.process_group, cfg.trainer.output_dir or os.getcwd())
        self._build_model()
        self._setup_data()  # datasets, samplers, batch sizes, step counts
        self.optimizer, self.scheduler = self._optimizers()
        self.callbacks = [*self.configure_callbacks(), *self.extra_callbacks]
        self.checkpointer = Checkpointer(
            model=self.model.module,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            sampler=self.train_sampler,
            state=self.state,
            metrics=self.metrics,
            process_group=self.process_group,
            device=self.device,
            config=cfg,
            directory=self.checkpoint_dir,
            trainer_class=f"{type(self).__module__}.{type(self).__qualname__}",
        )
        self.checkpointer.resume_if_asked()  # weights, optimizer, sampler, step, RNG
        if cfg.trainer.smoke_check:
            self.smoke_probe = SmokeProbe.first_samples(self.train_set, cfg.data, self.training_step, self.device)
            self.smoke_probe.start(self.metrics, self.state.step, self.model.module)

    def _build_model(self) -> None:
        cfg, module = self.config, self.configure_model().to(self.device)
        self.model = DistributedDataParallel(module, process_group=self.process_group, **cfg.dist.ddp_options())
        if cfg.dist.algorithm == "ring":
            self.model.register_comm_hook(RingAllReducer(self.process_group), ring_allreduce_hook)

    def _setup_data(self) -> None:
        self.train_set, self.val_set = self.train_dataset(), self.val_dataset()
        plan = plan_epochs(self.config, self.train_set, self.val_set, self.world_size, self.rank)
        self.train_sampler, self.val_sampler, self.batch_size = plan.train_sampler, plan.val_sampler, plan.batch_size
        self.steps_per_epoch, self.total_steps = plan.steps_per_epoch, plan.total_steps
        self.state.sampler = self.train_sampler  # the one owner of the epoch and the position in it

    def _optimizers(self):
        result = self.configure_optimizers(self.model.module)
        return tuple(result) if isinstance(result, (tuple, list)) else (result, None)

    # == data =====================================================================================
    def train_batches(self):
        """The rest of this epoch's micro-batches for this rank (``iter`` once per epoch)."""
        d, pin, seed = self.config.data, self.device.type == "cuda", self.config.trainer.seed + self.rank
        return make_batches(self.train_set, self.train_sampler, self.batch_size, d.num_workers, pin, seed=seed)

    def val_batches(self):
        """One full pass over this rank's share of the validation set, in the sampler's order."""
        d, pin = self.config.data, self.device.type == "cuda"
        return make_batches(self.val_set, self.val_sampler, d.eval_batch_size, d.num_workers, pin)

    # == state, checkpoints, reports ==============================================================
    @property
    def is_main(self) -> bool:
        """True on rank 0, the rank that writes files and prints."""
        return self.rank == 0

    @property
    def steps_done_in_epoch(self) -> int:
        """Optimizer steps of the current epoch already done (from the sampler's position)."""
        micro_batches = num_batches(self.state.samples_in_epoch, max(1, self.batch_size))  # 0 before fit
        return micro_batches // self.config.trainer.grad_accum_steps

    @property
    def checkpoint_dir(self) -> Path:
        return self.output_dir / "checkpoints"

    @property
    def loss_history(self) -> list[tuple[int, float]]:
        """``(step, train/loss)`` at every logging point of the run (resumes included)."""
        return self.metrics.loss_history

    def save_checkpoint(self, path: str | Path) -> Path:
        """Write a checkpoint (collective; rank 0 writes, atomically). Returns ``path``."""
        return self.checkpointer.save(path)

    def _reset(self) -> None:
        self.state = TrainState()
        self.callbacks: list[Callback] = []
        self.metrics = TrainingMetrics(self.process_group)
        self.smoke_probe: SmokeProbe | None = None
        self.stopped_by: str | None = None  # "SIGINT"/"SIGTERM" once every rank agreed to stop for it
        self._stop = GracefulStop()

    def _call(self, hook: str, *args: Any) -> None:
        for callback in self.callbacks:
            getattr(callback, hook)(self, *args)

    def _after_step(self, loss: float, samples: int) -> None:
        stats = self.model.last_iteration_stats
        self.metrics.window.add(loss, samples, 0.0 if stats is None else stats.finalize_wait_s)
        # Reduced before the callbacks run: a checkpoint written at this step holds this step's logged loss.
        scalars = self._reduce_window() if self.state.step % self.config.trainer.log_every_steps == 0 else None
        self._call("on_train_batch_end", loss)
        if scalars is not None:
            self._call("on_log", scalars)
        every = self.config.trainer.check_sync_every_n_steps
        if every and self.state.step % every == 0:
            self.model.check_parameters_in_sync()  # collective: every rank reaches this step
        self.stopped_by = self.stopped_by or self._stop.agreed(self.process_group)  # collective, asynchronous

    def _reduce_window(self) -> dict[str, float]:
        """The logging window's scalars reduced over ranks (collective), added to the loss history."""
        return self.metrics.reduce_window(self.state.step, float(self.optimizer.param_groups[0]["lr"]))

    def _finish(self, fit_start: float) -> dict[str, Any]:
        self._stop.finish()  # the last stop request, posted after the last step (collective)
        if self.metrics.window.steps:
            self._call("on_log", self._reduce_window())
        stopped = self.stopped_by is not None  # by a signal: no evaluation, a checkpoint now
        if not stopped and self.val_set is not None and self.metrics.last_eval_step != self.state.step:
            self.evaluate()
        step, epoch, fit_s = self.state.step, self.state.epoch, time.perf_counter() - fit_start
        self.model.sync_buffers()  # the digest is of the model rank 0 checkpoints, on every rank
        final = self.metrics.final(self.model.module, step=step, epoch=epoch, fit_s=fit_s)  # collective
        if stopped:
            final.update(stopped_by=self.stopped_by, checkpoint=str(checkpoint_now(self, self.callbacks)))
        if self.is_main:
            (self.output_dir / "metrics.json").write_text(json.dumps(final, indent=2) + "\n")
        self._call("on_fit_end", final)
        if self.smoke_probe is not None and not stopped:
            passed = self.smoke_probe.check(self.metrics, self.model.module, final)
            if self.is_main:
                log.info(passed)
        return final


def _agree_on_directory(process_group: ProcessGroup, mine: str) -> Path:
    """Rank 0's choice of directory, on every rank (collective); rank 0 creates it."""
    chosen = Path(broadcast_object(process_group, str(Path(mine).resolve()), 0))
    if process_group.rank() == 0:
        chosen.mkdir(parents=True, exist_ok=True)
    return chosen
