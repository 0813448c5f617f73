"""Command line: ``python -m ddptrain recipe=mnist [group=option ...] [key=value ...]``.

The same as the ``ddptrain`` console script. The only package that imports Hydra: it checks
the overrides against ddptrain's schema (a typo gets "did you mean ...?"), composes ``conf/``
into a :class:`ddptrain.Config` and hands it to :func:`ddptrain.trainer.run`.

* Plain invocation: the launching process picks Hydra's run directory (one for the whole job)
  and starts ``dist.world_size`` local workers, which all write there (rank 0 only, in fact).
* Under torchrun / mpirun / srun every process runs this command: rank 0 goes through Hydra
  (run directory, ``--cfg``...), the other ranks compose the same config and receive rank 0's
  directory once the process group is up.
* ``--cfg job`` prints the composed config, ``-m`` sweeps (one job after the other),
  ``--help`` lists the groups, ``--config-dir DIR`` adds your own recipes (``DIR/recipe/x.yaml``),
  ``--version`` prints ddptrain's and torch's versions. Modules named in the config
  (``recipe.trainer_class=mypkg.task.MyTrainer``) are imported from the working directory too.

Exit status: 0 done; 1 the run failed (a rank raised or died, data or checkpoint missing, smoke
check failed); 2 bad configuration (nothing ran); 130 stopped by Ctrl-C (SIGINT), 143 by SIGTERM,
after writing a checkpoint and printing the command that resumes. Errors print one short message
on stderr; a failed rank's full traceback goes to ``<run dir>/error.log``
(``DDPTRAIN_FULL_ERROR=1`` shows Python's traceback instead).
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Any

from .. import envvars

__all__ = ["main", "EXIT_OK", "EXIT_FAILED", "EXIT_BAD_CONFIG", "EXIT_SIGINT", "EXIT_SIGTERM"]

EXIT_OK, EXIT_FAILED, EXIT_BAD_CONFIG, EXIT_SIGINT, EXIT_SIGTERM = 0, 1, 2, 130, 143
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
    "--resolve",
    "--package",
    "-p",
    "--shell-completion",
    "-sc",
)
_INFO_FLAGS = ("--help", "-h", "--hydra-help", "--info", "-i", "--shell-completion", "-sc")


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``python -m ddptrain`` and of the ``ddptrain`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("--version", "-V") for a in argv):
        print(version_line())
        sys.exit(EXIT_OK)
    for name in envvars.unknown_variables():
        print(
            f"ddptrain: warning: {name} is set but ddptrain knows no such variable; see ddptrain.envvars",
            file=sys.stderr,
        )
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # the console script, like python -m, imports the user's modules
    from ..launch.env import detect_environment

    try:
        env = detect_environment()
    except ValueError as exc:
        sys.exit(_error(f"the launcher environment is inconsistent: {exc}", EXIT_BAD_CONFIG))
    if not any(a in _INFO_FLAGS for a in argv):
        problem = _check_command_line(argv)
        if problem:
            sys.exit(_error(problem, EXIT_BAD_CONFIG))
    if env.is_launched_externally() and env.rank != 0 and not any(a.split("=")[0] in _HYDRA_FLAGS for a in argv):
        sys.exit(_run_other_rank(argv))  # ranks > 0: the same config, without a run directory of their own
    if any(a in ("--help", "-h") for a in argv) and not any(a.startswith("recipe=") for a in argv):
        argv.append("recipe=mnist")  # --help shows a composed config, and recipe has no default
    codes: list[int] = []
    from .app import run_hydra_main

    run_hydra_main(argv, lambda cfg, run_dir, sweep: codes.append(_run_job(cfg, run_dir, sweep, argv)))
    sys.exit(max(codes, default=EXIT_OK))


def version_line() -> str:
    """``ddptrain X (torch Y, Python Z)``, read from the installed packages."""
    from importlib.metadata import PackageNotFoundError, version

    import ddptrain

    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = "not installed"
    python = ".".join(map(str, sys.version_info[:3]))
    return f"ddptrain {ddptrain.__version__} (torch {torch_version}, Python {python})"


def _check_command_line(argv: list[str]) -> str | None:
    """A bad override, unknown option or missing recipe, as a message; checked before Hydra runs."""
    from .app import compose_config, config_dirs
    from .overrides import first_problem, group_options, override_tokens

    tokens, options = override_tokens(argv), group_options(config_dirs(argv))
    problem = first_problem(tokens, options)
    if problem:
        return problem
    named_config = any(a in ("--config-name", "-cn") for a in argv)
    if not named_config and not any(t.split("=")[0].lstrip("+") == "recipe" for t in tokens):
        return (
            f"choose a recipe: recipe=<name>, one of {', '.join(options.get('recipe', []))} "
            "(or your own with --config-dir DIR holding recipe/<name>.yaml)"
        )
    if any(a in ("-m", "--multirun") for a in argv):
        return None  # sweep values (a,b,c) are Hydra's to expand
    try:
        compose_config(argv)
    except Exception as exc:  # noqa: BLE001 - Hydra's composition errors: a value of the wrong type...
        return _hydra_message(exc)
    return None


def _hydra_message(exc: BaseException) -> str:
    """Hydra's composition error in one or two lines: what failed and why."""
    lines = [str(exc).splitlines()[0]] if str(exc) else [type(exc).__name__]
    if exc.__cause__ is not None and str(exc.__cause__):
        lines.append(str(exc.__cause__).splitlines()[0])
    return ": ".join(lines)


def _run_other_rank(argv: list[str]) -> int:
    from .app import compose_config

    try:
        cfg = compose_config(argv)
    except Exception as exc:  # noqa: BLE001 - rank 0 reports the same problem in full
        return _error(_hydra_message(exc), EXIT_BAD_CONFIG)
    return _run_job(cfg, None, False, argv)


def _run_job(cfg: Any, run_dir: str | None, sweep: bool, argv: list[str]) -> int:
    """Run one composed config; the exit status (see the module docstring)."""
    from ..launch.env import detect_environment

    if sweep and detect_environment().is_launched_externally():
        return _error(
            "sweeps (-m) start their jobs one after the other on the local launcher; run them "
            "without torchrun/mpirun/srun, or launch one job per sweep point",
            EXIT_BAD_CONFIG,
        )
    # Imported here: --help, --cfg and configuration errors then answer without importing torch.
    from ..config import ConfigError
    from ..data import DatasetCorruptError, DatasetNotFoundError
    from ..launch import LaunchTimeoutError, WorkerFailedError
    from ..trainer import CheckpointError, SmokeCheckError, run
    from .app import to_config

    full_error = envvars.get_flag("DDPTRAIN_FULL_ERROR") or os.environ.get("HYDRA_FULL_ERROR") == "1"
    try:
        config = to_config(cfg, run_dir)
        metrics = run(config)
    except ConfigError as exc:
        if full_error:
            raise
        return _error(str(exc), EXIT_BAD_CONFIG)
    except DatasetNotFoundError as exc:
        if full_error:
            raise
        return _error(exc.explain("data.root=<dir>", "data.download=true", "data.download=false"), EXIT_FAILED)
    except WorkerFailedError as exc:
        if full_error:
            raise
        message, _, tb = str(exc).partition("\n--- traceback")
        where = _save_traceback(run_dir, exc.worker_traceback or tb)
        return _error(message + (f"\n(full traceback of rank {exc.rank}: {where})" if where else ""), EXIT_FAILED)
    except (DatasetCorruptError, CheckpointError, SmokeCheckError, LaunchTimeoutError) as exc:
        if full_error:
            raise
        return _error(f"{type(exc).__name__}: {exc}", EXIT_FAILED)
    if detect_environment().rank != 0:
        return _exit_status(metrics)
    _print_summary(config, metrics, argv)
    return _exit_status(metrics)


def _exit_status(metrics: dict[str, Any]) -> int:
    stopped_by = metrics.get("stopped_by")
    return {"SIGINT": EXIT_SIGINT, "SIGTERM": EXIT_SIGTERM}.get(stopped_by, EXIT_OK)


def _print_summary(config: Any, metrics: dict[str, Any], argv: list[str]) -> None:
    run_dir = config.trainer.output_dir
    if metrics.get("stopped_by"):
        resume = _resume_command(argv, run_dir)
        saved = metrics.get("checkpoint") or "no checkpoint could be written"
        print(
            f"ddptrain: stopped by {metrics['stopped_by']} at step {metrics.get('step')} ({saved}). "
            f"Resume with: {resume}",
            flush=True,
        )
        return
    keys = ("eval/accuracy", "eval/loss", "train/loss_last", "time/train_s", "time/fit_s")
    shown = " ".join(f"{k}={metrics[k]:.4g}" for k in keys if isinstance(metrics.get(k), float))
    print(
        f"ddptrain: recipe {config.recipe.name} finished on {metrics.get('world_size')} rank(s) at step "
        f"{metrics.get('step')} ({metrics.get('epoch')} epoch(s) complete): {shown}\n"
        f"ddptrain: outputs (checkpoints, metrics.json, train.log, tensorboard/) in {run_dir}",
        flush=True,
    )


def _resume_command(args: list[str], run_dir: str) -> str:
    """The exact command that continues this run: the console script or ``<python> -m ddptrain``
    with the same arguments and ``trainer.resume``; under torchrun/mpirun/srun only the arguments
    (the launch command around them is the user's to repeat)."""
    from ..launch.env import detect_environment

    kept = [a for a in args if not a.startswith(("trainer.resume=", "hydra.run.dir="))]
    arguments = [*kept, f"trainer.resume={run_dir}"]
    if detect_environment().is_launched_externally():
        return "the same launch command with the arguments " + shlex.join(arguments)
    program = ["ddptrain"] if Path(sys.argv[0]).name == "ddptrain" else [sys.executable, "-m", "ddptrain"]
    return shlex.join(program + arguments)


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


def _error(message: str, code: int) -> int:
    print(f"ddptrain: error: {message}", file=sys.stderr, flush=True)
    return code
