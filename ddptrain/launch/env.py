"""Where the ranks of this process come from: torchrun, MPI, SLURM or nothing (local).

:func:`detect_environment` reads the environment once and answers with a frozen
:class:`ClusterEnvironment`. Sources are tried in :data:`DETECTION_ORDER`, first match wins:

1. ``torchrun`` (torch elastic): ``TORCHELASTIC_RUN_ID`` is set, or all of ``RANK``,
   ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` are (any launcher that follows the
   ``env://`` convention, including our own local spawner's children). ``LOCAL_RANK``
   defaults to 0 and ``LOCAL_WORLD_SIZE`` to 1 (one process per node), but ``LOCAL_RANK``
   without ``LOCAL_WORLD_SIZE`` is an error. The node rank is ``GROUP_RANK``, else
   ``NODE_RANK``, else ``RANK // LOCAL_WORLD_SIZE`` (torchrun's node-major layout).
2. ``mpi`` (:func:`detect_mpi_environment`): Open MPI (``OMPI_COMM_WORLD_RANK``/``_SIZE``/
   ``_LOCAL_RANK``/``_LOCAL_SIZE``), then MPICH / Intel MPI (``PMI_RANK``, ``PMI_SIZE``,
   ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``; a bare ``PMI_RANK``, as some srun plugins set, is
   not enough). PMIx launchers (Open MPI 5's ``mpiexec``, ``srun --mpi=pmix``, PRRTE's
   ``prterun``) set ``PMIX_RANK`` and ``PMIX_NAMESPACE`` but no size: a PMIx process learns the
   job's size from the PMIx library, never from the environment (there is no ``PMIX_SIZE``).
   So ``PMIX_RANK`` counts only beside a complete layout: Open MPI's ``OMPI_COMM_WORLD_*``
   (which Open MPI 5 sets as well) or srun's ``SLURM_*``.
   The node rank is ``rank // local size`` (MPI's default by-slot mapping).
   ``MASTER_ADDR``/``MASTER_PORT`` come from the environment or stay ``None``: MPI does
   not pick a rendezvous point, the caller must.
3. ``slurm``: only inside an ``srun`` step, i.e. ``SLURM_PROCID`` and ``SLURM_NTASKS`` (or
   ``SLURM_NPROCS``) are set; a bare ``salloc`` shell falls through to local. The master
   address is ``MASTER_ADDR`` if set, else the first host of the step's node list. The
   master port is ``MASTER_PORT`` if set, else ``15000 + SLURM_JOB_ID % 5000`` (range
   15000-19999): every task of the job computes the same port without talking, and two jobs
   sharing a node rarely collide (Lightning also derives its port from the job id).
4. ``local``: nothing detected: rank 0 of 1. The local spawner sets the ``env://``
   variables for its children, which then detect as case 1. But ``RANK``, ``WORLD_SIZE``,
   ``PMI_RANK`` or ``PMIX_RANK`` without the rest of their launcher's variables is an error,
   not local.

Every value is checked (integers, non-negative, ranks below their sizes, ports below 65536);
a bad value raises ``ValueError`` naming the variable, its value, the rule and the fix.
Nothing is guessed.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

DETECTION_ORDER: tuple[str, ...] = ("torchrun", "mpi", "slurm", "local")
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_SLURM_NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
_SLURM_PORT_BASE, _SLURM_PORT_SPAN = 15000, 5000
# Set by a launcher that did not finish the job: seen alone, they make "local" a guess.
_HALF_LAUNCHED_VARS = ("RANK", "WORLD_SIZE", "PMI_RANK", "PMIX_RANK")
# MPI flavours whose launcher puts the whole rank layout in the environment, in detection order:
# the variables that announce the flavour, then those of rank, size, local rank and local size.
_MPI_FLAVOURS: tuple[tuple[tuple[str, ...], tuple[str, str, str, str]], ...] = (
    (
        ("OMPI_COMM_WORLD_RANK",),
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ),
    # A bare PMI_RANK (some srun PMI plugins) does not announce MPICH: MPI_LOCALRANKID comes with it.
    (("PMI_RANK", "MPI_LOCALRANKID"), ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")),
)


@dataclass(frozen=True)
class ClusterEnvironment:
    """Ranks and rendezvous point of this process, as given by its launcher.

    Attributes:
        name: Where they came from: ``"torchrun"``, ``"mpi"``, ``"slurm"`` or ``"local"``.
        rank: Global rank, ``0 <= rank < world_size``.
        world_size: Number of processes in the job.
        local_rank: Rank among the processes on this node (selects the GPU).
        local_world_size: Number of processes on this node.
        node_rank: Index of this node in the job.
        master_addr: Host of rank 0's rendezvous store, ``None`` if the launcher gave none.
        master_port: TCP port of that store, ``None`` if the launcher gave none.
    """

    name: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    master_addr: str | None
    master_port: int | None

    def is_launched_externally(self) -> bool:
        """True when an outside launcher started this process (anything but ``"local"``)."""
        return self.name != "local"


def _int(env: Mapping[str, str], var: str, source: str, *, minimum: int = 0, maximum: int | None = None) -> int:
    """Read ``env[var]`` as an integer in ``[minimum, maximum]``; explain any failure."""
    raw = env[var]
    if not re.fullmatch(r"\s*-?\d+\s*", raw):
        raise ValueError(
            f"{var}={raw!r} is not an integer ({source} environment): the "
            f"launcher sets a whole number; unset it or fix the command that set it"
        )
    value = int(raw)
    if value < minimum or (maximum is not None and value > maximum):
        bounds = f"at least {minimum}" if maximum is None else f"from {minimum} to {maximum}"
        raise ValueError(
            f"{var}={value} must be {bounds} ({source} environment); unset it or fix the command that set it"
        )
    return value


def _below(var: str, value: int, limit_var: str, limit: int, source: str) -> None:
    """Raise unless ``value < limit``: every rank runs from 0 to its size minus one."""
    if value >= limit:
        raise ValueError(
            f"{var}={value} is not below {limit_var}={limit} ({source} "
            f"environment): ranks run from 0 to {limit_var}-1. Check the "
            f"launcher's process counts, or unset stale variables of another run"
        )


def _port(env: Mapping[str, str], source: str) -> int:
    return _int(env, "MASTER_PORT", source, minimum=1, maximum=65535)


def _missing(var: str, source: str, why: str) -> ValueError:
    return ValueError(f"{var} is not set ({source} environment): {why}")


def _build(
    name: str,
    env: Mapping[str, str],
    keys: tuple[str, str, str, str],
    node_rank: int | None,
    addr: str | None,
    port: int | None,
) -> ClusterEnvironment:
    """Read and cross-check rank, size, local rank and local size named by ``keys``."""
    rank_var, size_var, local_rank_var, local_size_var = keys
    world_size = _int(env, size_var, name, minimum=1)
    rank = _int(env, rank_var, name)
    _below(rank_var, rank, size_var, world_size, name)
    local_rank = _int(env, local_rank_var, name)
    local_size = _int(env, local_size_var, name, minimum=1)
    _below(local_rank_var, local_rank, local_size_var, local_size, name)
    if local_size > world_size:
        raise ValueError(
            f"{local_size_var}={local_size} exceeds {size_var}={world_size} "
            f"({name} environment): a node cannot hold more processes than the "
            f"job; fix the launcher's per-node process count"
        )
    node_rank = rank // local_size if node_rank is None else node_rank
    return ClusterEnvironment(name, rank, world_size, local_rank, local_size, node_rank, addr, port)


def _torchrun(env: Mapping[str, str]) -> ClusterEnvironment:
    for var in _TORCHRUN_VARS:
        if var not in env:
            raise _missing(
                var,
                "torchrun",
                "torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and "
                "MASTER_PORT for every worker; launch with torchrun or set all four",
            )
    if "LOCAL_RANK" in env and "LOCAL_WORLD_SIZE" not in env:
        raise _missing(
            "LOCAL_WORLD_SIZE",
            "torchrun",
            f"LOCAL_RANK={env['LOCAL_RANK']} is set, so set LOCAL_WORLD_SIZE to the number of processes on this node",
        )
    env = {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", **env}
    node_var = next((v for v in ("GROUP_RANK", "NODE_RANK") if v in env), None)
    node_rank = None if node_var is None else _int(env, node_var, "torchrun")
    port = _port(env, "torchrun")
    return _build(
        "torchrun", env, ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"), node_rank, env["MASTER_ADDR"], port
    )


def _mpi(env: Mapping[str, str], keys: tuple[str, str, str, str]) -> ClusterEnvironment:
    for var in keys:
        if var not in env:
            raise _missing(
                var,
                "mpi",
                f"{keys[0]} is set, so this MPI must also set {var}; "
                "launch with a current mpirun/mpiexec (Open MPI, MPICH or Intel MPI)",
            )
    port = _port(env, "mpi") if "MASTER_PORT" in env else None
    return _build("mpi", env, keys, None, env.get("MASTER_ADDR"), port)


def _tasks_on_node(var: str, spec: str, node: int) -> int:
    """Tasks on node ``node`` from SLURM's compressed count list, e.g. ``"2(x3),1"``."""
    counts: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            raise ValueError(
                f"{var}={spec!r} is malformed (slurm environment): expected "
                f"counts like '2(x3),1'; unset it or fix the srun command"
            )
        counts += [int(match[1])] * int(match[2] or 1)
    if node >= len(counts):
        raise ValueError(
            f"SLURM_NODEID={node} is not below the {len(counts)} node(s) listed in "
            f"{var}={spec!r} (slurm environment): node ids run from 0; unset stale "
            f"SLURM variables or start this via srun"
        )
    return counts[node]


def _slurm(env: Mapping[str, str]) -> ClusterEnvironment:
    size_var = "SLURM_NTASKS" if "SLURM_NTASKS" in env else "SLURM_NPROCS"
    spec_var = next(
        (v for v in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE") if v in env), "SLURM_STEP_TASKS_PER_NODE"
    )
    for var in ("SLURM_LOCALID", "SLURM_NODEID", spec_var):
        if var not in env:
            raise _missing(var, "slurm", "srun sets it for every task; start this via srun")
    node_rank = _int(env, "SLURM_NODEID", "slurm")
    # _build reads sizes from variables; this node's task count gets a readable pseudo-name.
    local_size_var = f"{spec_var}[node {node_rank}]"
    per_node = {local_size_var: str(_tasks_on_node(spec_var, env[spec_var], node_rank))}
    if "MASTER_ADDR" in env:
        addr = env["MASTER_ADDR"]
    else:
        nodelist_var = next((v for v in _SLURM_NODELIST_VARS if v in env), None)
        if nodelist_var is None:
            raise _missing(
                "SLURM_STEP_NODELIST",
                "slurm",
                "the master address is the first host of the node list; set MASTER_ADDR or start this via srun",
            )
        addr = parse_slurm_nodelist(env[nodelist_var])[0]
    if "MASTER_PORT" in env:
        port = _port(env, "slurm")
    elif "SLURM_JOB_ID" in env:
        port = _SLURM_PORT_BASE + _int(env, "SLURM_JOB_ID", "slurm") % _SLURM_PORT_SPAN
    else:
        raise _missing(
            "SLURM_JOB_ID", "slurm", "the master port is derived from it; set MASTER_PORT or start this via srun"
        )
    return _build(
        "slurm", {**env, **per_node}, ("SLURM_PROCID", size_var, "SLURM_LOCALID", local_size_var), node_rank, addr, port
    )


def detect_environment(environ: Mapping[str, str] | None = None) -> ClusterEnvironment:
    """Find out where this process's ranks come from, trying :data:`DETECTION_ORDER`.

    Args:
        environ: Variables to read; ``os.environ`` when ``None``. Never modified.

    Returns:
        The first environment that matches (see the module docstring for the rules).

    Raises:
        ValueError: A matched environment has a missing, non-integer, negative or
            inconsistent value or a malformed SLURM node list; or nothing matched although
            ``RANK``, ``WORLD_SIZE``, ``PMI_RANK`` or ``PMIX_RANK`` is set (a half-configured
            launcher).
    """
    env = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" in env or all(v in env for v in _TORCHRUN_VARS):
        return _torchrun(env)
    mpi = detect_mpi_environment(env)
    if mpi is not None:
        return mpi
    if "SLURM_PROCID" in env and ("SLURM_NTASKS" in env or "SLURM_NPROCS" in env):
        return _slurm(env)
    stray = [f"{v}={env[v]}" for v in _HALF_LAUNCHED_VARS if v in env]
    if stray:
        raise ValueError(
            f"{', '.join(stray)} set, but no launcher environment is complete: "
            f"torchrun needs all of {', '.join(_TORCHRUN_VARS)}; MPICH/Intel MPI "
            f"needs PMI_RANK with MPI_LOCALRANKID; a PMIx launcher's PMIX_RANK "
            f"needs Open MPI's OMPI_COMM_WORLD_* or srun's SLURM_* beside it (PMIx "
            f"gives the job's size only through its library). Running as one local process "
            f"would be a guess: set the missing variables, launch with "
            f"torchrun/mpirun/srun, or unset these"
        )
    return ClusterEnvironment("local", 0, 1, 0, 1, 0, None, None)


def detect_mpi_environment(environ: Mapping[str, str] | None = None) -> ClusterEnvironment | None:
    """This process's ranks as its MPI launcher gave them, or None if no MPI launcher started it.

    Open MPI's variables first, then MPICH / Intel MPI's (see the module docstring; PMIx alone
    is not enough). :func:`detect_environment` asks this after torchrun; the ranks that
    ``mpiexec`` starts for :mod:`ddptrain.launch` ask it directly, as they are MPI ranks whatever
    else their environment holds.

    Raises:
        ValueError: An MPI flavour is announced but a variable is missing or inconsistent.
    """
    env = os.environ if environ is None else environ
    for announced_by, keys in _MPI_FLAVOURS:
        if all(var in env for var in announced_by):
            return _mpi(env, keys)
    return None


def parse_slurm_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM hostlist expression into host names, in SLURM's order.

    Commas outside brackets separate hosts; a bracket holds comma-separated numbers or
    ``lo-hi`` ranges, zero-padded to the width of ``lo``. Several bracket groups in one host
    expand as a cartesian product, the leftmost group varying slowest:
    ``"rack[1-2]-n[3-4],gpu5"`` gives ``rack1-n3, rack1-n4, rack2-n3, rack2-n4, gpu5``.

    Args:
        nodelist: The expression, e.g. the value of ``SLURM_STEP_NODELIST``.

    Returns:
        The host names, at least one.

    Raises:
        ValueError: Empty list or host, unbalanced or nested brackets, or a bad range.
    """

    def fail(rule: str) -> ValueError:
        return ValueError(
            f"SLURM node list {nodelist!r} is malformed: {rule}. Expected host "
            f"lists like 'node[01-03,07],gpu5'; check the SLURM_*NODELIST "
            f"variable (or set MASTER_ADDR)"
        )

    hosts: list[str] = []
    # Split on commas at bracket depth 0, then each host into text and [..] groups.
    for item in re.split(r",(?![^\[]*\])", nodelist.strip()):
        if not item.strip():
            raise fail("it has an empty host name")
        pieces = re.split(r"(\[[^\[\]]*\])", item.strip())
        if any("[" in p or "]" in p for p in pieces[::2]):
            raise fail("a '[' or ']' is unbalanced or nested")
        choices: list[list[str]] = []
        for index, piece in enumerate(pieces):
            if index % 2 == 0:
                choices.append([piece])
                continue
            numbers: list[str] = []
            for part in piece[1:-1].split(","):
                match = re.fullmatch(r"\s*(\d+)(?:-(\d+))?\s*", part)
                if match is None:
                    raise fail(f"range {part!r} is not a number or lo-hi pair of numbers")
                lo, hi = match[1], match[2] or match[1]
                if int(hi) < int(lo):
                    raise fail(f"range {part!r} runs backwards")
                numbers += [str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1)]
            choices.append(numbers)
        hosts += ["".join(combo) for combo in itertools.product(*choices)]
    return hosts


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, which cgroups and taskset narrow)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def threads_per_rank(ranks_on_this_machine: int, requested: int | None = None) -> int:
    """torch intra-op threads for each rank: ``requested`` if given (and > 0), else this machine's
    usable cores shared evenly by its ranks, at least 1. One rule for every launcher: more
    threads than cores make ranks fight for them, and a step waits for the slowest rank."""
    if requested:
        if requested < 0:
            raise ValueError(f"threads per rank must be positive, got {requested}")
        return int(requested)
    return max(1, usable_cores() // max(1, ranks_on_this_machine))
