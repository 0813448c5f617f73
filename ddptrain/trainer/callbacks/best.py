"""Best checkpoints: keep the top ``k`` by a monitored metric, in ``<checkpoints>/best/``.

Whenever the monitored metric is produced (an evaluation's ``eval/*``, a log point's ``train/*``,
an epoch's ``train/epoch_loss``, or anything else the trainer hands to ``on_log``,
``on_validation_end`` or ``on_epoch_end``), its value is offered to the ranking
(:class:`~ddptrain.trainer.topk.TopK`); a value that enters it is saved at once as
``best/step_<step>.pt`` with ``{"monitor": {"name", "mode", "value"}}`` inside the checkpoint,
and the checkpoint it pushes out is deleted. So the directory holds exactly the ``k`` best,
each carrying its value: ``trainer.resume=best`` and ``ddptrain.load_model(run, which="best")``
pick from it by that value. This callback keeps the ranking; writing, verifying and deleting the
files are the :class:`~ddptrain.trainer.checkpoint.Checkpointer`'s. The last checkpoints
(``keep_last``) are kept beside it, independently.

Rank 0 keeps the ranking (rebuilt from the files at the start of a fit, so a resumed run goes on
with its earlier best) and its decision to save is broadcast, so every rank saves together.
A monitor that the run never produces is a :class:`~ddptrain.config.ConfigError` naming it and
listing the metrics that were produced, raised at the first epoch end that saw an evaluation and
a log point, or at the end of the fit.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ...comm.objects import broadcast_object
from ...config import ConfigError
from ..topk import Ranked, TopK
from .base import Callback, EpochOrderedLines, TrainerView

__all__ = ["BestCheckpoints"]

log = logging.getLogger("ddptrain.checkpoint")


class BestCheckpoints(Callback):
    """Keep the ``save_top_k`` best checkpoints by ``monitor`` (Lightning's ``ModelCheckpoint(monitor=...)``).

    Args:
        monitor: the metric's name as the trainer reports it, e.g. ``eval/accuracy``, ``eval/loss``,
            ``train/loss``.
        mode: ``min`` (lower is better) or ``max``.
        save_top_k: how many best checkpoints to keep.
        directory: where they go (default: the run directory's ``checkpoints/best``).
    """

    def __init__(self, monitor: str, mode: str = "min", save_top_k: int = 1, directory: Path | None = None):
        self.monitor, self.mode, self.save_top_k = monitor, mode, save_top_k
        self.directory = None if directory is None else Path(directory)
        self.ranking = TopK(save_top_k, mode)  # validates mode and k now, not at the first evaluation
        self.lines = EpochOrderedLines(log)
        self._reset()

    def _reset(self) -> None:
        self.ranking = TopK(self.save_top_k, self.mode)
        self.produced: set[str] = set()
        self.seen = self.logged = False
        self._offered_step: int | None = None

    def on_fit_start(self, trainer: TrainerView) -> None:
        self._reset()
        if self.directory is None:
            self.directory = trainer.checkpointer.best_dir
        if trainer.is_main:
            self._load_standings(trainer)

    def _load_standings(self, trainer: TrainerView) -> None:
        """The ranking of the best checkpoints already on disk (a resumed run, a rerun in the same directory)."""
        for path, step, entry in trainer.checkpointer.best_on_disk(self.directory):
            if entry is None or (entry["name"], entry["mode"]) != (self.monitor, self.mode):
                log.warning(
                    "%s is not a best checkpoint of %s (%s); left out of the ranking", path, self.monitor, entry
                )
                continue
            value = float(entry["value"])
            if self.ranking.accepts(value, step):
                self._evict(trainer, self.ranking.add(Ranked(value, step, path)))
            else:
                self._evict(trainer, [Ranked(value, step, path)])

    def on_log(self, trainer: TrainerView, scalars: dict[str, float]) -> None:
        self.logged = True
        self._offer(trainer, scalars)

    def on_validation_end(self, trainer: TrainerView, metrics: dict[str, float]) -> None:
        self._offer(trainer, metrics)

    def on_epoch_end(self, trainer: TrainerView, epoch: int, metrics: dict[str, Any]) -> None:
        self._offer(trainer, metrics)
        self.lines.flush()  # after the epoch's line
        if self.logged and any(k.startswith("eval/") for k in metrics):
            self._check_produced()

    def on_fit_end(self, trainer: TrainerView, metrics: dict[str, Any]) -> None:
        self._check_produced()

    def _offer(self, trainer: TrainerView, metrics: dict[str, Any]) -> None:
        self.produced.update(metrics)
        if self.monitor not in metrics:
            return
        self.seen, step = True, trainer.state.step
        if self._offered_step == step:
            return  # the same evaluation, reported again at the epoch's end
        self._offered_step = step
        value = float(metrics[self.monitor])
        save = self.ranking.accepts(value, step) if trainer.is_main else False
        if trainer.world_size > 1:
            save = broadcast_object(trainer.process_group, save, 0)  # every rank saves, or none
        if save:
            self._save(trainer, value, step)

    def _save(self, trainer: TrainerView, value: float, step: int) -> None:
        entry = {"name": self.monitor, "mode": self.mode, "value": value}
        path = trainer.checkpointer.save_best(self.directory, entry)  # verified on disk
        if not trainer.is_main:
            return
        self._evict(trainer, self.ranking.add(Ranked(value, step, path)))
        kept = ", ".join(f"step {r.step}: {r.value:.6g}" for r in self.ranking.kept)
        self.lines.info(trainer, "best checkpoints by %s (%s): %s", self.monitor, self.mode, kept)

    def _evict(self, trainer: TrainerView, evicted: list[Ranked]) -> None:
        for old in evicted:
            trainer.checkpointer.delete(old.path)
            log.debug("deleted best checkpoint %s (%s=%s)", old.path, self.monitor, old.value)

    def _check_produced(self) -> None:
        if self.seen:
            return
        produced = ", ".join(sorted(k for k in self.produced if k not in ("epoch", "step"))) or "none yet"
        raise ConfigError(
            f"trainer.checkpoint.monitor={self.monitor!r} is never produced by this run, so no best "
            f"checkpoint can be kept. The metrics it produces: {produced}. Set trainer.checkpoint.monitor "
            "to one of them (eval/* come from validation_step, train/* from the log points), or unset it."
        )
