"""The YAML in conf/ against the dataclasses: one source of truth for every default."""

import dataclasses

import pytest
import yaml

from ddptrain.cli.app import compose_config, package_config_dir, to_config
from ddptrain.config import Config

CONF = package_config_dir()
DEFAULT_OPTIONS = {"backend": "auto", "launcher": "local", "data": "mnist", "optimizer": "sgd", "trainer": "default"}
# The section each group writes to, for files without a "# @package" line of their own.
SECTION = {"backend": "dist", "launcher": "launcher", "data": "data", "optimizer": "optimizer", "trainer": "trainer"}


def _flat(tree, prefix=""):
    out = {}
    for key, value in (tree or {}).items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def _defaults() -> dict:
    return _flat(dataclasses.asdict(Config()))


def _file_keys(path) -> dict:
    """The dotted keys a group file sets, where they land in the config."""
    text = path.read_text()
    body = {k: v for k, v in (yaml.safe_load(text) or {}).items() if k != "defaults"}
    package = next((line.split()[-1] for line in text.splitlines() if line.startswith("# @package")), None)
    if package == "_global_":
        return _flat(body)
    return _flat(body, f"{package or SECTION[path.parent.name]}.")


@pytest.mark.parametrize("group", sorted(SECTION))
def test_group_files_hold_only_what_an_option_changes(group):
    defaults = _defaults()
    for path in sorted((CONF / group).glob("*.yaml")):
        for key, value in _file_keys(path).items():
            assert key in defaults, f"{path.name} sets {key}, which the schema does not have"
            assert value != defaults[key], f"{group}/{path.name} restates the default {key}={value!r}: delete it"


@pytest.mark.parametrize("group", sorted(SECTION))
def test_every_option_composes_into_the_schema_and_sets_what_its_file_says(group):
    for path in sorted((CONF / group).glob("*.yaml")):
        config = to_config(compose_config(["recipe=synthetic", f"{group}={path.stem}"]), None)
        composed = _flat(dataclasses.asdict(config))
        for key, value in _file_keys(path).items():
            assert composed[key] == value, f"{group}={path.stem}: {key} is {composed[key]!r}, the file says {value!r}"


def test_the_default_options_give_the_dataclass_defaults():
    composed = _flat(dataclasses.asdict(to_config(compose_config(["recipe=mnist"]), None)))
    defaults = _defaults()
    differ = {
        k: (composed[k], defaults[k]) for k in defaults if composed[k] != defaults[k] and not k.startswith("recipe.")
    }
    assert differ == {}, "composed defaults that disagree with ddptrain/config/"
    assert set(DEFAULT_OPTIONS.values()) <= {p.stem for g in DEFAULT_OPTIONS for p in (CONF / g).glob("*.yaml")}


def test_a_group_option_is_not_undone_by_a_later_group():
    """backend=nccl sets trainer.device=cuda; the trainer group composed after it must keep it."""
    config = to_config(compose_config(["recipe=mnist", "backend=nccl"]), None)
    assert (config.dist.backend, config.trainer.device) == ("nccl", "cuda")
    config = to_config(compose_config(["recipe=mnist", "backend=nccl", "trainer=smoke"]), None)
    assert (config.dist.backend, config.trainer.device, config.trainer.max_steps) == ("nccl", "cuda", 40)


def test_a_users_config_dir_adds_recipes(tmp_path):
    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "mine.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /data: synthetic\nrecipe:\n  name: mine\n"
        "  trainer_class: mytask.MyTrainer\n"
    )
    config = to_config(compose_config(["--config-dir", str(tmp_path), "recipe=mine"]), None)
    assert (config.recipe.trainer_class, config.data.name) == ("mytask.MyTrainer", "synthetic")
