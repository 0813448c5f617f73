"""Entry point of each rank that :func:`ddptrain.launch.mpi_launch.launch_under_mpiexec` starts.

``python -m ddptrain.launch.mpi_entry JOB REPORT_DIR``: JOB is the pickled function call written by
the launching process; each rank pickles ``("ok", result)`` or ``("error", message, traceback)``
to ``REPORT_DIR/rank<r>.pkl``. A failing rank then exits non-zero at once, so that mpiexec stops
the other ranks instead of leaving them waiting in a collective.
"""

import os
import pickle
import sys
import traceback


def mpi_rank_and_size() -> tuple[int, int]:
    """This rank and the job's size, from the MPI launcher's environment (Open MPI, MPICH/PMI)."""
    for rank_var, size_var in (
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
        ("PMI_RANK", "PMI_SIZE"),
        ("PMIX_RANK", "PMIX_SIZE"),
    ):
        if rank_var in os.environ and size_var in os.environ:
            return int(os.environ[rank_var]), int(os.environ[size_var])
    raise RuntimeError("ddptrain.launch.mpi_entry must be started by mpiexec (no MPI rank in the environment)")


def _report(report_dir: str, rank: int, status: tuple) -> None:
    try:
        payload = pickle.dumps(status)
    except Exception as exc:  # noqa: BLE001 - an unpicklable result must not look like success
        status = ("error", f"the result of rank {rank} could not be sent to the launcher: {exc}", "")
        payload = pickle.dumps(status)
    path = os.path.join(report_dir, f"rank{rank}.pkl")
    with open(path + ".tmp", "wb") as f:
        f.write(payload)
    os.replace(path + ".tmp", path)


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


def main() -> None:
    job_file, report_dir = sys.argv[1], sys.argv[2]
    rank, size = mpi_rank_and_size()
    try:
        with open(job_file, "rb") as f:
            envelope = pickle.load(f)
        if envelope["main"]:
            _import_as_main(*envelope["main"])
        job = pickle.loads(envelope["call"])
        import torch

        torch.set_num_threads(job["threads"])
        if job["init_group"]:
            from ..comm import destroy_process_group, init_process_group

            init_process_group("mpi", timeout=job["comm_timeout_s"])
        try:
            result = job["fn"](rank, size, *job["args"], **job["kwargs"])
        finally:
            if job["init_group"]:
                destroy_process_group()
        _report(report_dir, rank, ("ok", result))
    except BaseException as exc:  # noqa: BLE001 - report, then end this rank so mpiexec ends the job
        from .spawn import describe_exception

        _report(report_dir, rank, ("error", describe_exception(exc), traceback.format_exc()))
        sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__":
    main()
