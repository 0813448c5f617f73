"""Callbacks see the trainer through a small documented protocol (callbacks/base.py), not the
whole Trainer: the package imports no trainer module, and uses nothing the protocol lacks."""

import ast
from pathlib import Path

import ddptrain.trainer.callbacks as callbacks_package
from ddptrain import Config, Trainer
from ddptrain.trainer.callbacks import (
    CheckpointCallback,
    CSVLogger,
    MLflowLogger,
    ProgressCallback,
    TensorBoardCallback,
    TrainerView,
    WandbLogger,
    from_config,
)
from tests.conftest import merged

PACKAGE = Path(callbacks_package.__file__).parent
MODULE = "ddptrain.trainer.callbacks"


def _sources():
    return {path.name: ast.parse(path.read_text()) for path in sorted(PACKAGE.glob("*.py"))}


def _imported_modules(tree, module):
    """Absolute names of everything a module imports, TYPE_CHECKING blocks included."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = module.split(".")
            base = base[: len(base) - node.level] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            yield target
            yield from (f"{target}.{alias.name}" for alias in node.names)


def test_the_callbacks_package_does_not_import_the_trainer():
    for name, tree in _sources().items():
        imported = set(_imported_modules(tree, f"{MODULE}.{name[:-3]}"))  # __init__: relative to the package
        # ddptrain.trainer.trainer itself, or the package, whose __init__ imports it
        assert not imported & {"ddptrain.trainer.trainer", "ddptrain.trainer", "ddptrain"}, (name, imported)


def test_callbacks_use_only_what_the_protocol_declares():
    declared = {name for name in dir(TrainerView) if not name.startswith("_")} | set(TrainerView.__annotations__)
    used = set()
    for tree in _sources().values():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "trainer":
                used.add(node.attr)
    assert used, "the scan found no use of the trainer: it is looking at the wrong thing"
    assert used <= declared, f"used by callbacks but missing from TrainerView: {sorted(used - declared)}"


def test_a_trainer_is_a_trainer_view(tmp_path):
    assert isinstance(Trainer(Config.from_dict({"trainer": {"output_dir": str(tmp_path)}})), TrainerView)
    assert not isinstance(object(), TrainerView)


def test_the_config_chooses_the_built_in_callbacks():
    def kinds(**trainer):
        return [type(c) for c in from_config(Config.from_dict({"trainer": trainer}).trainer)]

    assert kinds() == [ProgressCallback, TensorBoardCallback, CSVLogger, CheckpointCallback]
    assert kinds(loggers={"mlflow": True, "wandb": True, "csv": False, "tensorboard": False})[1:3] == [
        MLflowLogger,
        WandbLogger,
    ]
    off = {"loggers": {"tensorboard": False, "csv": False}, "checkpoint": {"every_epochs": 0, "at_end": False}}
    assert kinds(**off) == [ProgressCallback]
    assert kinds(**merged(off, {"checkpoint": {"every_steps": 5}})) == [ProgressCallback, CheckpointCallback]
    checkpoint = from_config(Config.from_dict({"trainer": {"checkpoint": {"every_steps": 5, "keep_last": 2}}}).trainer)[
        -1
    ]
    assert (checkpoint.every_steps, checkpoint.keep_last, checkpoint.every_epochs) == (5, 2, 1)
