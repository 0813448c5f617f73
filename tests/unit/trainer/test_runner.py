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
