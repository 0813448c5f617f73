"""Starting workers (local spawn) and detecting external launchers (torchrun, mpirun, SLURM)."""

from .spawn import LaunchTimeoutError, WorkerFailedError, find_free_port, launch

__all__ = ["launch", "find_free_port", "WorkerFailedError", "LaunchTimeoutError"]
