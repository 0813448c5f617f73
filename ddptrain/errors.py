"""The errors a user can meet before training starts, in a module that does not import torch.

The command line's launcher checks the data and the checkpoint to resume from in a process forked
from its preloaded server (:mod:`ddptrain.launch.forkserver`), so that it never imports torch
itself. These errors travel back to it pickled: their classes live here, where unpickling them
costs no torch import. They are also importable from where they are raised (``ddptrain.data``,
``ddptrain.trainer``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .config import ConfigError

__all__ = [
    "DatasetNotFoundError",
    "DatasetCorruptError",
    "CheckpointError",
    "CheckpointWarning",
    "NothingToResumeError",
    "SmokeCheckError",
    "DATA_SOURCES_ENV",
]

DATA_SOURCES_ENV = "DDPTRAIN_DATA_SOURCES"
"""The variable listing directories that hold datasets' files (read by :mod:`ddptrain.data`)."""


class DatasetNotFoundError(FileNotFoundError):
    """The dataset's files are neither in the data root nor in any source, nor downloaded.

    ``str(error)`` speaks Python (``root=``, ``download=True``); :meth:`explain` words the same
    facts with another interface's knobs (the command line's ``data.root=``...).

    Attributes:
        dataset: the dataset's name. files: the four file names. raw_dir: where they belong.
        searched: existing directories searched. skipped: sources holding another dataset.
        download_error: why the download failed, or None if none was attempted.
    """

    def __init__(
        self,
        dataset: str,
        files: Sequence[str],
        raw_dir: Path,
        searched: Sequence[Path],
        skipped: Sequence[str] = (),
        download_error: str | None = None,
        apt_hint: str = "",
    ):
        self.dataset, self.files, self.raw_dir = dataset, list(files), Path(raw_dir)
        self.searched, self.skipped = list(searched), list(skipped)
        self.download_error, self.apt_hint = download_error, apt_hint
        super().__init__(self.explain())

    def __reduce__(self):  # pickled as its fields (the launcher gets it from the process that checked)
        fields = (self.dataset, self.files, self.raw_dir, self.searched, self.skipped, self.download_error)
        return type(self), (*fields, self.apt_hint)

    def explain(
        self,
        root_knob: str = "the root argument (default: $DDPTRAIN_DATA, else ./data)",
        download_knob: str = "download=True",
        forbid_knob: str = "",
    ) -> str:
        """The message, naming ``root_knob`` for the data root and ``download_knob`` for downloading."""
        if self.download_error is None:
            how = f"it was not downloaded ({download_knob} allows it on a machine with internet access)"
        else:
            how = f"the download failed ({self.download_error})" + (
                f"; {forbid_knob} forbids it" if forbid_knob else ""
            )
        lines = [
            f"{self.dataset} was not found and {how}. It needs the four files {', '.join(self.files)} "
            f"(or the same without .gz): put them in {self.raw_dir}/, or point {root_knob} at a directory "
            f"holding {self.raw_dir.parent.name}/raw/, or list directories holding them in ${DATA_SOURCES_ENV}.",
        ]
        if self.apt_hint:
            lines.append(self.apt_hint)
        lines.append(f"Searched: {', '.join(str(d) for d in self.searched) or 'no existing directory'}.")
        if self.skipped:
            lines.append("Skipped, another dataset: " + "; ".join(self.skipped))
        return "\n".join(lines)


class DatasetCorruptError(ValueError):
    """A dataset file exists but is truncated, corrupt, or holds another dataset."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, truncated, corrupt, or does not fit this run."""


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (e.g. corrupt) and an older one used instead, or cannot be verified."""


class NothingToResumeError(ConfigError, CheckpointError):
    """``trainer.resume=latest`` found no checkpoint to continue from (a configuration problem: rc 2)."""


class SmokeCheckError(RuntimeError):
    """``trainer.smoke_check``: the loss did not fall, or the ranks' parameters differ."""
