"""One way to log, whatever started the process: the same line format on the console and in
``<run dir>/train.log``, the rank in every line.

:func:`setup_logging` is called once per process by whoever runs the job: each rank (local
workers, torchrun, mpirun, srun) and the launching process (``rank=None``, shown as
``launcher``). Rank 0 logs at INFO, other ranks only warnings; rank 0 and the launcher append to
``train.log``. An elastic job renumbers its ranks as members come and go: :func:`follow_rank`
then moves the stamp, the level and ``train.log`` with the number. A record logged with
``extra={"console": False}`` goes to the file only (the step lines, while a progress bar shows
the same on the terminal).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from .rundir import RunDir

__all__ = ["setup_logging", "follow_rank", "LOG_FORMAT"]

LOG_FORMAT = "[%(asctime)s][%(who)s][%(levelname)s] %(message)s"
_DATE_FORMAT = "%H:%M:%S"


class _Who(logging.Filter):
    """Stamps each record with the process's place in the job (``rank 0``, ``launcher``)."""

    def __init__(self, who: str):
        super().__init__()
        self.who = who

    def filter(self, record: logging.LogRecord) -> bool:
        record.who = self.who
        return True


class _ConsoleOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return getattr(record, "console", True)


def setup_logging(rank: int | None, output_dir: str | Path | None = None) -> None:
    """Configure the ``ddptrain`` logger for this process (again if called again).

    Args:
        rank: this process's global rank, or None for the launching process.
        output_dir: the run directory; rank 0 and the launcher append to its ``train.log``.
    """
    logger = logging.getLogger("ddptrain")
    for handler in [h for h in logger.handlers if getattr(h, "_ddptrain", False)]:
        logger.removeHandler(handler)
        handler.close()
    who = "launcher" if rank is None else f"rank {rank}"
    formatter = logging.Formatter(LOG_FORMAT, _DATE_FORMAT)
    console = logging.StreamHandler(sys.stdout)
    console.addFilter(_ConsoleOnly())
    handlers: list[logging.Handler] = [console]
    if output_dir is not None and rank in (None, 0):
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(RunDir(output_dir).log, mode="a"))
    for handler in handlers:
        handler._ddptrain = True  # type: ignore[attr-defined]
        handler.setFormatter(formatter)
        handler.addFilter(_Who(who))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO if rank in (None, 0) else logging.WARNING)
    logger.propagate = False  # one line per message, whatever the root logger does


def follow_rank(rank: int, output_dir: str | Path | None) -> None:
    """This process is rank ``rank`` now (an elastic job renumbered it): configure the ``ddptrain``
    logger for that rank, if :func:`setup_logging` configured it (a user's own setup is left alone)."""
    if any(getattr(h, "_ddptrain", False) for h in logging.getLogger("ddptrain").handlers):
        setup_logging(rank, output_dir)
