"""``should_stop`` set in ``training_step`` on one rank ends the run after that very step, on every
rank, whichever engine started the ranks (its vote rides in that step's gradient all-reduce)."""

import json
from pathlib import Path

import pytest

from tests.conftest import PYTHON, REPO, TORCHRUN, run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

MPIRUN = Path(PYTHON).parent / "mpirun"
# 32 steps of 128 per epoch: step 8 is no epoch end, where the votes would be taken anyway.
ARGS = [
    "recipe=synthetic",
    "data.num_train_samples=4096",
    "data.num_val_samples=200",
    "trainer.epochs=1",
    "recipe.trainer_class=tests.e2e.stop_at_step.StopAtStep8",
]
ENGINES = {
    "local": ([], ["dist.world_size=2"]),
    "torchrun": ([TORCHRUN, "--standalone", "--nproc-per-node=2", "-m", "ddptrain"], ["launcher=torchrun"]),
    "mpirun": ([str(MPIRUN), "-n", "2", "--oversubscribe", PYTHON, "-m", "ddptrain"], ["launcher=mpirun"]),
}
MISSING = {"torchrun": not Path(TORCHRUN).exists(), "mpirun": not MPIRUN.exists()}


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_should_stop_in_training_step_ends_that_step_on_every_rank(tmp_path, engine):
    if MISSING.get(engine):
        pytest.skip(f"{engine} is not installed next to the Python used")
    prefix, extra = ENGINES[engine]
    run_dir = tmp_path / "run"
    proc = run_cli(
        *ARGS,
        *extra,
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
        timeout=200,
        prefix=prefix or None,
        env={"PYTHONPATH": str(REPO), "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ended = [(run_dir / f"ended_rank{r}.txt").read_text() for r in range(2)]
    assert ended == ["8", "8"], ended
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["step"] == 8 and metrics["stopped_early"] and metrics["params_agree"]
