"""Running a job from a Config: refusing what cannot work before any worker starts."""

import pytest

from ddptrain import Config, ConfigError, run


def test_run_refuses_a_launcher_that_did_not_start_us(monkeypatch):
    for var in (
        "RANK",
        "WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RUN_ID",
        "OMPI_COMM_WORLD_RANK",
        "PMI_RANK",
        "SLURM_PROCID",
    ):
        monkeypatch.delenv(var, raising=False)
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
        r"to train on other data, override train_dataset or train_dataloader in Trainer",
    ):
        run(config)

    class OwnData(Trainer):  # brings its own data: data.name is nobody's business
        def train_dataloader(self):
            raise AssertionError("not called by prepare_data")

        def val_dataloader(self):
            raise AssertionError("not called by prepare_data")

    OwnData.prepare_data(config)
