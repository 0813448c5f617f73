"""``--help KEY``: the documentation of keys, sections and groups, read from the schema's source."""

from pathlib import Path

import ddptrain.conf
from ddptrain.cli.overrides import describe_topic, group_options

OPTIONS = group_options([Path(ddptrain.conf.__file__).resolve().parent])


def test_a_key_shows_its_type_default_and_docstring():
    text, problem = describe_topic("dist.world_size", OPTIONS)
    assert problem is None
    assert text.startswith(
        "dist.world_size (int, >= 1, default: 2)\n    Local worker processes started by ``launcher=local``."
    )


def test_a_section_lists_every_key_nested_sections_included():
    text, _ = describe_topic("optimizer", OPTIONS)
    assert "optimizer.betas (list, two numbers in [0, 1), default: [0.9, 0.999])" in text
    assert "optimizer.scheduler.warmup_steps (int, >= 0, default: 0)" in text
    assert "Options (optimizer=<name>, each sets several keys): adamw, sgd." in text


def test_every_key_of_the_schema_is_documented():
    from ddptrain.config import Config, leaf_keys

    for key in leaf_keys(Config):
        text, problem = describe_topic(key, OPTIONS)
        assert problem is None and "(undocumented)" not in text, key


def test_unknown_names_get_the_typo_advice():
    assert describe_topic("trainer.max_stepz", OPTIONS)[1].startswith(
        "unknown config key trainer.max_stepz. Did you mean trainer.max_steps?"
    )
    assert "Did you mean trainer?" in describe_topic("traner", OPTIONS)[1]
    assert describe_topic("trainer.epochs.x", OPTIONS)[1] == (
        "trainer.epochs is a value, not a section: trainer.epochs.x does not exist."
    )
