"""The Trainer: ddptrain's distributed training loop, made to be subclassed.

``fit`` reads top to bottom like nanoGPT's ``train.py``: join the job's process group, seed per
rank, build the model inside our ``DistributedDataParallel``, data and optimizer, resume if
asked, then epochs of optimizer steps, evaluation reduced exactly across ranks, and file I/O on
rank 0 only. Like torchtitan's trainer it runs over seams that a subclass overrides one at a time:

- ``forward_backward(micro_batches)``: forward and backward of one optimizer step's
  micro-batches, the gradients reduced across ranks, returning the step's loss (not to be
  confused with the user hook ``training_step``, the loss of one micro-batch);
- ``optimizer_step()``: clip, step every optimizer, per-step schedules, zero the gradients;
- ``evaluate()``: the validation metrics, exact over the whole set (every epoch and/or every
  ``trainer.eval_every_steps`` steps);

and the flag ``should_stop``, which any hook or callback may set (e.g. ``EarlyStopping``): the
ranks agree on it, so every rank stops at the same step;

and the user hooks (Lightning's names: ``configure_model``, ``training_step``...), inherited from
:class:`.hooks.TrainingHooks`, where they are documented. The rest lives in objects of its own:
set-up in :mod:`.building`, how a step becomes an update in the step strategy that
:func:`ddptrain.modes.mode_of` picks (:mod:`.steps`; it sees the loop as a :class:`.view.LoopView`),
checkpoint state and files in :mod:`.checkpoint`, logging, final metrics and the smoke check in
:mod:`.metrics`, ``test`` / ``predict`` in :mod:`.inference`, membership changes of an elastic
job in :mod:`.elastic`. The epoch and the position in it belong to the training sampler; the loop
reports each step's samples to it (``advance``).

Synchronisation points (every rank must reach them together, which the loop guarantees because
all ranks run the same number of steps): DDP's construction and every synchronised backward;
the logging all-reduce every ``trainer.log_every_steps`` steps and at the end of each epoch; one
all-reduce per evaluation; one all-gather per checkpoint (RNG states); the stop votes (in every
step's gradient all-reduce; a blocking all-reduce at evaluations and epoch ends); a few
small broadcasts at start-up (output directory, resume path) and one all-gather at the end
(parameter checksums).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from ..config import Config, default_output_dir, max_time_seconds
from ..data import DistributedSampler
from ..ddp import DistributedDataParallel
from ..launch.join import Membership
from ..rundir import RunDir
from .building import (
    agree_on_directory,
    build_model,
    check_plugins_served,
    join_job,
    load_data,
    prepare_rank,
    wrap_model,
)
from .callbacks import Callback
from .checkpoint import Checkpointer, TrainState
from .data import make_batches, plan_epochs
from .dev_run import dev_run_batches, dev_run_config, remove_dev_run_dir
from .elastic import MEMBERSHIP_CAUSES, ElasticTraining, MembershipChange, MembershipChangeDue
from .ema import EmaWeights
from .evaluation import sanity_check, validation_pass
from .hooks import TrainingHooks
from .inference import run_dev_test, run_predict, run_test
from .metrics import LoggedMetrics, SmokeCheckError, SmokeProbe, TrainingMetrics
from .optimizers import OptimizerSet
from .profiling import StepPhases
from .steps import StepStrategy, unused_parameters_named_as_config
from .stopping import GracefulStop

__all__ = ["Trainer", "TrainState", "SmokeCheckError"]

log = logging.getLogger("ddptrain.trainer")


class Trainer(TrainingHooks):
    """Distributed data-parallel training of one model; subclass it for your task.

    The defaults build the model from ``config.model['_target_']``, the data from
    ``config.data`` (``ddptrain.data.build_dataset``), SGD/Adam/AdamW from ``config.optimizer``,
    and train with cross-entropy. Run it on every rank (``python -m ddptrain`` does that), or
    call ``fit()`` in a process whose ranks come from torchrun/mpirun/srun, or inside an
    existing ``ddptrain.comm`` process group.

    Args:
        config: the run's configuration (default: ``Config()``).
        callbacks: extra callbacks, run after those of ``configure_callbacks``.

    Attributes (set by ``fit``): ``rank``, ``world_size``, ``local_rank``, ``device``,
    ``process_group``, ``model`` (the DDP wrapper; ``model.module`` is yours), ``optimizers`` (all of
    ``configure_optimizers``'), ``optimizer`` (the first), ``scheduler`` (the first or None),
    ``optimizer_set`` (:class:`.optimizers.OptimizerSet`: all of them, with their schedules),
    ``train_set``, ``val_set``, ``train_sampler``, ``val_sampler``, ``batch_size``
    (per rank per micro-batch), ``steps_per_epoch``, ``total_steps``, ``state``
    (:class:`TrainState`), ``output_dir``, ``callbacks``, ``metrics`` (:class:`.metrics.TrainingMetrics`),
    ``checkpointer`` (:class:`.checkpoint.Checkpointer`: every checkpoint of the fit),
    ``callback_metrics`` (the latest value of every reduced metric), ``should_stop`` (set it to
    stop; see :meth:`fit`), ``stopped_early`` (True once the ranks agreed to stop for
    ``should_stop``), ``phases``
    (:class:`.profiling.StepPhases`: every step's phases, announced to listeners such as the doctor).
    """

    def __init__(self, config: Config | None = None, callbacks: Sequence[Callback] = ()):
        self.config = dev_run_config(config if config is not None else Config())  # trainer.fast_dev_run's changes
        self.extra_callbacks = list(callbacks)
        # This rank's place in the job (setup_distributed).
        self.rank, self.world_size, self.local_rank = 0, 1, 0
        self.device = torch.device("cpu")
        self.process_group = None
        self.strategy: StepStrategy | None = None  # how a step's micro-batches become an update (.steps)
        self._membership: Membership | None = None
        self.elastic: ElasticTraining | None = None  # trainer.elastic: the membership across changes
        self._step_started = time.monotonic()  # when the step in flight started
        # What trains, on what (setup).
        self.model: DistributedDataParallel | None = None
        self.optimizer_set: OptimizerSet | None = None
        self.optimizers: list[torch.optim.Optimizer] = []
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler = None
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self.train_sampler: DistributedSampler | None = None
        self.val_sampler: DistributedSampler | None = None
        self.batch_size = self.steps_per_epoch = self.total_steps = 0
        self.train_loader_options = self.val_loader_options = None  # kept from a data hook's DataLoader
        self.val_batch_size = self.config.data.eval_batch_size  # or val_dataloader()'s batch_size
        # Progress, reports, files.
        self.output_dir = Path(self.config.trainer.output_dir or default_output_dir(self.config))
        self.checkpointer: Checkpointer | None = None
        self.ema: EmaWeights | None = None  # trainer.ema.decay: the weights' moving average
        self.phases = StepPhases()  # each step's phases, announced to listeners (ddptrain doctor)
        self._reset()

    # == the loop =================================================================================
    def fit(self) -> dict[str, Any]:
        """Train to the end; the final metrics on every rank.

        The end: ``trainer.epochs``, ``max_steps`` or ``stop_after_steps``, a signal or
        ``trainer.max_time``, or ``should_stop`` set by any hook or callback on any rank. Under
        ``trainer.fast_dev_run`` a test pass of N batches follows, and the run's temporary
        directory is deleted. The ranks vote on the flag, so
        all stop at the same step: set in ``training_step`` (or before), after that step (the
        votes ride in its gradient all-reduce); set after the backward (``on_train_batch_end``),
        after the next step; set at an evaluation, an epoch end or in ``on_fit_start``, before
        the next step.
        """
        fit_start = time.perf_counter()
        self._reset()  # a Trainer may fit more than once
        if self.config.trainer.elastic:
            # Before joining: a restarted worker is admitted only once its data is loaded, so the
            # others train on meanwhile instead of waiting for it. The limits (trainer.overfit_batches,
            # limit_val_batches) count batches per rank of the job's first size: every member cuts the same datasets.
            self._load_data(self.config.dist.world_size)
        owns_group = self.setup_distributed()  # ranks: launcher env, or an existing group
        self._stop.install()  # SIGINT/SIGTERM: stop at an agreed step, with a checkpoint
        try:
            self.setup()  # model in DDP, data, optimizer, callbacks; resumed if asked
            joined_late = self.elastic is not None and self.elastic.joined_late
            if joined_late:  # admitted into a running elastic job: the state comes from a peer
                change = self.elastic.go_on_from_agreed_state(
                    self, None, time.monotonic(), "newcomers waiting", regroup=False
                )
                self._after_membership_change(change)
            self._call("on_fit_start")
            if not joined_late:  # (the members it joins are past these collectives)
                self._sanity_check()  # a few validation batches: a broken validation_step fails now
                self._agree_to_stop(wait=True)
            self.metrics.start_training()  # the first logging window's time and bytes start here
            while self.state.epoch < self.config.trainer.epochs and not self._stopping():
                try:
                    with unused_parameters_named_as_config():  # DDP's error, in config keys
                        if not self.train_epoch():
                            break  # stopped mid-epoch (max_steps / stop_after_steps / max_time)
                except MEMBERSHIP_CAUSES as exc:  # a failed collective, or newcomers admitted
                    if self.elastic is None:
                        raise
                    change = self.elastic.change_membership(self, exc, self._step_started)
                    self._after_membership_change(change)  # then the epoch goes on from the agreed step
            final = self._finish(time.perf_counter() - fit_start)
            if self.elastic is not None and self.is_main:
                self.elastic.membership.finish()  # a restarted worker still waiting to be admitted leaves
            dev_batches = dev_run_batches(self.config)
            if dev_batches:
                final.update(run_dev_test(self, dev_batches))
                remove_dev_run_dir(self.config)  # a dev run that worked leaves nothing (each rank its own)
            return final
        except BaseException as exc:
            for callback in self.callbacks:
                with contextlib.suppress(Exception):  # never hide the original error
                    callback.on_exception(self, exc)
            raise
        finally:
            self._stop.uninstall()
            if owns_group:
                self._membership.leave()
            if self.elastic is not None:
                self.elastic.close()

    def train_epoch(self) -> bool:
        """The rest of the current epoch, its evaluation and ``on_epoch_end``; False if stopped before its end."""
        epoch = self.state.epoch
        self._call("on_epoch_start", epoch)
        metrics: dict[str, Any] = {"epoch": epoch + 1}
        loss_sum, steps = 0.0, 0
        self.metrics.start_epoch()  # the epoch's training time counts from here
        self.model.train()
        for micro_batches in self.phases.batches(self.strategy.batches()):  # phases: profiler labels, the doctor
            self._step_started = time.monotonic()  # an elastic change counts the seconds lost from here
            with self.phases.span("forward_backward"):
                loss = self.forward_backward(micro_batches)
            with self.phases.span("optimizer_step"):
                self.optimizer_step()
            samples = self.strategy.samples(micro_batches)
            self.train_sampler.advance(samples)  # trained on: the sampler owns the position
            self.state.step += 1
            if self.ema is not None:
                self.ema.update(self.state.step)  # before _after_step: an evaluation there may use it
            loss_sum, steps = loss_sum + loss, steps + 1
            self._after_step(loss, samples)
            if self._stopping() or self.steps_done_in_epoch >= self.steps_per_epoch:  # limit_train_batches
                break
        pg = self.process_group
        reduce = lambda entries, names: self.metrics.end_epoch(loss_sum, steps, entries, names)  # noqa: E731
        metrics.update(self.logged.reduced("epoch", pg, reduce))  # collective, with self.log(on_epoch=True) values
        if self.steps_done_in_epoch < self.steps_per_epoch:
            return False  # stopped mid-epoch
        self.train_sampler.set_epoch(epoch + 1)  # a checkpoint now resumes at the next epoch's start
        every = self.config.trainer.eval_every_epochs
        if every and (epoch + 1) % every == 0:
            metrics.update(self._evaluate_once())  # exact over the validation set, all ranks
        self.callback_metrics.update((k, v) for k, v in metrics.items() if k != "epoch")
        self.optimizer_set.step_schedules("epoch", epoch + 1, self.callback_metrics, self.state.step)
        self._call("on_epoch_end", epoch, metrics)
        self._agree_to_stop(wait=True)  # a decision taken at this epoch's end stops before the next step
        return True

    def forward_backward(self, micro_batches: Any) -> float:
        """Forward and backward of one optimizer step, the gradients reduced across ranks; this
        rank's loss of the step. ``micro_batches`` is one item of the strategy's ``batches()``
        (plain DDP: a list of ``trainer.grad_accum_steps`` micro-batches, fewer at an epoch's end;
        invariant mode: this rank's shards). The strategy's
        (:meth:`.steps.StepStrategy.forward_backward`): plain DDP averages the micro-batches'
        gradients in the last one's backward."""
        return self.strategy.forward_backward(micro_batches)

    def optimizer_step(self) -> None:
        """Apply the reduced gradients: unscale (16-mixed), clip (``trainer.grad_clip_norm``), step
        every optimizer, the per-step schedules, zero the gradients (:meth:`.steps.StepStrategy.optimizer_step`)."""
        self.strategy.optimizer_step()

    def evaluate(self) -> dict[str, float]:
        """Metrics of ``validation_step`` averaged over exactly the validation set, on every rank.

        The sampler pads ranks with duplicates so all take the same number of batches; those
        positions are cut off before ``validation_step`` sees them, so each sample counts exactly once.
        """
        if self.val_set is None:
            return {}
        started = time.perf_counter()
        self.model.sync_buffers()  # rank 0's BatchNorm statistics on every rank: one model is evaluated
        with self.evaluated_weights():  # trainer.ema.evaluate: the moving average
            metrics = validation_pass(self, self.precision.autocast)  # padding cut off; self.log values reduced
        self.metrics.record_eval(metrics, self.state.step, time.perf_counter() - started)
        self.callback_metrics.update(metrics)
        self._call("on_validation_end", metrics)
        return metrics

    def test(self, dataset: Dataset | DataLoader | None = None, checkpoint: str | None = None) -> dict[str, float]:
        """``test_step``'s metrics (``test/<name>``) averaged over exactly ``dataset`` (default
        ``test_dataloader()``), the same on every rank; rank 0 writes ``test_metrics.json``.
        The weights: the fitted model, else ``checkpoint`` (a file, a run directory, ``latest``,
        ``best``), else ``configure_model()`` with rank 0's weights (:mod:`.inference`)."""
        return run_test(self, dataset, checkpoint)

    def predict(self, dataset: Dataset | DataLoader, checkpoint: str | None = None) -> Any:
        """``predict_step``'s outputs for every sample of ``dataset``, in dataset order, on every
        rank; the weights as for :meth:`test` (:mod:`.inference`)."""
        return run_predict(self, dataset, checkpoint)

    # == reports from user code ===================================================================
    def log(
        self,
        name: str,
        value: Any,
        reduce: str = "mean",
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        prog_bar: bool = False,
        batch_size: int | None = None,
    ) -> None:
        """Report a number (or a ``torchmetrics`` metric) from ``training_step``, ``validation_step``
        or a callback, reduced over every rank and written to every logger.

        Args:
            name: the metric's name (``on_log`` scalars, evaluation metrics, ``callback_metrics``).
            value: a number, a one-element tensor, or a torchmetrics ``Metric`` (epoch level;
                synchronised through ddptrain's process group).
            reduce: over ranks and steps: ``mean`` (weighted by ``batch_size``), ``sum``, ``max``, ``min``.
            on_step: reduce over each logging window (default in training).
            on_epoch: reduce over the epoch, or the whole validation set (default in validation).
            prog_bar: also show it on the progress bar.
            batch_size: the weight of this value in a mean (default: the current batch's size).

        See :mod:`ddptrain.trainer.metrics` for where each value goes.
        """
        self.logged.log(name, value, reduce, on_step, on_epoch, prog_bar, batch_size)

    @property
    def progress_bar_metrics(self) -> dict[str, float]:
        """The latest reduced values of what was logged with ``prog_bar=True``."""
        return {k: v for k, v in self.callback_metrics.items() if k in self.logged.prog_bar}

    # == building =================================================================================
    def setup_distributed(self) -> bool:
        """Join the job's process group (unless one exists); pick the device and thread count.

        Returns:
            True if this call created the group (``fit`` then destroys it at the end).
        """
        if self.config.trainer.elastic:
            self.elastic = ElasticTraining(self.config)
            self._membership = m = self.elastic.join()
        else:
            self._membership = m = join_job(self.config)
        self.process_group, self.device, self.local_rank = m.process_group, m.device, m.local_rank
        self.rank, self.world_size = m.rank, m.world_size
        self.metrics.process_group = self.process_group
        return m.created

    @contextlib.contextmanager
    def joined(self) -> Iterator[None]:
        """This rank in the job's process group for the block, as ``fit`` joins it (``test`` and
        ``predict`` use it): a group made here is left at the end; inside ``fit``, fit's stays."""
        outer = self._membership
        created = self.setup_distributed()
        try:
            yield
        finally:
            if created:
                self._membership.leave()
            if outer is not None:
                self._membership = outer

    def setup(self) -> None:
        """Build what a fit needs, then resume if asked: model in DDP, data, optimizer, callbacks."""
        cfg = self.config
        self.precision = prepare_rank(cfg, self.device, self.rank)  # seed, determinism, autocast
        self.output_dir = agree_on_directory(self.process_group, str(self.output_dir))  # rank 0's choice
        self.model = build_model(self.configure_model(), cfg, self.device, self.process_group, self.is_main)
        if cfg.trainer.ema.decay is not None:
            self.ema = EmaWeights(self.model.module, cfg.trainer.ema)
        self._setup_data()  # datasets, samplers, batch sizes, step counts
        self.optimizer_set = OptimizerSet.from_hook(self.configure_optimizers(self.model.module))
        self.optimizers, self.optimizer = self.optimizer_set.optimizers, self.optimizer_set.optimizer
        self.scheduler = self.optimizer_set.scheduler
        self.callbacks = [*self.configure_callbacks(), *self.extra_callbacks]
        check_plugins_served(cfg, self.callbacks, type(self).__name__)
        self.strategy = self.configure_step_strategy(self._stop_votes)  # picked once; the loop never asks which
        self.checkpointer = Checkpointer.of(self)
        if self.elastic is None or not self.elastic.joined_late:  # a newcomer gets the state from a peer
            self.checkpointer.resume_if_asked()  # weights, optimizer, sampler, step, RNG
        if cfg.trainer.smoke_check:
            self.smoke_probe = SmokeProbe.first_samples(
                self.train_set, cfg.data, self.training_step, self.device, self.train_loader_options
            )
            self.smoke_probe.start(self.metrics, self.state.step, self.model.module)

    # == elastic jobs (trainer.elastic; the sequence: ddptrain/trainer/elastic.py) =================
    def bind_to_group(self, membership: Membership) -> None:
        """Rebuild what belongs to the old group for the new ``membership``: the ranks, the run
        directory's agreement, the DDP wrapper, the samplers and step counts, the step strategy,
        the checkpointer. The collectives are ``setup``'s, in its order (a newcomer runs ``setup``)."""
        self._membership, group = membership, membership.process_group
        self.process_group, self.rank, self.world_size = group, group.rank(), group.size()
        self.metrics.process_group = group
        self.output_dir = agree_on_directory(group, str(self.output_dir))
        self.model.reducer.remove_hooks()  # the old wrapper lets go of the parameters
        self.model = wrap_model(self.model.module, self.config, group)
        self._plan_data()
        self.strategy.close()
        self.strategy = self.configure_step_strategy(self._stop_votes)
        self.checkpointer.finish()  # a background save of the old group's state completes first
        old, self.checkpointer = self.checkpointer, Checkpointer.of(self)
        self.checkpointer.keep_step_checkpoints(old.steps_dir, old.keep_last)
        self.checkpointer.last_saved = old.last_saved

    def _after_membership_change(self, change: MembershipChange) -> None:
        """Tell the callbacks; below ``dist.min_world_size``, stop with a checkpoint (the CLI exits
        1, saying how to resume)."""
        self._call("on_membership_change", change)
        minimum = self.config.dist.min_world_size
        if self.world_size < minimum:
            self.stopped_by = "dist.min_world_size"
            if self.is_main:
                log.error(
                    "elastic: %d rank(s) left, fewer than dist.min_world_size=%d: stopping with a checkpoint",
                    self.world_size,
                    minimum,
                )

    def _stop_votes(self) -> list[float]:
        """This rank's votes for the step's reduction: the stop votes, then (elastic) rank 0's
        vote to admit newcomers."""
        votes = self._stop.votes(self.should_stop)
        if self.elastic is not None:
            votes.append(self.elastic.admission_vote(self.is_main))
        return votes

    def _setup_data(self) -> None:
        if not self._data_loaded:  # an elastic member loads it before joining
            self._load_data(self.world_size)
        self._plan_data()

    def _load_data(self, world_size: int) -> None:
        """The datasets of the data hooks, cut by ``trainer.overfit_batches`` / ``limit_val_batches``."""
        data = load_data(self.train_dataloader(), self.val_dataloader(), self.config, world_size)
        self.train_set, self.train_loader_options = data.train_set, data.train_options
        self.val_set, self.val_loader_options, self.val_batch_size = data.val_set, data.val_options, data.val_batch_size
        self._data_loaded = True

    def _plan_data(self) -> None:
        """This rank's samplers and step counts for the current world size."""
        plan = plan_epochs(self.config, self.train_set, self.val_set, self.world_size, self.rank)
        self.train_sampler, self.val_sampler, self.batch_size = plan.train_sampler, plan.val_sampler, plan.batch_size
        self.steps_per_epoch, self.total_steps = plan.steps_per_epoch, plan.total_steps
        self.state.sampler = self.train_sampler  # the one owner of the epoch and the position in it

    # == data =====================================================================================
    def train_batches(self):
        """The rest of this epoch's micro-batches for this rank (``iter`` once per epoch)."""
        d, pin, seed = self.config.data, self.device.type == "cuda", self.config.trainer.seed + self.rank
        options = self.train_loader_options  # a DataLoader's collate_fn, workers... (train_dataloader)
        return make_batches(self.train_set, self.train_sampler, self.batch_size, d.num_workers, pin, seed, options)

    def val_batches(self):
        """One full pass over this rank's share of the validation set, in the sampler's order."""
        d, pin = self.config.data, self.device.type == "cuda"
        options = self.val_loader_options
        return make_batches(self.val_set, self.val_sampler, self.val_batch_size, d.num_workers, pin, 0, options)

    # == state, checkpoints, reports ==============================================================
    @property
    def is_main(self) -> bool:
        """True on rank 0, the rank that writes files and prints."""
        return self.rank == 0

    @property
    def steps_done_in_epoch(self) -> int:
        """Optimizer steps of the current epoch already done (the step strategy reads them from
        the sampler's position; an epoch's last step may hold fewer micro-batches)."""
        return 0 if self.strategy is None else self.strategy.steps_done_in_epoch()

    @property
    def checkpoint_dir(self) -> Path:
        return self.run_dir.checkpoints

    @property
    def run_dir(self) -> RunDir:
        """The paths of this run's files, under ``output_dir`` (:mod:`ddptrain.rundir`)."""
        return RunDir(self.output_dir)

    @property
    def loss_history(self) -> list[tuple[int, float]]:
        """``(step, train/loss)`` at every logging point of the run (resumes included)."""
        return self.metrics.loss_history

    def save_checkpoint(self, path: str | Path, extra: dict[str, Any] | None = None) -> Path:
        """Write a checkpoint, with ``extra`` entries (collective; rank 0 writes, atomically). Returns ``path``."""
        return self.checkpointer.save(path, extra)

    def _reset(self) -> None:
        self.state = TrainState()
        self._data_loaded = False  # the datasets of this fit (_load_data)
        self.callbacks: list[Callback] = []
        self.metrics = TrainingMetrics(self.process_group)
        self.smoke_probe: SmokeProbe | None = None
        self.stopped_by: str | None = None  # "SIGINT"/"SIGTERM" once every rank agreed to stop for it
        self.should_stop = False  # any hook or callback may set it; see fit
        self.stopped_early = False  # True once every rank agreed to stop for should_stop
        self.callback_metrics: dict[str, float] = {}
        self.logged = LoggedMetrics()  # what self.log collected, until the next reduction
        max_time = self.config.trainer.max_time
        self._stop = GracefulStop(
            None if max_time is None else max_time_seconds(max_time),
            sigterm_leaves=bool(self.config.trainer.elastic and self.config.dist.elastic_store),  # see GracefulStop
        )

    def _call(self, hook: str, *args: Any) -> None:
        for callback in self.callbacks:
            getattr(callback, hook)(self, *args)

    def _after_step(self, loss: float, samples: int) -> None:
        stats = self.model.last_iteration_stats
        self.metrics.window.add(loss, samples, 0.0 if stats is None else stats.finalize_wait_s)
        t, step = self.config.trainer, self.state.step
        # Reduced (and evaluated) before the callbacks run: a checkpoint written at this step holds them.
        scalars = self._reduce_window() if t.log_every_steps and step % t.log_every_steps == 0 else None
        evaluated = bool(t.eval_every_steps) and step % t.eval_every_steps == 0
        if evaluated:
            self.evaluate()
        self._call("on_train_batch_end", loss)
        if scalars is not None:
            self._call("on_log", scalars)
        if t.check_sync_every_n_steps and step % t.check_sync_every_n_steps == 0:
            self.model.check_parameters_in_sync()  # collective: every rank reaches this step
        self._agree_to_stop(wait=evaluated)  # collective; asynchronous except after an evaluation

    def _finish(self, fit_s: float) -> dict[str, Any]:
        """The end of a fit (collective): the last logging window, the final evaluation, the final
        metrics (written to ``metrics.json`` on rank 0), ``on_fit_end`` and the smoke check.

        After a signal (``stopped_by``) there is no final evaluation and a checkpoint of the
        current step is written.
        """
        if self.metrics.window.steps:  # the steps since the last logging point (collective)
            scalars = self._reduce_window()
            if self.config.trainer.log_every_steps:  # 0: no step-level logging at all
                self._call("on_log", scalars)
        stopped = self.stopped_by is not None  # by a signal: no evaluation, a checkpoint now
        changed = self.stopped_early and self.strategy.end_fit()  # local SGD: an outer step over the last steps
        if not stopped and self.val_set is not None:
            self.evaluate() if changed else self._evaluate_once()
        step, epoch, module = self.state.step, self.state.epoch, self.model.module
        self.model.sync_buffers()  # the digest is of the model rank 0 checkpoints, on every rank
        with self.strategy.synchronized_weights():  # local SGD: the consensus, not this rank's copy
            final = self.metrics.final(module, step=step, epoch=epoch, fit_s=fit_s)  # collective
        if stopped:
            final.update(stopped_by=self.stopped_by, checkpoint=str(self.checkpointer.save_at_stop()))
        final["stopped_early"] = self.stopped_early
        final.update(self.strategy.final_metrics())
        if self.elastic is not None:  # the job's history, which travels with the state: the same on every rank
            final["membership_changes"] = [dataclasses.asdict(c) for c in self.elastic.changes]
        if self.is_main:
            self.run_dir.metrics.write_text(json.dumps(final, indent=2) + "\n")
        self._call("on_fit_end", final)
        self.checkpointer.finish()  # trainer.checkpoint.async_save: the last checkpoint is whole before fit returns
        if self.smoke_probe is not None and not stopped:
            passed = self.smoke_probe.check(self.metrics, module, final)
            if self.is_main:
                log.info(passed)
        return final

    def _stopping(self) -> bool:
        """Whether to stop now: a step limit is reached, or the ranks agreed to stop (signal or ``should_stop``)."""
        t = self.config.trainer
        limits = (t.max_steps, t.stop_after_steps)
        stopped = self.stopped_by is not None or self.stopped_early
        return stopped or any(n is not None and self.state.step >= n for n in limits)

    def _agree_to_stop(self, wait: bool) -> None:
        votes = self.strategy.take_votes()  # summed in this step's reduction, or None
        admit = False
        if votes is not None and self.elastic is not None:
            votes, admit = votes[:-1], votes[-1] > 0
        if wait or votes is None:  # also what a hook decided since the backward (evaluation, epoch end)
            signal, flag = self._stop.agreed(self.process_group, self.should_stop)  # collective
        else:
            signal, flag = self._stop.decide(votes)
        self.stopped_by = self.stopped_by or signal
        if flag:
            self.should_stop = self.stopped_early = True
        if admit and not self._stopping():
            raise MembershipChangeDue("newcomers waiting")  # every rank, at this step boundary

    @contextlib.contextmanager
    def evaluated_weights(self) -> Iterator[None]:
        """The weights evaluations, ``test`` and ``predict`` use, in the model for the block: the
        moving average under ``trainer.ema.evaluate`` (collective then: rank 0's averaged buffers
        are broadcast), the ranks' consensus under ``dist.sync=local_sgd|diloco``, else the
        trained weights."""
        with self.strategy.synchronized_weights():  # local SGD / DiLoCo: the consensus
            if self.ema is not None and self.config.trainer.ema.evaluate:
                with self.ema.swapped_in():
                    self.model.sync_buffers()  # rank 0's averaged statistics (collective): one model is evaluated
                    yield
            else:
                yield

    def _sanity_check(self) -> None:
        """``trainer.num_sanity_val_steps`` validation batches before the first step; on every start,
        resumed ones included, as Lightning does."""
        n = self.config.trainer.num_sanity_val_steps
        if n and self.val_set is not None:
            with self.evaluated_weights():
                done = sanity_check(self, n, self.precision.autocast)
            if self.is_main:
                log.info("sanity check: validation_step ran on %d batch(es) per rank", done)

    def _evaluate_once(self) -> dict[str, float]:
        """The evaluation of the current step: the one already done (``eval_every_steps``), else a new one."""
        if self.metrics.last_eval_step == self.state.step:
            return dict(self.metrics.last_eval)
        return self.evaluate()

    def _reduce_window(self) -> dict[str, float]:
        """The logging window's scalars reduced over ranks (collective), added to the loss history."""
        lr = float(self.optimizer.param_groups[0]["lr"])
        scalars = self.metrics.reduce_window(self.state.step, lr, self.logged.take("step"))  # with self.log's
        scalars.update(self.optimizer_set.learning_rates())  # every optimizer's and group's, when several
        self.callback_metrics.update(scalars)
        return scalars
