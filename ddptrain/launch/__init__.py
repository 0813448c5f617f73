"""Starting workers (local spawn, or ``mpiexec`` for backend ``mpi``) and detecting external launchers
(torchrun, mpirun, SLURM).

The names below are imported on first use: the command line reads ``ddptrain.launch.env`` and
starts the preloaded fork server (:mod:`ddptrain.launch.forkserver`) without importing torch.
"""

from __future__ import annotations

from ddptrain._exports import lazy_exports

_EXPORTS = {
    "launch": "ddptrain.launch.dispatch",
    "find_free_port": "ddptrain.launch.spawn",
    "WorkerFailedError": "ddptrain.launch.failures",
    "LaunchTimeoutError": "ddptrain.launch.failures",
    "MpiexecNotFoundError": "ddptrain.launch.failures",
}
__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
del lazy_exports
