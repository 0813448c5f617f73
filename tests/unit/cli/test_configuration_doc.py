"""docs/configuration.md is the schema's own documentation, regenerated, not a copy kept by hand."""

from ddptrain.cli.overrides import configuration_markdown, schema_entries
from ddptrain.config import Config
from tests.conftest import REPO


def test_the_configuration_page_is_current():
    page = (REPO / "docs" / "configuration.md").read_text()
    assert page == configuration_markdown(), "run .venv/bin/python scripts/gen_config_docs.py"


def test_every_key_of_the_schema_is_on_the_page_with_its_default():
    page = configuration_markdown()
    sections = [(n, d) for n, t, d, _ in schema_entries(Config) if t is not None]  # model: free-form, its own heading
    keys = [(name, default) for name, default in sections if "." in name]
    assert len(keys) > 80  # every section's keys, nested ones (trainer.early_stopping.*) included
    for name, default in keys:
        assert f"- **`{name}`** (" in page and f"default `{default}`" in page, name
    for key in ("trainer.epochs", "trainer.max_steps", "trainer.resume", "dist.world_size", "data.download"):
        assert f"- **`{key}`** (" in page
