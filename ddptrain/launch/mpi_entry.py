"""Entry point of each rank that ddptrain's local launcher starts through ``mpiexec``.

``python -m ddptrain.launch.mpi_entry JOB RESULT``: JOB is the pickled trainer config written by
the launching process; rank 0 pickles its final metrics to RESULT. Any failure exits non-zero, so
that mpiexec stops the other ranks instead of leaving them waiting in a collective.
"""
import os
import pickle
import sys
import traceback


def main() -> None:
    job_file, result_file = sys.argv[1], sys.argv[2]
    try:
        from ..trainer.runner import run
        with open(job_file, "rb") as f:
            config = pickle.load(f)
        metrics = run(config)
        rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")))
        if rank == 0:
            tmp = result_file + ".tmp"
            with open(tmp, "wb") as f:
                pickle.dump(metrics, f)
            os.replace(tmp, result_file)
    except BaseException:  # noqa: BLE001 - report, then end this rank so mpiexec ends the job
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__":
    main()
