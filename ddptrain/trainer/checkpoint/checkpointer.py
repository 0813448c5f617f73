"""The Checkpointer: the one owner of a fit's checkpoints, and the rules that go with them.

What a checkpoint holds is a dict of plain types and tensors, so it loads with
``torch.load(weights_only=True)``:

- ``format_version``: :data:`.files.FORMAT_VERSION`;
- ``step``: optimizer steps done; ``epoch`` and ``samples_in_epoch``: where the epoch stands,
  copied from ``sampler`` for readers of the file (on resume, ``sampler`` is what counts);
- ``world_size``: ranks of the job that wrote it (see :func:`check_world_size`);
- ``model``, ``optimizer``, ``scheduler``: state dicts (``scheduler`` is ``None`` without one;
  lists, in ``configure_optimizers``' order, with several: :meth:`..optimizers.OptimizerSet.state_dict`);
- ``callbacks``: ``{"<class name>[#n]": state}`` of the callbacks that have a ``state_dict``;
- ``grad_scaler``: the ``GradScaler``'s state under ``trainer.precision=16-mixed``, else ``None``;
- ``strategy``: the step strategy's own state (:meth:`..steps.StepStrategy.state_dict`; ``{}`` for
  plain DDP and invariant mode);
- ``sampler``: the training sampler's state, the one owner of the epoch and the position in it;
- ``rng``: every rank's generator states, in rank order;
- ``metrics``, ``loss_history``, ``smoke_probe_start``: see :meth:`..metrics.TrainingMetrics.state_dict`;
- ``config`` and ``trainer_class``: what wrote it (a resume uses the new run's config;
  ``ddptrain.load_model`` builds the model through them);
- ``monitor`` (best checkpoints only): ``{"name", "mode", "value"}`` of the monitored metric.

Where they go (:class:`~ddptrain.rundir.RunDir`): ``<run>/checkpoints/step_<step>.pt`` (the step
checkpoints: :meth:`Checkpointer.save_step`, also the one taken at a stop signal,
:meth:`Checkpointer.save_at_stop`) and ``<run>/checkpoints/best/step_<step>.pt``
(:meth:`Checkpointer.save_best`). Each is verified on disk before anything older is deleted.
*When* to save is the callbacks' business (:class:`~ddptrain.trainer.CheckpointCallback`: every N
steps or epochs and at the end; :class:`~ddptrain.trainer.BestCheckpoints`: the top k by a metric).

Which file ``trainer.resume`` / ``trainer.init_from`` mean: :mod:`.resolve`. A checkpoint of
another world size is refused unless ``trainer.allow_world_size_change``, or the mode's bits do not
depend on the world size (invariant mode; :func:`check_world_size`), in the workers and, before
they start, in the launcher (:func:`preflight_resume`).
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...comm.objects import all_gather_object, broadcast_object
from ...comm.process_group import ProcessGroup
from ...config import Config
from ...data import DistributedSampler
from ...data.sampler import world_size_change_refused
from ...modes import mode_of
from ...rundir import RunDir
from ..metrics import TrainingMetrics
from ..optimizers import OptimizerSet
from ..precision import Precision
from ..rng import capture_rng_state, restore_rng_state, seed_everything
from ..steps import StepStrategy
from ..view import LoopView
from .background import BackgroundWriter, host_snapshot
from .dcp import DcpWrite, plan_dcp, sharded_optimizer_entry
from .files import (
    FORMAT_VERSION,
    CheckpointError,
    checkpoint_name,
    list_checkpoints,
    load_checkpoint,
    load_step,
    monitor_entry,
    optimizer_shard_path,
    prune_checkpoints,
    remove_checkpoint,
    save_checkpoint,
)
from .resolve import agree_on_checkpoint, latest_valid_checkpoint, resolve_checkpoint

__all__ = [
    "TrainState",
    "Checkpointer",
    "check_world_size",
    "elastic_restart_resume",
    "resume_after_restart",
    "preflight_resume",
]

log = logging.getLogger("ddptrain.trainer")
_files_log = logging.getLogger("ddptrain.checkpoint")


@dataclass
class TrainState:
    """Where training stands; saved in every checkpoint.

    ``step`` is the Trainer's to count. The epoch and the position in it belong to the training
    sampler (``DistributedSampler``: the trainer reports each step's samples with ``advance``);
    this object reads them from there, so the two can never disagree.
    """

    step: int = 0
    """Optimizer steps done (over the whole run, across resumes)."""
    sampler: DistributedSampler | None = field(default=None, repr=False, compare=False)
    """The training sampler (``None`` before ``fit`` builds it)."""

    @property
    def epoch(self) -> int:
        """Current epoch, 0-based (after the last epoch it equals ``trainer.epochs``)."""
        return 0 if self.sampler is None else self.sampler.epoch

    @property
    def samples_in_epoch(self) -> int:
        """This rank's training samples of the current epoch already trained on."""
        return 0 if self.sampler is None else self.sampler.consumed

    def position(self) -> tuple[int, int, int]:
        """``(step, epoch, samples_in_epoch)``: equal positions, equal checkpoints."""
        return (self.step, self.epoch, self.samples_in_epoch)


def world_size_change_allowed(config: Config) -> bool:
    """Whether a checkpoint of another world size resumes: ``trainer.allow_world_size_change``, or
    a mode whose bits do not depend on the world size (world-size-invariant training), which
    resumes exactly at any."""
    return config.trainer.allow_world_size_change or mode_of(config).same_bits_at_any_world_size


def check_world_size(saved: int, current: int, allow: bool, path: str | Path) -> None:
    """Refuse a checkpoint of another world size unless ``allow`` (:func:`world_size_change_allowed`)."""
    if saved != current and not allow:
        refusal = world_size_change_refused(
            f"checkpoint {path}",
            saved,
            current,
            f"Relaunch with dist.world_size={saved}",
            "set trainer.allow_world_size_change=true",
            with_rng=True,
        )
        raise CheckpointError(
            f"{refusal} In this mode the bits of training depend on the world size; with "
            "trainer.world_size_invariant=true a run resumes exactly at any world size, without the switch."
        )


def elastic_restart_resume() -> str | None:
    """Under ``torchrun --max-restarts``, a restarted worker resumes from the run's last checkpoint.

    torchrun restarts every worker with the same arguments and counts restarts in
    ``TORCHELASTIC_RESTART_COUNT``; a fixed ``hydra.run.dir`` makes the restart find the
    checkpoints of the attempt that failed. Returns ``"auto"`` then (that attempt may have failed
    before its first checkpoint: then the restart starts from scratch too), else ``None``.
    """
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
        log.info("torchrun restart %s: resuming from the latest checkpoint", os.environ["TORCHELASTIC_RESTART_COUNT"])
        return "auto"
    return None


def resume_after_restart(run_dir: RunDir) -> str | None:
    """What the local launcher's restart (``launcher.max_restarts``) resumes from: ``"latest"``
    once the run has a valid checkpoint, else ``None`` (start again as the first attempt did)."""
    return "latest" if latest_valid_checkpoint(run_dir.checkpoints) is not None else None


def preflight_resume(config: Config, world_size: int) -> None:
    """Refuse, in the launcher and before any worker starts, what the workers' resume would refuse:
    a missing, corrupt or wrong-world-size checkpoint (``trainer.resume``), or a missing or corrupt
    one to start from (``trainer.init_from``). The same resolution and rules as
    :meth:`Checkpointer.resume_if_asked`, without the collectives."""
    resume, init_from = config.trainer.resume, config.trainer.init_from
    checkpoints = RunDir(config.trainer.output_dir or ".").checkpoints
    with warnings.catch_warnings():  # rank 0 repeats any warning when it resumes for real
        warnings.simplefilter("ignore")
        path = resolve_checkpoint(resume, checkpoints, recipe=config.recipe.name) if resume else None
        if path is not None:
            checkpoint = load_checkpoint(path)
            check_world_size(checkpoint["world_size"], world_size, world_size_change_allowed(config), path)
        elif init_from:
            load_checkpoint(resolve_checkpoint(init_from, checkpoints, "trainer.init_from"))


class Checkpointer:
    """A fit's checkpoints: what goes into one, writing, verifying and pruning them, resuming.

    Every method that writes or resumes is collective (every rank calls it at the same step:
    each contributes its RNG state, rank 0 alone touches the disk and the others get its answers).

    Args:
        model: the bare module (not the DDP wrapper).
        optimizers: the fit's optimizers and schedulers (:class:`..optimizers.OptimizerSet`).
        precision: the fit's :class:`..precision.Precision` (its gradient scaler's state, under 16-mixed).
        strategy: the fit's :class:`..steps.StepStrategy` (its own state, if it keeps any).
        ema: the fit's :class:`..ema.EmaWeights` (``trainer.ema``), stored as the ``ema`` entry, or None.
        callbacks: the fit's callbacks; those with ``state_dict``/``load_state_dict`` (e.g.
            ``EarlyStopping``) travel in the checkpoint's ``callbacks`` entry.
        sampler: the training sampler (the epoch and the position in it).
        state: the fit's :class:`TrainState` (its ``step`` is restored in place).
        metrics: the fit's :class:`..metrics.TrainingMetrics`.
        process_group: the ranks that save and resume together.
        device: this rank's device (for CUDA generator states).
        config: the run's configuration (seed, resume, ``allow_world_size_change``; stored for reading).
        run_dir: the run's directory: step checkpoints go to its ``checkpoints/`` (unless
            :meth:`keep_step_checkpoints` says otherwise), best ones to ``checkpoints/best/``, and
            ``trainer.resume=latest`` looks in ``checkpoints/``.
        trainer_class: dotted name of the Trainer subclass (stored for reading).
    """

    def __init__(
        self,
        *,
        model: nn.Module,
        optimizers: OptimizerSet,
        precision: Precision | None = None,
        strategy: StepStrategy | None = None,
        ema: Any = None,
        callbacks: Sequence[Any] = (),
        sampler: DistributedSampler,
        state: TrainState,
        metrics: TrainingMetrics,
        process_group: ProcessGroup,
        device: torch.device,
        config: Config,
        run_dir: RunDir,
        trainer_class: str,
    ):
        self.model, self.optimizers, self.precision, self.strategy = model, optimizers, precision, strategy
        self.ema = ema
        self.callbacks = list(callbacks)
        self.sampler, self.state, self.metrics = sampler, state, metrics
        self.process_group, self.device, self.config = process_group, device, config
        self.run_dir, self.trainer_class = run_dir, trainer_class
        self.steps_dir: Path = run_dir.checkpoints
        """Where :meth:`save_step` writes (see :meth:`keep_step_checkpoints`)."""
        self.keep_last = 0
        """How many step checkpoints :meth:`save_step` keeps in ``steps_dir`` (0: all)."""
        self.last_saved: Path | None = None
        """The step checkpoint that holds the current state: the one resumed from, or the last
        :meth:`save_step` wrote; ``None`` while the state is in no file."""
        self._saved_position: tuple[int, int, int] | None = None  # the position last_saved holds
        self.format = config.trainer.checkpoint.format
        """``trainer.checkpoint.format``: ``torch`` (rank 0 writes one file) or ``dcp`` (every rank writes its part)."""
        # trainer.checkpoint.async_save: step checkpoints are written in a thread (.background)
        self._writer = BackgroundWriter() if config.trainer.checkpoint.async_save else None

    @classmethod
    def of(cls, trainer: LoopView) -> Checkpointer:
        """The checkpointer of a ``Trainer`` whose ``setup`` built its model, data and optimizer."""
        return cls(
            model=trainer.model.module,
            optimizers=trainer.optimizer_set,
            precision=trainer.precision,
            strategy=trainer.strategy,
            ema=trainer.ema,
            callbacks=trainer.callbacks,
            sampler=trainer.train_sampler,
            state=trainer.state,
            metrics=trainer.metrics,
            process_group=trainer.process_group,
            device=trainer.device,
            config=trainer.config,
            run_dir=trainer.run_dir,
            trainer_class=f"{type(trainer).__module__}.{type(trainer).__qualname__}",
        )

    @property
    def is_main(self) -> bool:
        return self.process_group.rank() == 0

    @property
    def best_dir(self) -> Path:
        """Where best checkpoints go by default: the run's ``checkpoints/best``."""
        return self.run_dir.best_checkpoints

    # == what a checkpoint holds ==================================================================
    def state_dict(self, *, gather_rng: bool = True) -> dict[str, Any]:
        """Everything needed to continue exactly. Collective: gathers every rank's RNG states;
        ``gather_rng=False`` leaves ``rng`` empty and is local (an elastic job's in-memory state:
        invariant mode seeds each shard itself, and a loaded state without them reseeds per rank)."""
        rng_states = all_gather_object(self.process_group, capture_rng_state(self.device)) if gather_rng else []
        return {
            "format_version": FORMAT_VERSION,
            "step": self.state.step,
            "epoch": self.state.epoch,
            "samples_in_epoch": self.state.samples_in_epoch,
            "world_size": self.process_group.size(),
            "model": self.model.state_dict() if self.strategy is None else self.strategy.model_state_dict(self.model),
            **self._optimizer_entries(),  # optimizer, scheduler
            "grad_scaler": None if self.precision is None else self.precision.state_dict(),
            "strategy": {} if self.strategy is None else self.strategy.state_dict(),
            "ema": None if self.ema is None else self.ema.state_dict(),
            "callbacks": {key: cb.state_dict() for key, cb in _stateful(self.callbacks).items()},
            "sampler": self.sampler.state_dict(),
            "rng": rng_states,
            **self.metrics.state_dict(),
            "config": self.config.to_dict(),
            "trainer_class": self.trainer_class,
        }

    def _optimizer_entries(self) -> dict[str, Any]:
        """``optimizer`` and ``scheduler``: through the strategy, which consolidates a sharded optimizer."""
        if self.strategy is None:
            return self.optimizers.state_dict()
        return self.strategy.optimizer_state_dict(self.optimizers)

    def load_state_dict(
        self, checkpoint: dict[str, Any], path: str | Path = "<checkpoint>", *, allow_world_size_change: bool = False
    ) -> None:
        """Restore weights, optimizer, schedule, sampler position, step, metrics and this rank's RNG.
        A state of another world size is refused unless :func:`world_size_change_allowed` or
        ``allow_world_size_change`` (an elastic job's state, whose membership changed)."""
        allow = world_size_change_allowed(self.config) or allow_world_size_change
        rank, world_size = self.process_group.rank(), self.process_group.size()
        check_world_size(checkpoint["world_size"], world_size, allow, path)
        self.model.load_state_dict(checkpoint["model"])
        if self.strategy is None:
            self.optimizers.load_state_dict(checkpoint)
        else:  # a sharded optimizer cuts the consolidated state into its shards
            self.strategy.load_optimizer_state_dict(self.optimizers, checkpoint)
        if self.precision is not None:
            self.precision.load_state_dict(checkpoint.get("grad_scaler"))
        if self.strategy is not None:
            self.strategy.load_state_dict(checkpoint.get("strategy") or {})
        if self.ema is not None:
            self.ema.load_state_dict(checkpoint.get("ema"))
        saved = checkpoint.get("callbacks") or {}
        for key, callback in _stateful(self.callbacks).items():
            if key in saved:
                callback.load_state_dict(saved[key])
        self.sampler.load_state_dict(checkpoint["sampler"], allow_world_size_change=allow)
        self.state.step = checkpoint["step"]
        self.metrics.load_state_dict(checkpoint)
        if rank < len(checkpoint["rng"]):
            restore_rng_state(checkpoint["rng"][rank], self.device)  # last: nothing may draw after it
        else:
            seed_everything(self.config.trainer.seed + rank + 1_000_003 * checkpoint["step"])

    # == writing ==================================================================================
    def save(
        self,
        path: str | Path,
        extra: dict[str, Any] | None = None,
        *,
        background: bool = False,
        then: Callable[[Path], None] | None = None,
    ) -> Path:
        """Write a checkpoint plus ``extra`` entries to ``path``; returns ``path``. Collective: rank 0
        writes, atomically, with its digest (:func:`.files.save_checkpoint`), then calls
        ``then(path)``. A strategy that shards the optimizer state to files
        (``trainer.checkpoint.sharded``) has every rank write its own first, so the checkpoint
        appears only once all of them are on disk. With ``trainer.checkpoint.format=dcp`` every
        rank writes its part of a directory that rank 0 makes visible once all have (:mod:`.dcp`).

        ``background``: under ``trainer.checkpoint.async_save``, the state is snapshot to host
        memory and written (and ``then`` run) in a writer thread while training goes on
        (:mod:`.background`); otherwise, and for a foreground save, any save in flight is waited
        for first, so checkpoints appear in the order they were asked for."""
        checkpoint = {**self.state_dict(), **(extra or {})}
        path = Path(path)
        shard = None if self.strategy is None else self.strategy.optimizer_shard()
        if self.format == "dcp":
            return self._save_dcp(path, checkpoint, shard, background, then)
        if shard is not None:
            pg = self.process_group
            save_checkpoint(optimizer_shard_path(path, pg.rank(), pg.size()), shard)
            pg.barrier().wait()
            world_size = pg.size()
            if self.is_main and (
                missing := [r for r in range(world_size) if not optimizer_shard_path(path, r, world_size).is_file()]
            ):
                raise CheckpointError(
                    f"trainer.checkpoint.sharded: rank 0 does not see the optimizer shard files of rank(s) {missing} "
                    f"beside {path}, so the ranks do not share its file system. Put trainer.output_dir on a file "
                    "system all ranks share, or set trainer.checkpoint.sharded=false (rank 0 writes the gathered "
                    "state, and a resume sends it to the other ranks)"
                )
        if not self.is_main:
            return path
        step = self.state.step

        def write(state: dict[str, Any]) -> None:
            save_checkpoint(path, state)
            log.info("checkpoint saved: %s (step %d%s)", path, step, ", in the background" if background else "")
            if then is not None:
                then(path)

        if background and self._writer is not None:
            snapshot = host_snapshot(checkpoint)  # the live tensors change with the next step
            self._writer.submit(path.name, lambda: write(snapshot))
        else:
            self.finish()
            write(checkpoint)
        return path

    def _save_dcp(
        self,
        path: Path,
        checkpoint: dict[str, Any],
        shard: dict[str, Any] | None,
        background: bool,
        then: Callable[[Path], None] | None,
    ) -> Path:
        """:meth:`save` in the DCP format: planned together, written by every rank (in its writer
        thread, for a background save), made visible by rank 0 (:class:`.dcp.DcpWrite`)."""
        pg = self.process_group
        if shard is not None:  # each rank's own elements, in place of the gathered state
            checkpoint["optimizer"] = sharded_optimizer_entry(pg, checkpoint["optimizer"], shard)
        background = background and self._writer is not None
        if not background:
            self.finish()
        planned = plan_dcp(path, checkpoint, pg)
        step, main = self.state.step, self.is_main

        def committed() -> None:
            log.info("checkpoint saved: %s (step %d%s)", path, step, ", in the background" if background else "")
            if then is not None:
                then(path)

        if background:
            planned.snapshot()  # the live tensors change with the next step
            rank, world_size, timeout_s = pg.rank(), pg.size(), pg.timeout.total_seconds()
            self._writer.submit(
                path.name, lambda: _write_dcp_in_background(planned, rank, world_size, timeout_s, committed)
            )
            return path
        everyone = all_gather_object(pg, planned.write())
        if main:
            planned.commit(everyone)
            committed()
        return path

    def finish(self) -> None:
        """Wait for the background save in flight, if any (a no-op without one). The fit
        calls it before it ends, stops for a signal, or rebuilds for a new group.

        Raises:
            CheckpointError: that save failed, naming the file and the cause.
        """
        if self._writer is not None:
            self._writer.wait()

    def keep_step_checkpoints(self, directory: str | Path | None = None, keep_last: int = 0) -> None:
        """Where the step checkpoints go (``None``: the run's ``checkpoints/``) and how many of them
        stay (0: all). :class:`~ddptrain.trainer.CheckpointCallback` sets them at the start of a
        fit; the checkpoint taken at a stop follows them."""
        self.steps_dir = self.run_dir.checkpoints if directory is None else Path(directory)
        self.keep_last = keep_last

    def save_step(self) -> Path | None:
        """The current step's checkpoint, ``<steps_dir>/step_<step>.pt`` (collective).

        Skipped (``None``) when the current state is already in a file (:attr:`last_saved`: this
        position was saved, or resumed from). Rank 0 verifies the file on disk, then deletes
        the older ones beyond ``keep_last``: a failed write never costs the previous checkpoint.
        """
        position = self.state.position()
        if self.last_saved is not None and self._saved_position == position:
            return None
        steps_dir, keep_last = self.steps_dir, self.keep_last

        def keep_newest(written: Path) -> None:
            load_checkpoint(written)  # verify what reached the disk before deleting anything older
            for old in prune_checkpoints(steps_dir, keep_last):
                _files_log.debug("deleted old checkpoint %s", old)

        path = self.save(steps_dir / checkpoint_name(self.state.step, self.format), background=True, then=keep_newest)
        self.last_saved, self._saved_position = path, position
        return path

    def save_at_stop(self) -> Path:
        """The checkpoint of a run stopped by a signal (collective): the current step's, written
        unless the state is already in a file; the path either way, so a stopped run always
        leaves something to resume from."""
        written = self.save_step()
        self.finish()  # the process ends next: the file must be whole
        return self.last_saved if written is None else written

    def save_best(self, directory: str | Path, monitor: dict[str, Any]) -> Path:
        """The current step's checkpoint as a best one, ``<directory>/step_<step>.pt`` with
        ``monitor`` (``{"name", "mode", "value"}``) inside (collective). Rank 0 verifies it on disk
        before returning, so the caller may then delete the one it pushes out (:meth:`delete`)."""
        path = self.save(Path(directory) / checkpoint_name(self.state.step, self.format), extra={"monitor": monitor})
        if self.is_main:
            load_checkpoint(path)  # verify what reached the disk before anything is deleted
        return path

    @staticmethod
    def best_on_disk(directory: str | Path) -> list[tuple[Path, int, dict[str, Any] | None]]:
        """``(path, step, monitor entry or None)`` of each checkpoint in a best directory, by step
        (reads no tensor). What a resumed run's ranking starts from."""
        return [(path, load_step(path), monitor_entry(path)) for path in list_checkpoints(directory)]

    @staticmethod
    def delete(path: str | Path) -> None:
        """Delete a checkpoint and its digest (rank 0; either may already be gone)."""
        remove_checkpoint(path)

    # == resuming =================================================================================
    def resume_if_asked(self) -> bool:
        """Resume from ``trainer.resume``, or from the latest checkpoint after a torchrun restart;
        failing that (nothing to resume), start from ``trainer.init_from``'s weights if set."""
        resume = self.config.trainer.resume or elastic_restart_resume()
        if resume and self.resume(resume):
            return True
        init_from = self.config.trainer.init_from
        return self.init_weights(init_from) if init_from else False

    def resolve(self, value: str, key: str = "trainer.resume") -> str | None:
        """The file ``value`` (``key``'s: a file, a directory, ``latest``, ``auto``, ``best``) means
        for this run, as rank 0 resolves it (:func:`.resolve.resolve_checkpoint`; collective)."""
        return agree_on_checkpoint(self.process_group, value, self.run_dir.checkpoints, key, self.config.recipe.name)

    def init_weights(self, source: str) -> bool:
        """Fine-tuning: load only the model weights of ``source`` (``trainer.init_from``: a file, a run
        or checkpoint directory, a ``best`` directory); the optimizer, schedule, step and data
        position start fresh. Every rank loads the same file."""
        path = self.resolve(source, "trainer.init_from")
        if path is None:
            raise CheckpointError(f"trainer.init_from={source}: there is no checkpoint to start from")
        checkpoint = self.load_agreed(path)
        try:
            self.model.load_state_dict(checkpoint["model"])
        except RuntimeError as exc:
            raise CheckpointError(
                f"trainer.init_from={source}: the weights in {path} do not fit this run's model "
                f"({' '.join(str(exc).split())}). init_from loads every parameter and buffer by name: build the "
                "same model (model.* / configure_model) as the run that wrote it."
            ) from None
        if self.is_main:
            log.info("weights from %s (step %d of its run); training starts at step 0", path, checkpoint["step"])
        return True

    def load_agreed(self, path: str | Path) -> dict[str, Any]:
        """The checkpoint at ``path`` (rank 0's answer, :meth:`resolve`), on every rank (collective).

        Each rank reads it from its own file system when every rank sees it; when some do not (a
        ``trainer.output_dir`` on each host's own disk: rank 0 wrote it where the others cannot
        read), rank 0 reads it and sends it to every rank, so a job on node-local storage resumes
        in place."""
        seen = all_gather_object(self.process_group, Path(path).exists())
        if all(seen):
            return load_checkpoint(path)
        if self.is_main:
            log.info(
                "checkpoint %s is not on the file system of rank(s) %s (node-local storage): rank 0 sends it",
                path,
                [r for r, found in enumerate(seen) if not found],
            )
        return broadcast_object(self.process_group, load_checkpoint(path) if self.is_main else None)

    def resume(self, resume: str) -> bool:
        """Continue from ``trainer.resume`` (a file, a directory, ``latest`` or ``best``); False if nothing to resume.

        Rank 0 picks the file and every rank loads it, so all agree (or all fail together).
        """
        path = self.resolve(resume, "trainer.resume")
        if path is None:
            if self.is_main:
                log.info(
                    "trainer.resume=auto: no checkpoint in %s yet; starting from scratch", self.run_dir.checkpoints
                )
            return False
        self.load_state_dict(self.load_agreed(path), path)
        self.last_saved, self._saved_position = Path(path), self.state.position()  # not rewritten by save_step
        if self.is_main:
            log.info("resumed from %s: step %d, epoch %d", path, self.state.step, self.state.epoch + 1)
        return True


def _stateful(callbacks: Sequence[Any]) -> dict[str, Any]:
    """The callbacks with a state to checkpoint, keyed by class name (``#n`` for the n-th repeat)."""
    found: dict[str, Any] = {}
    for callback in callbacks:
        if callable(getattr(callback, "state_dict", None)) and callable(getattr(callback, "load_state_dict", None)):
            name, n = type(callback).__qualname__, 1
            while (key := name if n == 1 else f"{name}#{n}") in found:
                n += 1
            found[key] = callback
    return found


def _write_dcp_in_background(
    planned: DcpWrite, rank: int, world_size: int, timeout_s: float, committed: Callable[[], None]
) -> None:
    """A writer thread's DCP save: write this rank's part and say so in the checkpoint's temporary
    directory; rank 0's thread then waits for every rank's word, commits, and calls ``committed``.
    The word travels through the file system, not a collective: the training thread owns those."""
    try:
        written = planned.write()
    except BaseException as exc:  # rank 0 must hear of it, not wait for the timeout; this thread fails too
        planned.publish(rank, exc)
        raise
    planned.publish(rank, written)
    if rank == 0:
        planned.commit(planned.gather_published(world_size, timeout_s))
        committed()
