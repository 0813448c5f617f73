"""Running a job from a Config: refusing what cannot work before any worker starts."""

import pytest

from ddptrain import Config, ConfigError, run

LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "PMI_RANK",
    "SLURM_PROCID",
)


def _outside_any_launcher(monkeypatch) -> None:
    for var in LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)


def test_run_refuses_a_launcher_that_did_not_start_us(monkeypatch):
    _outside_any_launcher(monkeypatch)
    config = Config.from_dict({"launcher": {"name": "torchrun"}})
    with pytest.raises(
        ConfigError,
        match=r"launcher=torchrun, but this process was not started by torchrun.*"
        r"torchrun --nproc-per-node=2 -m ddptrain",
    ):
        run(config)
    config = Config.from_dict({"recipe": {"trainer_class": "torch.nn.Linear"}})
    with pytest.raises(ConfigError, match="not a subclass of ddptrain.Trainer"):
        run(config)


ELASTIC = {"trainer": {"elastic": True, "world_size_invariant": True}, "dist": {"world_size": 4}}


def _as_torchrun_worker(monkeypatch, world_size: int, local_world_size: int) -> None:
    _outside_any_launcher(monkeypatch)
    env = {"RANK": 0, "WORLD_SIZE": world_size, "LOCAL_RANK": 0, "LOCAL_WORLD_SIZE": local_world_size}
    env |= {"GROUP_RANK": 0, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 29500, "TORCHELASTIC_RUN_ID": "t"}
    for var, value in env.items():
        monkeypatch.setenv(var, str(value))


def _as_mpi_rank(monkeypatch) -> None:
    _outside_any_launcher(monkeypatch)
    for var in ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"):
        monkeypatch.setenv(var, "0")
    for var in ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        monkeypatch.setenv(var, "4")


def test_an_elastic_job_under_another_launcher_is_refused_where_that_launcher_would_undo_it(monkeypatch):
    _as_torchrun_worker(monkeypatch, world_size=2, local_world_size=2)
    with pytest.raises(
        ConfigError, match=r"trainer.elastic=true under torchrun needs the job's store.*python -m ddptrain.store"
    ):
        run(Config.from_dict(ELASTIC))
    _as_torchrun_worker(monkeypatch, world_size=4, local_world_size=2)  # one torchrun over two nodes
    store = {**ELASTIC, "dist": {**ELASTIC["dist"], "elastic_store": "10.0.0.1:29400"}}
    with pytest.raises(
        ConfigError,
        match=r"over several nodes: when one worker fails, torchrun restarts the workers of every node.*--nnodes=1",
    ):
        run(Config.from_dict(store))
    _as_mpi_rank(monkeypatch)  # mpirun ends the whole job when one rank dies
    with pytest.raises(ConfigError, match=r"elastic=true cannot run under mpirun: an MPI job cannot lose a process"):
        run(Config.from_dict(store))
    _outside_any_launcher(monkeypatch)
    with pytest.raises(
        ConfigError, match=r"dist.elastic_store=10.0.0.1:29400, but this process was not started by another launcher"
    ):
        run(Config.from_dict(store))


def test_fit_refuses_a_doctor_it_was_not_given(tmp_path):
    """trainer.doctor is the doctor's callbacks' work: the runner adds them, a bare fit() must not
    silently run without them."""
    from ddptrain import Trainer, plugin_callbacks

    config = Config.from_dict(
        {
            "data": {"name": "synthetic", "num_train_samples": 256, "num_val_samples": 64},
            "model": {"_target_": "recipes.mnist.Net"},
            "trainer": {"doctor": True, "max_steps": 3, "output_dir": str(tmp_path / "a"), "progress": "false"},
            "doctor": {"warmup_steps": 1, "steps": 2},
            "dist": {"world_size": 1},
        }
    )
    with pytest.raises(ConfigError, match=r"trainer.doctor: .*callbacks=ddptrain.plugin_callbacks\(config\)"):
        Trainer(config).fit()
    Trainer(config, callbacks=plugin_callbacks(config)).fit()  # as the message says
    assert (tmp_path / "a" / "doctor.json").is_file()


def test_a_dataset_name_the_default_data_hooks_cannot_read_is_refused_before_any_worker_starts(tmp_path):
    from ddptrain import Trainer

    config = Config.from_dict({"data": {"name": "cifar10"}, "trainer": {"output_dir": str(tmp_path)}})
    with pytest.raises(
        ConfigError,
        match=r"data.name='cifar10' is not one of ddptrain's datasets \(mnist, fashion_mnist, synthetic\); "
        r"to train on other data, override train_dataloader in Trainer",
    ):
        run(config)

    class OwnData(Trainer):  # brings its own data: data.name is nobody's business
        def train_dataloader(self):
            raise AssertionError("not called by prepare_data")

        def val_dataloader(self):
            raise AssertionError("not called by prepare_data")

    OwnData.prepare_data(config)
