"""Unit tests for ddptrain.launch.env: environment detection, its order, and the hostlist parser.

Every test passes an explicit ``environ`` dict; only the test of the ``os.environ`` default
touches the real environment, through ``monkeypatch``.
"""

from __future__ import annotations

import dataclasses

import pytest

from ddptrain.launch.env import (
    DETECTION_ORDER,
    ClusterEnvironment,
    detect_environment,
    detect_mpi_environment,
    parse_slurm_nodelist,
)

TORCHRUN = {
    "TORCHELASTIC_RUN_ID": "job-7",
    "RANK": "5",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "4",
    "GROUP_RANK": "1",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
}
OMPI = {
    "OMPI_COMM_WORLD_RANK": "6",
    "OMPI_COMM_WORLD_SIZE": "8",
    "OMPI_COMM_WORLD_LOCAL_RANK": "2",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
}
PMI = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
# What a PMIx launcher sets (from `mpiexec -n 2 env` of Open MPI 5.0: rank 1 of 2): a rank and a
# namespace, but no size; the size is a PMIx_Get away. tests/dist/test_mpi.py checks this on a real run.
PMIX = {
    "PMIX_RANK": "1",
    "PMIX_NAMESPACE": "prterun-vm-6617@1",
    "PMIX_SERVER_URI41": "prterun-vm-6617@0.0;tcp4://127.0.0.1:59133",
    "PMIX_HOSTNAME": "vm",
}
SLURM = {
    "SLURM_JOB_ID": "123456",
    "SLURM_PROCID": "3",
    "SLURM_NTASKS": "6",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_STEP_TASKS_PER_NODE": "2(x3)",
    "SLURM_STEP_NODELIST": "gpu[07-09]",
    "SLURM_JOB_NODELIST": "other[1-9]",
}
SALLOC = {  # an interactive allocation, before any srun: no SLURM_PROCID
    "SLURM_JOB_ID": "99",
    "SLURM_JOB_NODELIST": "node[1-2]",
    "SLURM_NODELIST": "node[1-2]",
    "SLURM_NNODES": "2",
    "SLURM_TASKS_PER_NODE": "4(x2)",
    "SLURM_NTASKS": "8",
}


def env_of(*parts: dict[str, str], **overrides: str) -> dict[str, str]:
    merged: dict[str, str] = {}
    for part in parts:
        merged.update(part)
    merged.update(overrides)
    return merged


# --- detection of each environment ------------------------------------------------------


def test_detection_order_is_written_down():
    assert DETECTION_ORDER == ("torchrun", "mpi", "slurm", "local")


def test_torchrun_reads_every_field():
    assert detect_environment(TORCHRUN) == ClusterEnvironment(
        "torchrun",
        rank=5,
        world_size=8,
        local_rank=1,
        local_world_size=4,
        node_rank=1,
        master_addr="10.0.0.1",
        master_port=29500,
    )


def test_env_convention_without_elastic_id_defaults_local_rank_and_derives_node_rank():
    env = {"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "host", "MASTER_PORT": "1234"}
    got = detect_environment(env)
    assert (got.name, got.rank, got.world_size) == ("torchrun", 3, 4)
    assert (got.local_rank, got.local_world_size, got.node_rank) == (0, 1, 3)


def test_torchrun_node_rank_falls_back_to_node_rank_then_rank_division():
    base = env_of(TORCHRUN)
    del base["GROUP_RANK"]
    assert detect_environment(env_of(base, NODE_RANK="0")).node_rank == 0
    assert detect_environment(base).node_rank == 5 // 4


def test_open_mpi():
    got = detect_environment(OMPI)
    assert got == ClusterEnvironment("mpi", 6, 8, 2, 4, 1, None, None)
    assert got.is_launched_externally()


def test_open_mpi_takes_master_address_from_environment():
    got = detect_environment(env_of(OMPI, MASTER_ADDR="head", MASTER_PORT="2222"))
    assert (got.master_addr, got.master_port) == ("head", 2222)


def test_mpich_pmi_flavour():
    assert detect_environment(PMI) == ClusterEnvironment("mpi", 3, 4, 1, 2, 1, None, None)


def test_open_mpi_5_sets_pmix_and_ompi_variables_and_the_ompi_ones_count():
    got = detect_environment(env_of(OMPI, PMIX))  # PMIX_RANK=1 differs from OMPI's 6 on purpose
    assert got == ClusterEnvironment("mpi", 6, 8, 2, 4, 1, None, None)


def test_srun_with_pmix_is_a_slurm_step():
    got = detect_environment(env_of(SLURM, PMIX, PMIX_RANK=SLURM["SLURM_PROCID"]))
    assert got == detect_environment(SLURM)


@pytest.mark.parametrize("extra", [{}, {"PMIX_SIZE": "2"}], ids=["pmix-only", "with-an-invented-PMIX_SIZE"])
def test_pmix_alone_is_refused_not_taken_for_a_local_run(extra):
    """A PMIx-only launcher (PRRTE's prterun) gives no size in the environment: guessing rank 0 of 1
    would run N copies of a one-process job. No launcher sets PMIX_SIZE, so it changes nothing."""
    with pytest.raises(ValueError) as info:
        detect_environment(env_of(PMIX, extra))
    message = str(info.value)
    assert message.startswith("PMIX_RANK=1 set, but no launcher environment is complete"), message
    assert "PMIX_RANK needs Open MPI's OMPI_COMM_WORLD_* or srun's SLURM_* beside it" in message, message
    assert "only through its library" in message and "or unset these" in message, message
    assert detect_mpi_environment(env_of(PMIX, extra)) is None


def test_mpi_reader_alone_finds_mpi_whatever_else_is_set():
    """The ranks that ddptrain's mpiexec launcher starts ask for MPI's ranks directly."""
    with_torchrun = detect_mpi_environment(env_of(TORCHRUN, OMPI, PMIX))
    assert with_torchrun == ClusterEnvironment("mpi", 6, 8, 2, 4, 1, "10.0.0.1", 29500)
    assert detect_mpi_environment(env_of(SLURM, PMI)) == detect_environment(PMI)
    assert detect_mpi_environment(env_of(OMPI, PMI)).rank == 6  # Open MPI before MPICH
    for other in (TORCHRUN, SLURM, SALLOC, {}, {"PMI_RANK": "3", "PMI_SIZE": "6"}, {"MPI_LOCALRANKID": "0"}):
        assert detect_mpi_environment(other) is None, other
    with pytest.raises(ValueError, match=r"OMPI_COMM_WORLD_SIZE is not set \(mpi environment\)"):
        detect_mpi_environment({"OMPI_COMM_WORLD_RANK": "0"})


def test_slurm_step():
    got = detect_environment(SLURM)
    # Port: 15000 + 123456 % 5000 = 18456; address: first host of the *step* node list.
    assert got == ClusterEnvironment("slurm", 3, 6, 1, 2, 1, "gpu07", 18456)


def test_slurm_port_stays_in_documented_range_and_env_overrides():
    for job_id in ("0", "4999", "5000", "987654321"):
        port = detect_environment(env_of(SLURM, SLURM_JOB_ID=job_id)).master_port
        assert port == 15000 + int(job_id) % 5000 and 15000 <= port <= 19999
    got = detect_environment(env_of(SLURM, MASTER_PORT="4000", MASTER_ADDR="head"))
    assert (got.master_addr, got.master_port) == ("head", 4000)


def test_slurm_fallback_variables():
    env = env_of(SLURM, SLURM_NPROCS="6", SLURM_TASKS_PER_NODE="3,3", SLURM_NODELIST="z[5-6]")
    for var in ("SLURM_NTASKS", "SLURM_STEP_TASKS_PER_NODE", "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"):
        del env[var]
    got = detect_environment(env)
    assert (got.world_size, got.local_world_size, got.master_addr) == (6, 3, "z5")


def test_slurm_uneven_tasks_per_node():
    env = env_of(
        SLURM,
        SLURM_STEP_TASKS_PER_NODE="4(x2),1",
        SLURM_NTASKS="9",
        SLURM_NODEID="2",
        SLURM_PROCID="8",
        SLURM_LOCALID="0",
    )
    got = detect_environment(env)
    assert (got.local_world_size, got.node_rank) == (1, 2)


def test_salloc_shell_without_srun_is_local():
    assert detect_environment(SALLOC) == ClusterEnvironment("local", 0, 1, 0, 1, 0, None, None)


def test_nothing_set_is_local():
    got = detect_environment({"HOME": "/root", "MASTER_ADDR": "x", "MASTER_PORT": "1"})
    assert got.name == "local" and not got.is_launched_externally()
    assert (got.rank, got.world_size, got.master_addr, got.master_port) == (0, 1, None, None)


def test_default_reads_os_environ(monkeypatch):
    for var in list(TORCHRUN) + list(OMPI) + list(PMI) + list(PMIX) + list(SLURM) + list(SALLOC):
        monkeypatch.delenv(var, raising=False)
    for var, value in OMPI.items():
        monkeypatch.setenv(var, value)
    assert detect_environment().rank == 6
    assert detect_mpi_environment().rank == 6


def test_environment_is_frozen_and_input_untouched():
    env = dict(TORCHRUN)
    got = detect_environment(env)
    assert env == TORCHRUN
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.rank = 0  # type: ignore[misc]


# --- the order ----------------------------------------------------------------------------


def test_torchrun_beats_mpi_beats_slurm():
    assert detect_environment(env_of(SLURM, OMPI, TORCHRUN)).name == "torchrun"
    assert detect_environment(env_of(SLURM, OMPI, TORCHRUN)).rank == 5
    assert detect_environment(env_of(SLURM, OMPI)).name == "mpi"
    assert detect_environment(env_of(SLURM, OMPI)).rank == 6
    assert detect_environment(env_of(SLURM, PMI)).rank == 3
    assert detect_environment(env_of(OMPI, PMI)).rank == 6  # Open MPI before MPICH
    # srun's PMI plugins may set a bare PMI_RANK: that must not hide the SLURM step.
    assert detect_environment(env_of(SLURM, PMI_RANK="3", PMI_SIZE="6")).name == "slurm"


# --- hostlist parser ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("gpu5", ["gpu5"]),
        ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
        ("a[1-2]-ib,b", ["a1-ib", "a2-ib", "b"]),
        ("n[008-010]", ["n008", "n009", "n010"]),
        ("n[9-11]", ["n9", "n10", "n11"]),
        ("rack[1-2]-node[3-4]", ["rack1-node3", "rack1-node4", "rack2-node3", "rack2-node4"]),
        ("x[1],y[2,4],z", ["x1", "y2", "y4", "z"]),
        (" a , b ", ["a", "b"]),
        ("c[3]", ["c3"]),
    ],
)
def test_parse_slurm_nodelist(nodelist, hosts):
    assert parse_slurm_nodelist(nodelist) == hosts


@pytest.mark.parametrize(
    "nodelist, rule",
    [
        ("node[01-03", "unbalanced or nested"),
        ("node01-03]", "unbalanced or nested"),
        ("a[1,[2]]", "unbalanced or nested"),
        ("", "empty host name"),
        ("a,,b", "empty host name"),
        ("n[5-3]", "'5-3' runs backwards"),
        ("n[a-b]", "'a-b' is not a number"),
        ("n[]", "'' is not a number"),
    ],
)
def test_parse_slurm_nodelist_rejects_malformed(nodelist, rule):
    with pytest.raises(
        ValueError,
        match=rf"SLURM node list .* is malformed: .*{rule}.*"
        rf"node\[01-03,07\],gpu5",
    ):
        parse_slurm_nodelist(nodelist)


# --- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "env, message",
    [
        (
            env_of(TORCHRUN, RANK="8"),
            r"RANK=8 is not below WORLD_SIZE=8 \(torchrun environment\): ranks run from 0 to "
            r"WORLD_SIZE-1",
        ),
        (env_of(TORCHRUN, LOCAL_RANK="4"), r"LOCAL_RANK=4 is not below LOCAL_WORLD_SIZE=4"),
        (
            env_of(TORCHRUN, WORLD_SIZE="two"),
            r"WORLD_SIZE='two' is not an integer \(torchrun environment\).*unset it or fix",
        ),
        (env_of(TORCHRUN, RANK="1.0"), r"RANK='1.0' is not an integer"),
        (env_of(TORCHRUN, RANK="-1"), r"RANK=-1 must be at least 0 \(torchrun environment\)"),
        (env_of(TORCHRUN, WORLD_SIZE="0"), r"WORLD_SIZE=0 must be at least 1"),
        (env_of(TORCHRUN, GROUP_RANK="-2"), r"GROUP_RANK=-2 must be at least 0"),
        (env_of(TORCHRUN, MASTER_PORT="70000"), r"MASTER_PORT=70000 must be from 1 to 65535"),
        (
            env_of(TORCHRUN, LOCAL_WORLD_SIZE="9", LOCAL_RANK="0"),
            r"LOCAL_WORLD_SIZE=9 exceeds WORLD_SIZE=8 .*per-node process count",
        ),
        (
            {"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "1"},
            r"MASTER_ADDR is not set \(torchrun environment\): .*launch with torchrun or set all four",
        ),
        (
            {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1", "LOCAL_RANK": "0"},
            r"LOCAL_WORLD_SIZE is not set .*LOCAL_RANK=0 is set",
        ),
        (
            env_of(OMPI, OMPI_COMM_WORLD_RANK="8"),
            r"OMPI_COMM_WORLD_RANK=8 is not below OMPI_COMM_WORLD_SIZE=8 \(mpi environment\)",
        ),
        (env_of(OMPI, OMPI_COMM_WORLD_LOCAL_SIZE="x"), r"OMPI_COMM_WORLD_LOCAL_SIZE='x' is not an"),
        (
            {"OMPI_COMM_WORLD_RANK": "0"},
            r"OMPI_COMM_WORLD_SIZE is not set \(mpi environment\): OMPI_COMM_WORLD_RANK is set",
        ),
        (env_of(PMI, MPI_LOCALRANKID="2"), r"MPI_LOCALRANKID=2 is not below MPI_LOCALNRANKS=2"),
        (env_of(SLURM, SLURM_PROCID="6"), r"SLURM_PROCID=6 is not below SLURM_NTASKS=6 \(slurm"),
        (env_of(SLURM, SLURM_LOCALID="2"), r"SLURM_LOCALID=2 is not below SLURM_STEP_TASKS_PER_NODE\[node 1\]=2"),
        (
            env_of(SLURM, SLURM_NODEID="3"),
            r"SLURM_NODEID=3 is not below the 3 node\(s\) listed in SLURM_STEP_TASKS_PER_NODE",
        ),
        (
            env_of(SLURM, SLURM_STEP_TASKS_PER_NODE="2x3"),
            r"SLURM_STEP_TASKS_PER_NODE='2x3' is malformed \(slurm environment\)",
        ),
        (env_of(SLURM, SLURM_JOB_ID="abc"), r"SLURM_JOB_ID='abc' is not an integer"),
        (env_of(SLURM, SLURM_STEP_NODELIST="gpu[07-09"), r"SLURM node list 'gpu\[07-09' is malformed"),
        (
            {k: v for k, v in SLURM.items() if k != "SLURM_LOCALID"},
            r"SLURM_LOCALID is not set \(slurm environment\): srun sets it",
        ),
        ({k: v for k, v in SLURM.items() if k != "SLURM_JOB_ID"}, r"SLURM_JOB_ID is not set .*set MASTER_PORT"),
        ({k: v for k, v in SLURM.items() if "NODELIST" not in k}, r"SLURM_STEP_NODELIST is not set .*set MASTER_ADDR"),
        (
            {"RANK": "1", "WORLD_SIZE": "2"},
            r"RANK=1, WORLD_SIZE=2 set, but no launcher environment is complete: torchrun needs all "
            r"of RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.*or unset these",
        ),
        ({"PMI_RANK": "0"}, r"PMI_RANK=0 set, but no launcher environment is complete"),
    ],
)
def test_errors_name_variable_value_rule_and_fix(env, message):
    with pytest.raises(ValueError, match=message):
        detect_environment(env)
