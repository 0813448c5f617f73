"""Overrides checked against the schema before Hydra: did-you-mean for keys and group options."""

import pytest

from ddptrain.cli.overrides import (
    config_dirs_of,
    first_problem,
    flags_first,
    free_form_keys_added,
    group_options,
    override_tokens,
)
from ddptrain.config import LIGHTNING_KEYS

OPTIONS = {"recipe": ["fashion_mnist", "mnist", "synthetic"], "trainer": ["default", "smoke"]}


def test_flags_and_their_values_are_not_overrides():
    argv = ["-m", "--config-dir", "x", "recipe=mnist", "--cfg", "job", "-cd=y", "~trainer.resume", "+model.x=1"]
    assert override_tokens(argv) == ["recipe=mnist", "~trainer.resume", "+model.x=1"]


def test_config_dirs_come_from_the_flags(tmp_path):
    assert config_dirs_of(["--config-dir", "a", "--config-dir=b", "-cd", "c"], tmp_path) == [
        tmp_path,
        *map(__import__("pathlib").Path, ("a", "b", "c")),
    ]


def test_options_are_read_from_every_directory(tmp_path):
    for where, name in ((tmp_path / "one", "mnist"), (tmp_path / "two", "mine")):
        (where / "recipe").mkdir(parents=True)
        (where / "recipe" / f"{name}.yaml").write_text("")
    assert group_options([tmp_path / "one", tmp_path / "two"]) == {"recipe": ["mine", "mnist"]}


def test_known_keys_free_form_model_hydra_and_sweeps_pass():
    ok = [
        "trainer.epochs=3",
        "model.hidden=7",
        "+model.new_arg=1",
        "hydra.run.dir=x",
        "recipe=mnist,synthetic",
        "trainer=smoke",
        "optimizer.scheduler.name=cosine",
        "~trainer.resume",
    ]
    assert first_problem(ok, OPTIONS) is None


def test_a_typo_in_a_key_suggests_the_closest_key_anywhere():
    assert "Did you mean trainer.epochs?" in first_problem(["epochs=3"], OPTIONS)
    assert "Did you mean dist.bucket_cap_mb?" in first_problem(["dist.bucket_cap=5"], OPTIONS)
    assert "Keys under launcher: max_restarts, name, spares." in first_problem(["launcher.zzz=1"], OPTIONS)


def test_a_typo_under_a_large_section_points_at_the_listing_instead_of_printing_every_key():
    message = first_problem(["trainer.zzz=1"], OPTIONS)
    assert "--cfg job` prints them" in message
    assert "grad_accum_steps" not in message and "log_every_steps" not in message, message


@pytest.mark.parametrize("flag", sorted(LIGHTNING_KEYS))
def test_each_lightning_flag_maps_to_a_real_key(flag):
    ours = LIGHTNING_KEYS[flag]
    assert first_problem([f"{ours}=1"], OPTIONS) is None, f"{flag} maps to {ours}, which is not a key"
    for spelling in (f"trainer.{flag}=1", f"{flag}=1"):
        message = first_problem([spelling], OPTIONS) or ""
        if ours == spelling.split("=")[0]:
            continue  # trainer.max_steps is ours too
        assert f"Did you mean {ours}? (Lightning's Trainer({flag}=...)" in message, (spelling, message)


def test_lightning_habits_get_lightnings_advice_not_the_nearest_spelling():
    assert "Did you mean dist.world_size?" in first_problem(["trainer.devices=2"], OPTIONS)
    assert "trainer.device?" not in first_problem(["trainer.devices=2"], OPTIONS)
    assert "Did you mean trainer.grad_accum_steps?" in first_problem(["trainer.accumulate_grad_batches=2"], OPTIONS)
    assert "torchrun, mpirun or srun" in first_problem(["trainer.num_nodes=2"], OPTIONS)


def test_a_value_is_not_a_section():
    assert first_problem(["trainer.epochs.max=1"], OPTIONS) == (
        "trainer.epochs is a value, not a section: trainer.epochs.max does not exist."
    )


def test_an_unknown_option_lists_the_available_ones():
    message = first_problem(["recipe=mnst"], OPTIONS)
    assert "unknown recipe 'mnst'. Did you mean recipe=mnist? Available: fashion_mnist, mnist, synthetic" in message
    assert "unknown trainer 'fast'" in first_problem(["trainer=smoke,fast"], OPTIONS)


def test_ones_own_keys_are_added_and_flags_go_first_wherever_they_were_written():
    argv = ["recipe.params.a=1", "--config-dir", "recipe.params.d", "recipe.params.b=2", "+recipe.params.c=3", "x=1"]
    assert free_form_keys_added(argv) == [
        "++recipe.params.a=1",  # the first argument too
        "--config-dir",
        "recipe.params.d",  # a flag's value is left alone ...
        "++recipe.params.b=2",  # ... and what follows it is not
        "+recipe.params.c=3",
        "x=1",
    ]
    moved = flags_first(["a=1", "--config-dir", "d", "b=2", "-m", "c=3"])
    assert moved == ["--config-dir", "d", "-m", "a=1", "b=2", "c=3"]
