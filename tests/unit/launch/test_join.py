"""Joining the job's process group from inside a rank (ddptrain/launch/join.py)."""

import subprocess

import pytest
import torch

from ddptrain import comm as dist
from ddptrain.launch.env import detect_environment, threads_per_rank
from ddptrain.launch.join import RendezvousError, join_process_group, rendezvous_for
from ddptrain.testing import run_threaded
from tests.conftest import PYTHON, REPO, cli_env

TORCHRUN = {"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "LOCAL_WORLD_SIZE": "2"}
OPEN_MPI = {
    "OMPI_COMM_WORLD_RANK": "3",
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
}
SLURM = {
    "SLURM_PROCID": "2",
    "SLURM_NTASKS": "4",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "1",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    "SLURM_STEP_NODELIST": "node[07-08]",
    "SLURM_JOB_ID": "1234",
}


def test_each_launcher_meets_where_it_says():
    init_method, world_size, rank = rendezvous_for(detect_environment({}), "gloo")
    host, _, port = init_method.rpartition(":")
    assert host == "tcp://127.0.0.1" and 0 < int(port) < 65536 and (world_size, rank) == (1, 0)  # a job of one
    # torchrun's agent serves the store: env://, ranks from the environment
    assert rendezvous_for(detect_environment(TORCHRUN), "gloo") == ("env://", -1, -1)
    # MPI wires its ranks itself, address or not
    assert rendezvous_for(detect_environment(OPEN_MPI), "mpi") == (None, -1, -1)
    with_address = {**OPEN_MPI, "MASTER_ADDR": "10.0.0.2", "MASTER_PORT": "29400"}
    assert rendezvous_for(detect_environment(with_address), "gloo") == ("tcp://10.0.0.2:29400", 4, 3)
    # SLURM: the first node of the step, a port derived from the job id
    assert rendezvous_for(detect_environment(SLURM), "gloo") == ("tcp://node07:16234", 4, 2)


@pytest.mark.parametrize(
    "address", [{}, {"MASTER_ADDR": "10.0.0.1"}, {"MASTER_PORT": "29500"}], ids=["neither", "no port", "no host"]
)
def test_mpirun_with_gloo_and_no_address_says_what_to_set(address):
    with pytest.raises(RendezvousError) as info:
        rendezvous_for(detect_environment({**OPEN_MPI, **address}), "gloo")
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    for words in ("mpi launcher gave no rendezvous address", "MASTER_ADDR", "MASTER_PORT", "dist.backend=mpi"):
        assert words in message


@pytest.fixture
def no_launcher(monkeypatch):
    """A plain process (no launcher variables), with torch's thread count put back afterwards."""
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    for var in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_plain_process_joins_a_job_of_one_and_leaves_it(no_launcher):
    membership = join_process_group("gloo", timeout_s=30)
    try:
        assert membership.created and dist.is_initialized()
        assert (membership.rank, membership.world_size, membership.local_rank) == (0, 1, 0)
        assert membership.process_group is dist.get_process_group()
        assert membership.device == torch.device("cpu") and membership.environment.name == "local"
        assert torch.get_num_threads() == threads_per_rank(1)  # every usable core: one rank here
        t = torch.ones(2)
        membership.process_group.all_reduce(t).wait()
        assert t.tolist() == [1.0, 1.0]
    finally:
        membership.leave()
    assert not dist.is_initialized()


def test_threads_per_worker_is_applied(no_launcher):
    membership = join_process_group("gloo", timeout_s=30, threads_per_worker=1)
    membership.leave()
    assert torch.get_num_threads() == 1


def test_an_existing_group_is_reused_and_left_to_its_owner():
    threads = torch.get_num_threads()

    def body(rank, world_size):
        mine = dist.get_process_group()
        membership = join_process_group("gloo", timeout_s=30, environment=detect_environment({}))
        membership.leave()  # not created here: must not end the group
        t = torch.tensor([float(rank)])
        mine.all_reduce(t).wait()
        return membership.created, membership.process_group is mine, membership.rank, membership.world_size, t.item()

    try:
        assert run_threaded(body, 3, timeout_s=60) == [(False, True, r, 3, 3.0) for r in range(3)]
    finally:
        torch.set_num_threads(threads)


def test_join_imports_neither_the_trainer_nor_hydra():
    code = (
        "import sys, ddptrain.launch.join; "
        "bad = [m for m in sys.modules if m.startswith(('ddptrain.trainer', 'hydra', 'omegaconf'))]; "
        "assert not bad, bad"
    )
    proc = subprocess.run([PYTHON, "-c", code], cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_ranks_share_the_gpus_there_are_over_gloo_and_nccl_refuses_it(monkeypatch):
    """With more local ranks than GPUs, gloo and mpi ranks take cuda:{local_rank % count}; nccl,
    which refuses two ranks on one device, is refused before it starts. CUDA is absent here, so
    torch.cuda reports one device (the GPU check runs the real thing: tests/cuda)."""
    from ddptrain.config import Config, ConfigError
    from ddptrain.launch.join import claim_device
    from ddptrain.preflight import check_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    gloo = Config.from_dict({"trainer": {"device": "cuda"}, "dist": {"backend": "gloo", "world_size": 3}})
    check_device(gloo, local_world_size=3)  # no refusal
    env = detect_environment({"RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "3",
                              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})  # fmt: skip
    assert claim_device(env, "cuda", 1) == torch.device("cuda", 0)
    nccl = Config.from_dict({"trainer": {"device": "cuda"}, "dist": {"backend": "nccl", "world_size": 2}})
    with pytest.raises(ConfigError, match=r"2 ranks on this machine but only 1 CUDA device\(s\), and NCCL refuses "):
        check_device(nccl, local_world_size=2)
