"""Running a whole job from a :class:`Config`: spawn local ranks, or be one rank of an external launch.

``run(config)`` is what ``python -m ddptrain`` calls after composing the config; Python users can
call it too. Before any worker starts it checks everything it can (config, device, data, the
checkpoint to resume from), so a mistake costs a second and prints one error instead of one
traceback per rank.

The local launcher itself never imports torch: it only starts, watches and restarts processes.
The checks that need torch (the trainer class, the data, the checkpoint) run in one short-lived
process forked from the server that will fork the workers (:func:`prepare_job`), as soon as the
server has imported what they need (it imports the rest of its preload meanwhile). Their verdict
comes back pickled (the errors live in :mod:`ddptrain.errors`, which imports no torch). That
saves a second of CPU per run, and the launcher's memory stays small.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

from . import envvars
from .config import Config, ConfigError, default_output_dir
from .launch import MpiexecNotFoundError, WorkerFailedError, forkserver, launch
from .launch.env import ClusterEnvironment, detect_environment, threads_per_rank
from .launch.spawn import spawn_elastic, spawn_workers
from .logs import setup_logging
from .modes.builtin import ELASTIC_REFUSES_MPI
from .objects import locate
from .preflight import check_device, job_world_size, resolve_backend, validate
from .rundir import RunDir

__all__ = ["run", "prepare_job", "load_trainer_class", "plugin_callbacks"]

_log = logging.getLogger("ddptrain.runner")

_EXPECTED_ENV = {
    "torchrun": ("torchrun", "torchrun --nproc-per-node=2 -m ddptrain recipe=mnist launcher=torchrun"),
    "mpirun": (
        "mpi",
        "mpirun -n 2 -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT=29500 "
        ".venv/bin/python -m ddptrain recipe=mnist launcher=mpirun",
    ),
}


def load_trainer_class(config: Config) -> type:
    """The ``Trainer`` subclass named by ``recipe.trainer_class``."""
    from .trainer import Trainer

    cls = locate(config.recipe.trainer_class, "recipe.trainer_class")
    if not (isinstance(cls, type) and issubclass(cls, Trainer)):
        raise ConfigError(
            f"recipe.trainer_class={config.recipe.trainer_class} is {cls!r}, not a subclass of ddptrain.Trainer"
        )
    return cls


def run(config: Config) -> dict[str, Any] | None:
    """Run the job described by ``config``; rank 0's final metrics (``None``: a worker of an
    elastic job that finished without admitting it).

    Under torchrun, mpirun or srun this process is one rank: it trains in place. Otherwise
    (``launcher=local``) it starts ``dist.world_size`` worker processes on this machine and waits.

    Raises:
        ConfigError: bad configuration, wrong launcher, missing device.
        DatasetNotFoundError, CheckpointError: found before any worker starts.
        ddptrain.launch.WorkerFailedError: a rank failed (its message and traceback included).
    """
    env = detect_environment()
    if env.is_launched_externally():
        from .trainer.dev_run import dev_run_config

        cls = load_trainer_class(config)
        config = dev_run_config(config)
        _check_launcher(config, env)
        validate(config, job_world_size(config, env.world_size), None)  # the device: as the rank joins
        cls.prepare_data(config)  # every rank: dataset caches are written atomically
        return (_run_elastic_rank if config.trainer.elastic else _run_rank)(env.rank, env.world_size, config)
    if config.launcher.name != "local":
        name = config.launcher.name
        raise ConfigError(
            f"launcher={name}, but this process was not started by {name} (no {_EXPECTED_ENV[name][0]} "
            f"environment found). Start it as: {_EXPECTED_ENV[name][1]}; or use launcher=local "
            "to spawn the workers here."
        )
    if config.dist.elastic_store:
        raise ConfigError(
            f"dist.elastic_store={config.dist.elastic_store}, but this process was not started by another launcher: "
            "the local launcher serves the elastic job's store itself. Drop dist.elastic_store, or start the workers "
            "with torchrun (one per host, --nnodes=1) or srun"
        )
    # The config's own rules here, torch-free, before any fork; the device in prepare_job's checker.
    validate(config, config.dist.world_size, None)
    config = _checked_in_a_preloaded_process(config)
    setup_logging(None, config.trainer.output_dir)  # the launcher's own lines (restarts) in the same log
    if config.trainer.elastic:  # a lost worker is restarted alone, and rejoins the others
        return next(r for r in _start_elastic_workers(config) if r is not None)
    restarts = 0
    while True:
        try:
            return _start_workers(config, config.dist.world_size)[0]
        except WorkerFailedError as exc:
            if restarts >= config.launcher.max_restarts:
                raise
            restarts += 1
            config = _resume_from_latest(config)
            _log.warning(
                "rank %d failed (%s); restart %d of %d, resuming from %s",
                exc.rank,
                str(exc).splitlines()[0],
                restarts,
                config.launcher.max_restarts,
                config.trainer.resume or "the start (no checkpoint yet)",
            )


def prepare_job(config: Config) -> Config:
    """Everything the local launcher checks and prepares before it starts the workers, past the
    config's own rules (:func:`run` validated it); the config the workers get
    (``trainer.fast_dev_run``'s limits, the run directory filled in).

    Loads the trainer class and the model's class (a typo fails here, once, not once per rank),
    checks the device and the checkpoint to resume from, and runs the trainer's ``prepare_data``
    (decompression and missing files surface before any rank starts).
    """
    from .trainer.dev_run import dev_run_config

    cls = load_trainer_class(config)
    # trainer.fast_dev_run: its limits and one temporary output directory for the launcher and every
    # local rank (the ranks delete it when they pass)
    config = dev_run_config(config)
    if not config.trainer.output_dir:  # one directory for the launcher and every worker
        config = dataclasses.replace(
            config, trainer=dataclasses.replace(config.trainer, output_dir=default_output_dir(config))
        )
    setup_logging(None, config.trainer.output_dir)  # what the checks log goes to the run's log too
    world_size = config.dist.world_size
    check_device(config, world_size)
    if config.model.get("_target_"):
        locate(config.model["_target_"], "model._target_")
    from .trainer.checkpoint import preflight_resume

    preflight_resume(config, world_size)
    cls.prepare_data(config)
    return config


class _RemoteTraceback(Exception):
    """The traceback of an error raised in the process that ran :func:`prepare_job` (shown as the
    cause of the same error re-raised in the launcher)."""

    def __str__(self) -> str:
        return self.args[0]


def _prepare_job_and_report(rank: int, world_size: int, config: Config) -> tuple:
    """In the forked checker: ``("ok", config)``, or ``("error", exception, traceback text)``.
    Errors are returned, not raised, so that the launcher raises the same exception (a
    ``ConfigError`` is a refusal with rc 2, not a failed rank)."""
    import traceback

    try:
        return "ok", prepare_job(config)
    except Exception as exc:  # noqa: BLE001 - every refusal goes back to the launcher as itself
        return "error", exc, traceback.format_exc()


def _checked_in_a_preloaded_process(config: Config) -> Config:
    """:func:`prepare_job` in a process forked from the preloaded server (see the module
    docstring), or here where no server can run (not Linux)."""
    if not forkserver.available():
        return prepare_job(config)
    outcome = spawn_workers(_prepare_job_and_report, 1, args=(config,), threads=1, needs=forkserver.CHECKS)[0]
    if resolve_backend(config, "local") == "mpi":
        forkserver.discard()  # mpiexec starts the ranks: the idle server would only hold memory
    if outcome[0] == "ok":
        return outcome[1]
    _, exc, remote = outcome
    raise exc from _RemoteTraceback(remote)


def _resume_from_latest(config: Config) -> Config:
    """The config of a restart: resume from this run's newest valid checkpoint, if it has one."""
    from .trainer.checkpoint import resume_after_restart

    resume = resume_after_restart(RunDir(config.trainer.output_dir or "."))
    if resume is None:
        return config  # nothing written yet: start again as the first attempt did
    return dataclasses.replace(config, trainer=dataclasses.replace(config.trainer, resume=resume))


def _start_workers(config: Config, world_size: int) -> list:
    """Every local rank's final metrics. ``launch`` decides how the ranks start (``mpiexec`` for
    backend mpi); each rank joins its process group itself, in the trainer."""
    try:
        return launch(
            _run_rank,
            world_size,
            args=(config,),
            backend=resolve_backend(config, "local"),
            join_group=False,
            timeout_s=config.dist.job_timeout_s,
            threads_per_worker=config.dist.threads_per_worker or None,
            env={"DDPTRAIN_LEDGER_DIR": ledger_dir(config)},
        )
    except MpiexecNotFoundError as exc:
        raise ConfigError(f"dist.backend=mpi: {exc}") from None


def _start_elastic_workers(config: Config) -> list:
    """The final metrics of the workers of an elastic job (``trainer.elastic``), which finish
    together whatever the membership did (the same on each); ``None`` for a spare or a restarted
    worker that the job ended without admitting."""
    world_size = config.dist.world_size + config.launcher.spares  # the spares start, load their data and wait
    return spawn_elastic(
        _run_elastic_rank,
        world_size,
        args=(config,),
        threads=threads_per_rank(world_size, config.dist.threads_per_worker or None),
        max_restarts=config.launcher.max_restarts,
        timeout_s=config.dist.job_timeout_s,
        env={"DDPTRAIN_LEDGER_DIR": ledger_dir(config)},
    )


def _check_launcher(config: Config, env: ClusterEnvironment) -> None:
    name = config.launcher.name
    if name != "local" and env.name != _EXPECTED_ENV[name][0]:
        raise ConfigError(
            f"launcher={name}, but this process was started by {env.name}; use launcher={env.name} "
            "or launcher=local (which accepts any external launcher)"
        )
    if config.trainer.elastic:
        _check_elastic_launcher(config, env)
        return
    if env.name == "mpi" and config.dist.world_size != env.world_size:
        # mpirun's -n and the config disagree: refuse rather than guess which one the user meant
        raise ConfigError(
            f"mpirun started {env.world_size} rank(s) but dist.world_size={config.dist.world_size}; "
            f"run `mpirun -n {config.dist.world_size} ...` or pass dist.world_size={env.world_size}"
        )
    if config.dist.world_size != env.world_size and env.rank == 0:
        logging.getLogger("ddptrain.runner").info(
            "%s started %d rank(s); dist.world_size=%d is ignored", env.name, env.world_size, config.dist.world_size
        )


def _check_elastic_launcher(config: Config, env: ClusterEnvironment) -> None:
    """An elastic job under another launcher: its store given, and each host's launcher on its own."""
    how = (
        "start `python -m ddptrain.store --host 0.0.0.0 --port 29400` on one host, then on each host "
        "`torchrun --nnodes=1 --nproc-per-node=N --max-restarts=R -m ddptrain ... trainer.elastic=true "
        "dist.elastic_store=HOST:29400 dist.world_size=<ranks of all hosts>`"
    )
    if env.name == "mpi":
        raise ConfigError(f"trainer.elastic=true cannot run under mpirun: {ELASTIC_REFUSES_MPI}")
    if not config.dist.elastic_store:
        raise ConfigError(
            f"trainer.elastic=true under {env.name} needs the job's store, which outlives every rank "
            f"(dist.elastic_store is not set): {how}"
        )
    if env.name == "torchrun" and env.world_size > env.local_world_size:  # its rendezvous spans hosts
        raise ConfigError(
            f"trainer.elastic=true under a torchrun of {env.world_size} ranks over several nodes: when one worker "
            "fails, torchrun restarts the workers of every node, the survivors included. Run one torchrun per "
            f"host with --nnodes=1, so each restarts only its own workers, and let the job's store join them: {how}"
        )


def ledger_dir(config: Config) -> str:
    """Where the ranks keep their collective ledgers: ``<run dir>/ledger``, unless
    ``DDPTRAIN_LEDGER_DIR`` says otherwise (``python -m ddptrain.dump <run dir>`` reads it)."""
    run_dir = config.trainer.output_dir or default_output_dir(config)
    return envvars.get_str("DDPTRAIN_LEDGER_DIR") or str(Path(run_dir) / "ledger")


def _run_rank(rank: int, world_size: int, config: Config) -> dict[str, Any]:
    """One rank's whole job (also the local workers' entry point)."""
    os.environ.setdefault("DDPTRAIN_LEDGER_DIR", ledger_dir(config))  # torchrun, mpirun: no launcher of ours
    setup_logging(rank, config.trainer.output_dir)
    return load_trainer_class(config)(config, callbacks=plugin_callbacks(config)).fit()


def _run_elastic_rank(slot: int, world_size: int, config: Config) -> dict[str, Any] | None:
    """One worker of an elastic job (the local launcher's slot ``slot``, or another launcher's
    rank): ``_run_rank``, or ``None`` when the job finished before this worker was admitted."""
    from .comm.elastic import JobFinished

    try:
        return _run_rank(slot, world_size, config)
    except JobFinished:
        return None


def plugin_callbacks(config: Config) -> list:
    """The callbacks whose work the config asks for (``trainer.doctor``, ``dist.bucket_cap_mb=auto``,
    ``trainer.lr_find``): the runner adds them; a ``fit()`` called by hand must get them too."""
    from .doctor.session import doctor_callbacks
    from .tune.lr_find import LRFinder

    return [*doctor_callbacks(config), *([LRFinder(config.lr_find)] if config.trainer.lr_find else [])]
