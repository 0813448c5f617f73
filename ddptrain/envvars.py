"""Every ``DDPTRAIN_*`` environment variable ddptrain reads, documented in one place.

Variables are read when they are used, never at import time, so a test or a program may set one
after importing ddptrain. Read them through :func:`get_str`, :func:`get_flag`, :func:`get_float`
or :func:`get_paths` with a name from :data:`VARIABLES`: an unknown name is a programming error
(``KeyError``), which keeps this table complete. ``python -m ddptrain`` warns about a
``DDPTRAIN_*`` variable that is set but unknown (usually a typo: :func:`unknown_variables`).

Variables of other tools that ddptrain honours (``MASTER_ADDR``, ``RANK``, ``OMPI_*``,
``SLURM_*``, ``TORCHELASTIC_*``, ``GLOO_SOCKET_IFNAME``) are read by the module that speaks that
tool's language: ``ddptrain.launch.env`` for launchers, the backends for their libraries.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["EnvVar", "VARIABLES", "get_str", "get_flag", "get_float", "get_paths", "unknown_variables"]

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


@dataclass(frozen=True)
class EnvVar:
    """One variable: its name, its default (as the environment would spell it) and what it does."""

    name: str
    default: str | None
    doc: str


VARIABLES: dict[str, EnvVar] = {
    v.name: v
    for v in (
        EnvVar(
            "DDPTRAIN_DATA",
            None,
            "Default data root (a writable cache) when data.root is not set; else ./data.",
        ),
        EnvVar(
            "DDPTRAIN_DATA_SOURCES",
            "",
            "Directories (os.pathsep-separated) searched for dataset files after the data root, before the "
            "system's dataset folders and a download.",
        ),
        EnvVar(
            "DDPTRAIN_CHECK_COLLECTIVES",
            "1",
            "How mismatched collectives are caught: 1 compares the ranks' ledgers every "
            "DDPTRAIN_CHECK_EVERY collectives (no cost per call); sync agrees on operation, size and "
            "dtype before each functional-API call (one small all-reduce each); 0 checks nothing.",
        ),
        EnvVar(
            "DDPTRAIN_CHECK_EVERY",
            "16",
            "The ledger check compares the ranks' records every this many collectives of a group.",
        ),
        EnvVar(
            "DDPTRAIN_ELASTIC_STORE",
            None,
            "An elastic job's store, HOST:PORT (python -m ddptrain.store); the elastic local launcher "
            "sets it for its workers (ddptrain.comm.elastic.ElasticMembership.from_environment).",
        ),
        EnvVar(
            "DDPTRAIN_ELASTIC_ID",
            None,
            "This worker's member id in an elastic job (the elastic local launcher: <slot>.<attempt>).",
        ),
        EnvVar(
            "DDPTRAIN_LEDGER_DIR",
            None,
            "Where each rank writes its collective ledger (rankN.ledger) and, on SIGUSR1, its stack "
            "(rankN.stack); the launchers set it (the CLI: <run dir>/ledger); off: no files.",
        ),
        EnvVar(
            "DDPTRAIN_MPI_POLL_MIN_S",
            "0.0001",
            "mpi backend: the communication thread's shortest sleep between polls of in-flight requests.",
        ),
        EnvVar(
            "DDPTRAIN_MPI_POLL_MAX_S",
            "0.001",
            "mpi backend: its longest sleep while nothing completes (bounds a collective's added latency).",
        ),
        EnvVar(
            "DDPTRAIN_STORE_BIND_ALL",
            "0",
            "1: rank 0's key-value store listens on every interface instead of MASTER_ADDR only.",
        ),
        EnvVar(
            "DDPTRAIN_FULL_ERROR",
            "0",
            "1: the command line shows Python's full traceback instead of a one-line error.",
        ),
    )
}


def _raw(name: str, environ: Mapping[str, str] | None) -> str | None:
    var = VARIABLES[name]  # KeyError: add the variable to VARIABLES first
    env = os.environ if environ is None else environ
    return env.get(name, var.default)


def get_str(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The variable's value, or its default (``None`` if it has none)."""
    return _raw(name, environ)


def get_flag(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """A yes/no variable: ``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off``.

    Raises:
        ValueError: any other value, naming the variable and what is accepted.
    """
    value = (_raw(name, environ) or "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={value!r} is not a yes/no value: use 1 or 0 (true/false, yes/no, on/off)")


def get_float(name: str, environ: Mapping[str, str] | None = None) -> float:
    """A number of seconds (or any float).

    Raises:
        ValueError: a value that is not a number, naming the variable.
    """
    value = _raw(name, environ)
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{name}={value!r} is not a number (default {VARIABLES[name].default})") from None


def get_paths(name: str, environ: Mapping[str, str] | None = None) -> list[str]:
    """A list of directories separated by ``os.pathsep``; empty entries are dropped."""
    return [p for p in (_raw(name, environ) or "").split(os.pathsep) if p]


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """``DDPTRAIN_*`` variables that are set but that ddptrain does not know, each with a hint."""
    env = os.environ if environ is None else environ
    found = []
    for name in sorted(k for k in env if k.startswith("DDPTRAIN_") and k not in VARIABLES):
        close = difflib.get_close_matches(name, list(VARIABLES), n=1)
        found.append(f"{name} (did you mean {close[0]}?)" if close else name)
    return found
