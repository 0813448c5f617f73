"""Command line: ``python -m ddptrain recipe=mnist [group=option ...] [key=value ...]``.

The same as the ``ddptrain`` console script. ``ddptrain doctor ...`` and ``ddptrain tune ...`` are
``python -m ddptrain.doctor ...`` and ``python -m ddptrain.tune ...``; ``ddptrain torchrun ...`` is
torchrun with ddptrain's exit on Ctrl-C (:mod:`ddptrain.launch.torchrun`).

The only package that imports Hydra: it checks the overrides against ddptrain's schema (a typo
gets "did you mean ...?"), composes ``conf/`` into a :class:`ddptrain.Config` and hands it to
:func:`ddptrain.trainer.run`.

* Plain invocation: the launching process picks Hydra's run directory (one for the whole job)
  and starts ``dist.world_size`` local workers, which all write there (rank 0 only, in fact).
* Under torchrun / mpirun / srun every process runs this command: rank 0 goes through Hydra
  (run directory, ``--cfg``...), the other ranks compose the same config and receive rank 0's
  directory once the process group is up.
* ``--cfg job`` prints the composed config, ``-m`` sweeps (one job after the other),
  ``--help`` lists the groups, ``--help KEY`` documents a key, a section or a group (``--help
  trainer.max_steps``, ``--help data``: name, type, default, meaning), ``--config-dir DIR`` adds
  your own recipes (``DIR/recipe/x.yaml``), ``--version`` prints ddptrain's and torch's versions.
  Modules named in the config (``recipe.trainer_class=mypkg.task.MyTrainer``) are imported from
  the working directory too.
* Start-up: ``--version``, ``--help``, ``--cfg`` and every configuration error answer without
  importing torch (about a second). A job that will start local workers starts a preloaded fork
  server (:mod:`ddptrain.launch.forkserver`) right after the overrides pass the schema check, so
  torch is imported there while this process composes the config, and the workers fork ready.
* A refused run leaves nothing behind: the run directory is resolved once before Hydra runs (and
  passed to it as ``hydra.run.dir``), so this process knows whether it creates it. If the run is
  then refused before any rank starts (exit 2, or a missing or corrupt checkpoint or dataset) and
  the directory holds only what the refusal wrote (``.hydra/``, ``train.log``), it is removed with
  the parents this run created (``outputs/<recipe>/``). A directory that existed before is never
  removed (``hydra.run.dir=<old run> trainer.resume=latest``).
  A fast dev run (``trainer.fast_dev_run``) that passes leaves nothing either: its files go to a
  temporary directory (:mod:`ddptrain.trainer.dev_run`), and its run directory is removed the same way.
* Ctrl-C while the job starts (before the ranks handle it) prints one line and exits 130.

Exit status: 0 done (stopped by ``trainer.max_time`` too); 1 the run failed (a rank raised or
died, data or checkpoint missing, smoke check failed); 2 bad configuration (nothing ran); 130
stopped by Ctrl-C (SIGINT), 143 by SIGTERM, after writing a checkpoint and printing the command
that resumes (an elastic job's workers under torchrun or srun exit 0 then: see ``_exit_status``).
Errors print one short message
on stderr; a failed rank's full traceback goes to ``<run dir>/error.log``
(``DDPTRAIN_FULL_ERROR=1`` shows Python's traceback instead).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import signal
import sys
from pathlib import Path
from typing import Any

from .. import envvars
from ..launch.signals import STOP_SIGNALS, StoppedBySignal, restore_signals, take_stop_signals
from ..rundir import LOG_FILE, RunDir

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


SUBCOMMANDS = {
    "doctor": "ddptrain.doctor.__main__",
    "tune": "ddptrain.tune.__main__",
    "torchrun": "ddptrain.launch.torchrun",
}
"""The module whose ``main(argv)`` runs ``ddptrain <name> argv...``."""


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``python -m ddptrain`` and of the ``ddptrain`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        import importlib

        importlib.import_module(SUBCOMMANDS[argv[0]]).main(argv[1:])
        return
    code = EXIT_FAILED
    # SIGTERM while starting ends like Ctrl-C does (one line, 143), not as a silent kill. Python
    # raises KeyboardInterrupt for SIGINT by itself; the job's own handlers take over both later.
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _raise_stopped)
    try:
        code = _main(argv)
    except KeyboardInterrupt as exc:  # Ctrl-C while starting, or a second one: one line, no traceback
        _ignore_stop_signals()  # stopping already: a late signal must not cut the cleanup short
        code = _interrupted(exc)
    except BrokenPipeError:  # `--help | head`: the reader left. Exit as a killed writer would, quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the flush at exit fails too
        code = 128 + signal.SIGPIPE
    finally:
        try:
            server = sys.modules.get("ddptrain.launch.forkserver")
            if server is not None:
                server.discard()  # idle: the job is done, or never came (refused config, mpiexec job)
        except KeyboardInterrupt as exc:
            _ignore_stop_signals()
            code = _interrupted(exc)
    sys.exit(code)


class _StopSignalsDeferred:
    """While active (a context manager), SIGINT/SIGTERM are noted, and raised as ``StoppedBySignal``
    at :meth:`release`: at the end of the block, or earlier, where the job starts. Raised inside
    torch's import, a ``KeyboardInterrupt`` crosses C++ code and aborts the process; raised inside
    OmegaConf or Hydra, it leaves their objects half-built (an ``AttributeError`` follows, exit 1,
    not 130). So the start-up runs their code with the signals deferred, up to the job."""

    def __enter__(self) -> _StopSignalsDeferred:
        self.noted: list[str] = []
        self._previous: dict | None = take_stop_signals(lambda n, _f: self.noted.append(signal.Signals(n).name))
        return self

    def release(self) -> None:
        """Signals act again from here; one noted meanwhile is raised now."""
        self._restore()
        if self.noted:
            raise StoppedBySignal(self.noted[0])

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.release()
        else:
            self._restore()  # an error is on its way out: it wins over a noted signal

    def _restore(self) -> None:
        if self._previous is not None:
            restore_signals(self._previous)
            self._previous = None


def _raise_stopped(signum: int, frame) -> None:
    raise StoppedBySignal(signal.Signals(signum).name)


def _ignore_stop_signals() -> None:
    """From here to the exit, SIGINT and SIGTERM change nothing: the exit status is decided, and an
    uncaught ``KeyboardInterrupt`` at shutdown would make Python end by SIGINT instead of 130."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def _main(argv: list[str]) -> int:
    if any(a in ("--version", "-V") for a in argv):
        print(version_line())
        return EXIT_OK
    from .overrides import free_form_keys_added

    argv = free_form_keys_added(argv)
    topic = _help_topic(argv)
    if topic is not None:
        return _print_topic(topic, argv)
    for name in envvars.unknown_variables():
        print(
            f"ddptrain: warning: {name} is set but ddptrain knows no such variable; see ddptrain.envvars",
            file=sys.stderr,
        )
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # the console script, like python -m, imports the user's modules
    from ..launch.env import detect_environment

    if any(a in ("--help", "-h") for a in argv) and not any(a in ("--hydra-help", "--cfg", "-c") for a in argv):
        return _print_help(argv)

    try:
        env = detect_environment()
    except ValueError as exc:
        return _error(f"the launcher environment is inconsistent: {exc}", EXIT_BAD_CONFIG)
    hydra_argv, fresh = list(argv), None
    # Hydra and OmegaConf code, ours and hydra.main's, cannot take a KeyboardInterrupt mid-way: a
    # signal waits for the job to start (or for a refusal, or the end of --cfg/--help).
    with _StopSignalsDeferred() as deferred:
        if not any(a in _INFO_FLAGS for a in argv):
            problem = _check_overrides(argv)
            if problem:
                return _error(problem, EXIT_BAD_CONFIG)
            if _launches_local_workers(argv, env):
                from ..launch import forkserver

                forkserver.start()  # imports torch in its own process while this one composes the config
            problem, run_dir = _check_composition(argv)
            if problem:
                return _error(problem, EXIT_BAD_CONFIG)
            if not any(a.split("=")[0] in _HYDRA_FLAGS for a in argv):  # a job will run (no --cfg, no -m)
                hydra_argv, fresh = _fix_run_dir(argv, run_dir)
                problem = _unwritable(fresh[0] if fresh else _named_run_dir(argv) or run_dir)
                if problem:
                    return _error(problem, EXIT_FAILED)
        if env.is_launched_externally() and env.rank != 0 and not any(a.split("=")[0] in _HYDRA_FLAGS for a in argv):
            return _run_other_rank(argv, deferred)  # ranks > 0: the same config, without a run directory of their own
        if any(a in ("--help", "-h") for a in argv) and not any(a.startswith("recipe=") for a in argv):
            hydra_argv.append("recipe=mnist")  # --help shows a composed config, and recipe has no default
        codes: list[int] = []
        from .app import run_hydra_main

        def task(cfg: Any, run_dir: str, sweep: bool) -> None:
            try:
                deferred.release()  # the job starts: from here a signal stops it (a noted one, now)
                code, keeps_nothing = _run_job(cfg, run_dir, sweep, argv)
            except KeyboardInterrupt:  # stopped while starting (later, the ranks stop with a checkpoint)
                if fresh is not None and not sweep:
                    _remove_empty_run_dir(Path(run_dir), fresh)  # Hydra's .hydra/ stub: nothing to resume
                raise
            if keeps_nothing and fresh is not None and not sweep:
                _remove_empty_run_dir(Path(run_dir), fresh)
            codes.append(code)

        run_hydra_main(hydra_argv, task)
    return max(codes, default=EXIT_OK)


def _print_help(argv: list[str]) -> int:
    """Plain ``--help`` (with any overrides): the help template, the groups, the composed config."""
    from .app import config_dirs, help_text
    from .overrides import group_options

    shown = argv if any(a.startswith("recipe=") for a in argv) else [*argv, "recipe=mnist"]  # recipe has no default
    try:
        print(help_text([a for a in shown if a not in ("--help", "-h")], group_options(config_dirs(argv))))
    except Exception as exc:  # noqa: BLE001 - Hydra's composition errors: a value of the wrong type...
        return _error(_hydra_message(exc), EXIT_BAD_CONFIG)
    return EXIT_OK


def _interrupted(exc: KeyboardInterrupt) -> int:
    """One line for a stop that came too early (or too hard) for a checkpoint; the exit status."""
    name = getattr(exc, "signal_name", "SIGINT")
    detail = str(exc) or "during start-up, before any rank trained: nothing to resume; run the command again"
    label = f"{name} (Ctrl-C)" if name == "SIGINT" else name
    print(f"ddptrain: stopped by {label}: {detail}", file=sys.stderr, flush=True)
    return EXIT_SIGTERM if name == "SIGTERM" else EXIT_SIGINT


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


def _help_topic(argv: list[str]) -> str | None:
    """``KEY`` of ``--help KEY`` (a key, a section or a group: ``trainer.max_steps``, ``data``)."""
    for flag, value in zip(argv, argv[1:]):
        if flag in ("--help", "-h") and not value.startswith("-") and "=" not in value:
            return value
    return None


def _print_topic(topic: str, argv: list[str]) -> int:
    import ddptrain.conf

    from .overrides import config_dirs_of, describe_topic, group_options

    options = group_options(config_dirs_of(argv, Path(ddptrain.conf.__file__).resolve().parent))
    text, problem = describe_topic(topic, options)
    if problem:
        return _error(f"{problem} (`python -m ddptrain --help` lists the groups)", EXIT_BAD_CONFIG)
    print(text)
    return EXIT_OK


def _check_overrides(argv: list[str]) -> str | None:
    """A bad override, unknown option or missing recipe, as a message: the schema's check, no Hydra."""
    import ddptrain.conf

    from .overrides import config_dirs_of, first_problem, group_options, override_tokens

    tokens = override_tokens(argv)
    options = group_options(config_dirs_of(argv, Path(ddptrain.conf.__file__).resolve().parent))
    problem = first_problem(tokens, options)
    if problem:
        return problem
    named_config = any(a in ("--config-name", "-cn") for a in argv)
    if not named_config and not any(t.split("=")[0].lstrip("+") == "recipe" for t in tokens):
        return (
            f"choose a recipe: recipe=<name>, one of {', '.join(options.get('recipe', []))} "
            "(or your own with --config-dir DIR holding recipe/<name>.yaml)"
        )
    return None


def _check_command_line(argv: list[str]) -> str | None:
    """A bad override, unknown option, missing recipe or a value Hydra refuses, as a message."""
    return _check_overrides(argv) or _check_composition(argv)[0]


def _launches_local_workers(argv: list[str], env: Any) -> bool:
    """Whether this command will most likely start local workers (then a fork server pays off)."""
    if env.is_launched_externally() or any(
        a.split("=")[0] in _HYDRA_FLAGS and a not in ("-m", "--multirun") for a in argv
    ):
        return False
    external = ("launcher=torchrun", "launcher=mpirun")  # refused here: no launcher of that name around
    return not any(t in ("backend=mpi", "dist.backend=mpi", *external) for t in argv)


def _check_composition(argv: list[str]) -> tuple[str | None, str | None]:
    """``(problem, run_dir)``: what Hydra refuses when composing (a value of the wrong type...), and
    the run directory the job will get, resolved now (None for sweeps)."""
    if any(a in ("-m", "--multirun") for a in argv):
        return None, None  # sweep values (a,b,c) are Hydra's to expand
    from .app import compose_config

    try:
        cfg = compose_config(argv, with_hydra=True)
        return None, str(cfg.hydra.run.dir)
    except Exception as exc:  # noqa: BLE001 - Hydra's composition errors: a value of the wrong type...
        return _hydra_message(exc), None


def _fix_run_dir(argv: list[str], run_dir: str | None) -> tuple[list[str], list[Path] | None]:
    """The arguments for Hydra with the run directory fixed to ``run_dir`` (resolved once, so this
    invocation knows whether it creates it); if it does not exist yet, it and its missing parents."""
    given = _named_run_dir(argv)
    if run_dir is None:
        return list(argv), None
    path = Path(run_dir if given is None else given).absolute()
    missing = [path, *(p for p in path.parents if not p.exists())]
    if path.exists():
        return list(argv), None
    quoted = run_dir.replace("\\", "\\\\").replace("'", "\\'")
    fixed = list(argv) if given is not None else [f"hydra.run.dir='{quoted}'", *argv]  # first: before any flag
    return fixed, missing


def _unwritable(run_dir: str | Path | None) -> str | None:
    """Why the run directory cannot be made or written (before Hydra makes any of it), or None."""
    if run_dir is None:
        return None
    path = Path(run_dir).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        why = f"{existing} is a file, not a directory"
    elif not os.access(existing, os.W_OK | os.X_OK):
        why = f"{existing} is not writable" + (" (a read-only file system)" if _read_only(existing) else "")
    else:
        return None
    return (
        f"cannot write the run directory {path}: {why}. Run from a directory you can write, or choose "
        "another with hydra.run.dir=<dir>"
    )


def _read_only(path: Path) -> bool:
    return bool(os.statvfs(path).f_flag & os.ST_RDONLY)


def _named_run_dir(argv: list[str]) -> str | None:
    """The run directory the command line names (``hydra.run.dir=``, the last one), or None."""
    from .overrides import override_tokens

    given = [t.split("=", 1)[1].strip("'\"") for t in override_tokens(argv) if t.startswith("hydra.run.dir=")]
    return given[-1] if given else None


def _remove_empty_run_dir(run_dir: Path, fresh: list[Path]) -> None:
    """Remove the run directory a refused run (a fast dev run, a Ctrl-C while starting) made, and
    its parents it made (``outputs/x/``), if it holds nothing but Hydra's ``.hydra/`` and ``train.log``."""
    run_dir = run_dir.absolute()
    if run_dir != fresh[0] or not run_dir.is_dir():
        return
    for path in run_dir.rglob("*"):
        relative = path.relative_to(run_dir)
        if path.is_file() and relative.parts[0] != ".hydra" and relative != Path(LOG_FILE):
            return  # something a user may need: leave it all
    import shutil

    shutil.rmtree(run_dir, ignore_errors=True)
    for parent in fresh[1:]:
        try:
            parent.rmdir()  # only if empty: another run may have started there meanwhile
        except OSError:
            break


def _hydra_message(exc: BaseException) -> str:
    """Hydra's composition error in one or two lines: what failed and why. A recipe file without
    its ``# @package _global_`` header gets that hint."""
    text = str(exc)
    lines = text.splitlines() or [type(exc).__name__]
    head = lines[0]
    if head.endswith(":") and len(lines) > 1:  # "In 'recipe/x': ConfigKeyError raised while composing config:"
        head = f"{head} {lines[1].strip()}"
    parts = [head]
    if exc.__cause__ is not None and str(exc.__cause__):
        parts.append(str(exc.__cause__).splitlines()[0])
    message = ": ".join(parts)
    from ..config import Config

    recipe = re.match(r"In 'recipe/([^']+)'", head)
    section = re.search(r"Key '(\w+)' not in 'RecipeConfig'", message)
    sections = {f.name for f in dataclasses.fields(Config)} - {"recipe"}
    if recipe and section and section.group(1) in sections:
        message += (
            f". recipe/{recipe.group(1)}.yaml sets the top-level section {section.group(1)}: make its first line "
            "'# @package _global_' (a recipe configures the whole run; without that header Hydra reads the "
            "file as the recipe section)"
        )
    return message


def _run_other_rank(argv: list[str], deferred: _StopSignalsDeferred) -> int:
    from .app import compose_config

    try:
        cfg = compose_config(argv)
    except Exception as exc:  # noqa: BLE001 - rank 0 reports the same problem in full
        return _error(_hydra_message(exc), EXIT_BAD_CONFIG)
    deferred.release()  # the job starts
    # Rank 0's run directory is the job's (the trainer agrees on it); but in an elastic job any
    # process may become rank 0, so a directory named on the command line is every rank's.
    return _run_job(cfg, _named_run_dir(argv), False, argv)[0]


def _run_job(cfg: Any, run_dir: str | None, sweep: bool, argv: list[str]) -> tuple[int, bool]:
    """Run one composed config: the exit status (see the module docstring), and whether the run is
    to leave no run directory: refused before any rank started (bad config, missing checkpoint or
    data), or a fast dev run that passed."""
    from ..launch.env import detect_environment

    if sweep and detect_environment().is_launched_externally():
        message = (
            "sweeps (-m) start their jobs one after the other on the local launcher; run them "
            "without torchrun/mpirun/srun, or launch one job per sweep point"
        )
        return _error(message, EXIT_BAD_CONFIG), True
    from ..config import ConfigError
    from .app import to_config

    full_error = envvars.get_flag("DDPTRAIN_FULL_ERROR") or os.environ.get("HYDRA_FULL_ERROR") == "1"
    env = detect_environment()
    # Raised by run() itself, not by a rank, these refuse the run before any rank starts (local launcher).
    before_start = not env.is_launched_externally()
    try:
        config = to_config(cfg, run_dir)
    except ConfigError as exc:
        if full_error:
            raise
        return _error(str(exc), EXIT_BAD_CONFIG), True
    with _StopSignalsDeferred():  # torch's C++ import code cannot take a KeyboardInterrupt
        from ..errors import CheckpointError, DatasetCorruptError, DatasetNotFoundError, SmokeCheckError
        from ..launch import LaunchTimeoutError, WorkerFailedError
        from ..runner import run
    try:
        metrics = run(config)
    except ConfigError as exc:  # what needs the job: a checkpoint to resume, the data, a plug-in
        if full_error:
            raise
        return _error(str(exc), EXIT_BAD_CONFIG), True
    except DatasetNotFoundError as exc:
        if full_error:
            raise
        explained = exc.explain("data.root=<dir>", "data.download=true", "data.download=false")
        return _error(explained, EXIT_FAILED), before_start
    except WorkerFailedError as exc:
        if full_error:
            raise
        message, _, tb = str(exc).partition("\n--- traceback")
        if config.trainer.fast_dev_run:
            message = f"fast_dev_run failed: {message}"
        where = _save_traceback(run_dir, exc.worker_traceback or tb)
        where_text = f"\n(full traceback of rank {exc.rank}: {where})" if where else ""
        return _error(message + where_text, EXIT_FAILED), False
    except (DatasetCorruptError, CheckpointError, SmokeCheckError, LaunchTimeoutError) as exc:
        if full_error:
            raise
        refused = before_start and isinstance(exc, (DatasetCorruptError, CheckpointError))
        return _error(f"{type(exc).__name__}: {exc}", EXIT_FAILED), refused
    if metrics is None:  # an elastic job's worker that the job finished without admitting
        return EXIT_OK, False
    dev_run_passed = bool(metrics.get("fast_dev_run"))
    code = _exit_status(metrics, elastic_under_a_launcher=config.trainer.elastic and env.is_launched_externally())
    if env.rank == 0:
        _print_summary(config, metrics, argv)
    return code, dev_run_passed


def _exit_status(metrics: dict[str, Any], elastic_under_a_launcher: bool = False) -> int:
    stopped_by = metrics.get("stopped_by")  # trainer.max_time: a normal end
    if elastic_under_a_launcher and stopped_by in ("SIGINT", "SIGTERM"):
        # The ranks stopped together, with a checkpoint, on one rank's signal. A worker of another
        # host saw no signal: a non-zero status would make its launcher (torchrun --max-restarts)
        # start it again into a job that has stopped. A launcher that got the signal exits by it.
        return EXIT_OK
    return {"SIGINT": EXIT_SIGINT, "SIGTERM": EXIT_SIGTERM, "dist.min_world_size": EXIT_FAILED}.get(stopped_by, EXIT_OK)


def _print_summary(config: Any, metrics: dict[str, Any], argv: list[str]) -> None:
    run_dir = config.trainer.output_dir
    dev_run = metrics.get("fast_dev_run")
    if dev_run:
        test = "and test " if dev_run["tested"] else ""
        loss = metrics.get("train/loss_last", float("nan"))
        print(
            f"ddptrain: fast_dev_run passed: {dev_run['batches']} batch(es) per rank of training, validation "
            f"{test}on {metrics.get('world_size')} rank(s) (train/loss={loss:.4g}); nothing was written",
            flush=True,
        )
        return
    if metrics.get("stopped_by"):
        # an elastic job that lost ranks below dist.min_world_size saved at a smaller world size
        if metrics["stopped_by"] == "dist.min_world_size":
            argv = [a for a in argv if not a.startswith("trainer.allow_world_size_change=")]
            argv = [*argv, "trainer.allow_world_size_change=true"]
        resume = _resume_command(argv, run_dir)
        saved = metrics.get("checkpoint") or "no checkpoint could be written"
        by = "trainer.max_time" if metrics["stopped_by"] == "max_time" else metrics["stopped_by"]
        print(
            f"ddptrain: stopped by {by} at step {metrics.get('step')} ({saved}). Resume with: {resume}",
            flush=True,
        )
        return
    keys = ("eval/accuracy", "eval/loss", "train/loss_last", "time/train_s", "time/fit_s")
    shown = " ".join(f"{k}={metrics[k]:.4g}" for k in keys if isinstance(metrics.get(k), float))
    # what is on disk, not what a run may write: a doctor-only run writes no checkpoints
    found = sorted(Path(run_dir).iterdir()) if run_dir and Path(run_dir).is_dir() else []
    outputs = ", ".join(p.name + "/" * p.is_dir() for p in found if not p.name.startswith(".")) or "nothing"
    print(
        f"ddptrain: recipe {config.recipe.name} finished on {metrics.get('world_size')} rank(s) at step "
        f"{metrics.get('step')} ({metrics.get('epoch')} epoch(s) complete): {shown}\n"
        f"ddptrain: outputs in {run_dir}: {outputs}",
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
    path = RunDir(output_dir).error_log
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError:
        return None
    return str(path)


def _error(message: str, code: int) -> int:
    print(f"ddptrain: error: {message}", file=sys.stderr, flush=True)
    return code
