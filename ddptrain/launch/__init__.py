"""Starting workers (local spawn, or ``mpiexec`` for backend ``mpi``) and detecting external launchers
(torchrun, mpirun, SLURM)."""

from .dispatch import launch
from .failures import LaunchTimeoutError, MpiexecNotFoundError, WorkerFailedError
from .spawn import find_free_port

__all__ = ["launch", "find_free_port", "WorkerFailedError", "LaunchTimeoutError", "MpiexecNotFoundError"]
