"""Entry point of each rank that :func:`ddptrain.launch.mpi_launch.launch_under_mpiexec` starts.

``python -m ddptrain.launch.mpi_entry JOB REPORT_DIR``: JOB is the pickled function call written by
the launching process; each rank writes its encoded outcome (:mod:`ddptrain.launch.failures`) to
``REPORT_DIR/rank<r>.pkl``. A failing rank then exits non-zero at once, so that mpiexec stops
the other ranks instead of leaving them waiting in a collective.
"""

import os
import pickle
import sys
from functools import partial
from pathlib import Path

from .env import detect_mpi_environment
from .failures import capture
from .mpi_launch import report_path
from .worker import report, run_rank


def mpi_rank_and_size() -> tuple[int, int]:
    """This rank and the job's size, as the MPI launcher set them (:func:`detect_mpi_environment`)."""
    env = detect_mpi_environment()
    if env is None:
        raise RuntimeError("ddptrain.launch.mpi_entry must be started by mpiexec (no MPI rank in the environment)")
    return env.rank, env.world_size


def _write_atomically(path: Path, payload: bytes) -> None:
    """The launcher reads whatever report file exists: it must never see half of one."""
    with open(f"{path}.tmp", "wb") as f:
        f.write(payload)
    os.replace(f"{path}.tmp", path)


def _import_as_main(kind: str, where: str) -> None:
    """Run the launching program as ``__mp_main__`` (its ``if __name__ == "__main__"`` block does
    not run) and let pickle find its functions under ``__main__`` — as multiprocessing's spawn
    does; ``kind`` is "module" (``python -m``) or "file"."""
    import runpy
    import types

    module = types.ModuleType("__mp_main__")
    sys.modules["__mp_main__"] = module
    if kind == "module":
        content = runpy.run_module(where, run_name="__mp_main__", alter_sys=True)
    else:
        content = runpy.run_path(where, run_name="__mp_main__")
    module.__dict__.update(content)
    sys.modules["__main__"] = module


def _run_job(job_file: str, rank: int, world_size: int):
    """Load the launcher's job (importing its program first if the job refers to it) and run it."""
    with open(job_file, "rb") as f:
        envelope = pickle.load(f)
    if envelope["main"]:
        _import_as_main(*envelope["main"])
    job = pickle.loads(envelope["call"])
    return run_rank(
        job["fn"],
        rank,
        world_size,
        job["args"],
        job["kwargs"],
        threads=job["threads"],
        group_backend=job["group_backend"],
        comm_timeout_s=job["comm_timeout_s"],
    )


def main() -> None:
    job_file, report_dir = sys.argv[1], sys.argv[2]
    rank, size = mpi_rank_and_size()
    outcome = capture(partial(_run_job, job_file, rank, size))
    report(outcome, rank, partial(_write_atomically, report_path(report_dir, rank)))


if __name__ == "__main__":
    main()
