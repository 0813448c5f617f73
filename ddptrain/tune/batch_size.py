"""``python -m ddptrain.tune batch_size``: the largest per-rank batch that fits, as Lightning's
batch-size finder (``Tuner.scale_batch_size``, mode ``power``).

Each trial is a real job of the recipe on the local launcher: a fast dev run
(``trainer.fast_dev_run``: a few steps of training, one validation and one test batch, nothing
written) at a per-rank batch of 1, 2, 4, ... (the validation batch the same). A trial fits if
every rank finished and the largest peak resident memory of a rank (``memory/peak_rss_mb``, the
kernel's high-water mark) stayed under ``--max-memory-gb``. On CUDA a rank that runs out of memory
fails its trial; on CPU the operating system may kill the whole machine's work first, so the limit
is required there. The search stops at the first trial that does not fit, or after ``--max-trials``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from ..config import ConfigError
from ..launch import WorkerFailedError

__all__ = ["search", "trial_config"]


def trial_config(config: Any, per_rank: int, steps: int) -> Any:
    """``config`` as a trial runs it: ``per_rank`` samples per rank per micro-batch, ``steps``
    optimizer steps of a fast dev run."""
    world = config.dist.world_size
    data = dataclasses.replace(
        config.data,
        global_batch_size=per_rank * world * config.trainer.grad_accum_steps,
        eval_batch_size=per_rank,
    )
    trainer = dataclasses.replace(
        config.trainer, fast_dev_run=steps, progress="false", model_summary=False, output_dir=None
    )
    return dataclasses.replace(config, data=data, trainer=trainer)


def search(
    config: Any,
    run: Callable[[Any], dict[str, Any]],
    max_memory_gb: float | None,
    max_trials: int = 12,
    steps: int = 3,
    say: Callable[[str], None] = print,
) -> int | None:
    """The largest per-rank batch (a power of two) of ``config`` that fits: each trial is
    ``run(trial_config(...))`` (``ddptrain.run``), which fits when it finishes with every rank's
    peak resident memory under ``max_memory_gb`` (None: any; on CUDA a rank out of memory fails
    its trial). ``say`` gets one line per trial. None: not even a batch of 1 fits.

    Raises:
        ConfigError: no limit on CPU, where running out of memory kills processes instead of raising.
    """
    if max_memory_gb is None and config.trainer.device != "cuda":
        raise ConfigError(
            "on CPU give a memory limit, --max-memory-gb G (each rank's peak resident memory): "
            "running out of memory there kills processes instead of raising"
        )
    limit_mb = None if max_memory_gb is None else max_memory_gb * 1024
    fits = None
    for k in range(max_trials):
        per_rank = 2**k
        started = time.perf_counter()
        try:
            peak = float(run(trial_config(config, per_rank, steps))["memory/peak_rss_mb"])
            fit = limit_mb is None or peak <= limit_mb
            outcome = f"peak {peak:.0f} MB" + ("" if fit else f" > {limit_mb:.0f} MB")
        except WorkerFailedError as exc:
            fit, outcome = False, f"failed: {str(exc).splitlines()[0]}"
        say(f"  per-rank batch {per_rank:>5}: {outcome} ({time.perf_counter() - started:.1f} s)")
        if not fit:
            break
        fits = per_rank
    return fits
