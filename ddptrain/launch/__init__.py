"""Starting workers (local spawn, or ``mpiexec`` for backend ``mpi``) and detecting external launchers
(torchrun, mpirun, SLURM).

The names below are imported on first use: the command line reads ``ddptrain.launch.env`` and
starts the preloaded fork server (:mod:`ddptrain.launch.forkserver`) without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "launch": "ddptrain.launch.dispatch",
    "find_free_port": "ddptrain.launch.spawn",
    "WorkerFailedError": "ddptrain.launch.failures",
    "LaunchTimeoutError": "ddptrain.launch.failures",
    "MpiexecNotFoundError": "ddptrain.launch.failures",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ddptrain.launch' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
