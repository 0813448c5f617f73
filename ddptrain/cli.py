"""Command line: ``python -m ddptrain recipe=mnist [group=option ...] [key=value ...]``.

The only module that imports Hydra or OmegaConf: it composes ``conf/`` into a plain dictionary,
turns it into a :class:`ddptrain.Config` and hands it to :func:`ddptrain.trainer.run`.

* Plain invocation: the launching process picks Hydra's run directory (one for the whole job)
  and starts ``dist.world_size`` local workers, which all write there (rank 0 only, in fact).
* Under torchrun / mpirun / srun every process runs this command: rank 0 goes through Hydra
  (run directory, logs, ``--cfg``...), the other ranks only compose the same config and receive
  rank 0's directory once the process group is up.
* ``--cfg job`` prints the composed config, ``-m`` sweeps (one job after the other, each with
  its own directory), ``--help`` lists the groups.

Errors end the command with one short message on stderr and a non-zero status (2 for a bad
configuration, 1 for a failed run); a failed rank's full traceback goes to ``<run dir>/error.log``.
Set ``DDPTRAIN_FULL_ERROR=1`` to get Python's traceback instead.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from . import envvars
from .launch.env import detect_environment
from .launch.spawn import LaunchTimeoutError, WorkerFailedError

_PROJECT_ROOT = Path(__file__).resolve().parent.parent
CONF_DIR = _PROJECT_ROOT / "conf"
# Flags that make Hydra print something and exit (or sweep): every rank lets Hydra handle them.
_HYDRA_FLAGS = (
    "--cfg",
    "-c",
    "--help",
    "-h",
    "--hydra-help",
    "--info",
    "-i",
    "--multirun",
    "-m",
    "--version",
    "--resolve",
    "--package",
    "-p",
    "--shell-completion",
    "-sc",
)

_exit_codes: list[int] = []


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``python -m ddptrain`` and of the ``ddptrain`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    for name in envvars.unknown_variables():
        print(
            f"ddptrain: warning: {name} is set but ddptrain knows no such variable; see ddptrain.envvars",
            file=sys.stderr,
        )
    _make_recipes_importable()
    try:
        env = detect_environment()
    except ValueError as exc:
        _print_error(f"the launcher environment is inconsistent: {exc}")
        sys.exit(2)
    if env.is_launched_externally() and env.rank != 0 and not any(a.split("=")[0] in _HYDRA_FLAGS for a in argv):
        sys.exit(_run_composed(argv))
    if any(a in ("--help", "-h") for a in argv) and not any(a.startswith("recipe=") for a in argv):
        argv.append("recipe=mnist")  # --help shows a composed config, and recipe has no default
    sys.argv = [sys.argv[0], *argv]
    hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")(_hydra_task)()
    sys.exit(max(_exit_codes, default=0))


def _make_recipes_importable() -> None:
    # recipes/ sits next to conf/ in the project; the console script may run from anywhere.
    if (_PROJECT_ROOT / "recipes").is_dir() and str(_PROJECT_ROOT) not in sys.path:
        sys.path.append(str(_PROJECT_ROOT))


def _hydra_task(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.MULTIRUN and detect_environment().is_launched_externally():
        _print_error(
            "sweeps (-m) start their jobs one after the other on the local launcher; run them "
            "without torchrun/mpirun/srun, or launch one job per sweep point"
        )
        _exit_codes.append(2)
        return
    _exit_codes.append(_run_config(cfg, hydra_cfg.runtime.output_dir))


def _run_composed(argv: list[str]) -> int:
    """Ranks > 0 under an external launcher: the same config, without a run directory of their own."""
    from hydra import compose, initialize_config_dir

    overrides = [a for a in argv if not a.lstrip("+~").startswith(("hydra.", "hydra/"))]
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="ddptrain"):
            cfg = compose(config_name="config", overrides=overrides)
    except Exception as exc:  # Hydra's composition errors name the bad group or key
        _print_error(str(exc))
        return 2
    return _run_config(cfg, None)


def _run_config(cfg: DictConfig, output_dir: str | None) -> int:
    """Run one composed config; the exit status (0 ok, 1 failed run, 2 bad configuration)."""
    # Imported here, not at the top: --help, --cfg and config errors then skip importing torch.
    from .data import DatasetCorruptError, DatasetNotFoundError
    from .trainer import CheckpointError, Config, ConfigError, SmokeCheckError, run

    user_errors = (DatasetNotFoundError, DatasetCorruptError, CheckpointError, SmokeCheckError, LaunchTimeoutError)
    full_error = envvars.get_flag("DDPTRAIN_FULL_ERROR") or os.environ.get("HYDRA_FULL_ERROR") == "1"
    try:
        data: dict[str, Any] = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
        data.pop("hydra", None)
        trainer = data.setdefault("trainer", {})
        if not trainer.get("output_dir") and output_dir:
            trainer["output_dir"] = output_dir
        config = Config.from_dict(data)
        metrics = run(config)
    except ConfigError as exc:
        if full_error:
            raise
        _print_error(str(exc))
        return 2
    except WorkerFailedError as exc:
        if full_error:
            raise
        message, _, tb = str(exc).partition("\n--- traceback")
        where = _save_traceback(output_dir, exc.worker_traceback or tb)
        _print_error(message + (f"\n(full traceback of rank {exc.rank}: {where})" if where else ""))
        return 1
    except user_errors as exc:
        if full_error:
            raise
        _print_error(f"{type(exc).__name__}: {exc}")
        return 1
    if detect_environment().rank == 0:
        _print_summary(config, metrics)
    return 0


def _print_summary(config: Any, metrics: dict[str, Any]) -> None:
    keys = ("eval/accuracy", "eval/loss", "train/loss_last", "time/train_s", "time/fit_s")
    shown = " ".join(f"{k}={metrics[k]:.4g}" for k in keys if isinstance(metrics.get(k), float))
    print(
        f"ddptrain: recipe {config.recipe.name} finished on {metrics.get('world_size')} rank(s) at step "
        f"{metrics.get('step')} ({metrics.get('epoch')} epoch(s) complete): {shown}\n"
        f"ddptrain: output in {config.trainer.output_dir}",
        flush=True,
    )


def _save_traceback(output_dir: str | None, text: str) -> str | None:
    if not output_dir or not text:
        return None
    path = Path(output_dir) / "error.log"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError:
        return None
    return str(path)


def _print_error(message: str) -> None:
    print(f"ddptrain: error: {message}", file=sys.stderr, flush=True)
