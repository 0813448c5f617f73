"""Trainer configuration: dataclasses from dictionaries, validation errors that name the fix."""

import dataclasses
import re

import pytest
import torch

from ddptrain.config import Config, ConfigError, TrainerConfig, check_fields, field_type_text, max_time_seconds
from ddptrain.preflight import per_rank_batch_size, resolve_backend, validate


def test_defaults_are_the_tutorial():
    c = Config()
    assert (c.optimizer.name, c.optimizer.lr, c.optimizer.momentum) == ("sgd", 0.01, 0.5)
    assert (c.data.global_batch_size, c.trainer.epochs, c.trainer.seed, c.dist.world_size) == (128, 10, 1234, 2)
    assert per_rank_batch_size(c, 2) == 64


def test_every_field_has_a_docstring():
    import ast
    import inspect

    import ddptrain.config as module

    tree = ast.parse(inspect.getsource(module))
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name.endswith("Config"):
            body = node.body
            for i, stmt in enumerate(body):
                if isinstance(stmt, ast.AnnAssign):
                    nxt = body[i + 1] if i + 1 < len(body) else None
                    assert isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant), (
                        f"{node.name}.{stmt.target.id} has no docstring"
                    )


def test_from_dict_nested_and_coerced():
    c = Config.from_dict(
        {
            "trainer": {"epochs": 3.0, "grad_clip_norm": 1},
            "optimizer": {"scheduler": {"name": "cosine"}},
            "model": {"_target_": "x.Y", "width": 3},
        }
    )
    assert c.trainer.epochs == 3 and isinstance(c.trainer.epochs, int)
    assert c.trainer.grad_clip_norm == 1.0 and isinstance(c.trainer.grad_clip_norm, float)
    assert c.optimizer.scheduler.name == "cosine" and c.model["width"] == 3
    assert Config.from_dict(c.to_dict()) == c


def test_unknown_key_suggests_the_closest():
    with pytest.raises(ConfigError, match=r"unknown config key trainer\.epoch\. Did you mean trainer\.epochs\?"):
        Config.from_dict({"trainer": {"epoch": 3}})
    with pytest.raises(ConfigError, match="unknown config key optimiser"):
        Config.from_dict({"optimiser": {}})


@pytest.mark.parametrize(
    "section,key,value,words",
    [
        ("trainer", "epochs", "ten", "must be an integer"),
        ("trainer", "deterministic", "yes", "must be true or false"),
        ("optimizer", "lr", True, "must be a number"),
        ("trainer", "epochs", 2.5, "must be an integer"),
    ],
)
def test_wrong_types_name_the_key(section, key, value, words):
    with pytest.raises(ConfigError, match=rf"{section}\.{key} {words}"):
        Config.from_dict({section: {key: value}})


def test_global_batch_not_divisible_names_both_numbers_and_the_fix():
    c = Config()
    with pytest.raises(ConfigError) as info:
        validate(c, 3)
    msg = str(info.value)
    assert "data.global_batch_size=128" in msg and "dist.world_size=3" in msg
    assert "multiple of 3" in msg and "(1, 2, 4, 8" in msg
    c = Config.from_dict({"trainer": {"grad_accum_steps": 3}})
    with pytest.raises(ConfigError, match=r"dist.world_size=2 x trainer.grad_accum_steps=3 = 6"):
        validate(c, 2)
    assert per_rank_batch_size(Config.from_dict({"trainer": {"grad_accum_steps": 2}}), 2) == 32


@pytest.mark.parametrize(
    "changes,match",
    [
        ({"trainer": {"epochs": 0}}, "trainer.epochs=0 must be at least 1"),
        ({"optimizer": {"name": "sdg"}}, r"optimizer.name='sdg' is not one of sgd, adam, adamw \(did you mean sgd\?\)"),
        ({"launcher": {"name": "slurm"}}, "launcher.name='slurm' is not one of local, torchrun, mpirun"),
        ({"trainer": {"max_steps": 0}}, "trainer.max_steps=0 must be at least 1"),
        ({"trainer": {"device": "tpu"}}, "trainer.device='tpu': use 'cpu' or 'cuda'"),
        ({"dist": {"backend": "nccl"}}, "dist.backend=nccl needs trainer.device=cuda"),
        ({"trainer": {"checkpoint": {"keep_last": 0}}}, "trainer.checkpoint.keep_last=0 must be at least 1"),
    ],
)
def test_validation_errors(changes, match):
    with pytest.raises(ConfigError, match=match):
        validate(Config.from_dict(changes), 2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_gpu_is_a_clear_error():
    with pytest.raises(
        ConfigError, match=r"trainer.device=cuda but torch.cuda.is_available\(\) is False.*trainer.device=cpu"
    ):
        validate(Config.from_dict({"trainer": {"device": "cuda"}}), 2)


def test_backend_resolution():
    cpu, cuda = Config(), Config(trainer=dataclasses.replace(TrainerConfig(), device="cuda"))
    assert resolve_backend(cpu) == "gloo" and resolve_backend(cuda) == "nccl"
    assert resolve_backend(cpu, "mpi", None) == "mpi" and resolve_backend(cpu, "mpi", "10.0.0.1") == "gloo"
    assert resolve_backend(Config.from_dict({"dist": {"backend": "gloo"}}), "mpi", None) == "gloo"


def _ruled_fields(node=None, prefix=""):
    """Every schema field with a rule of its own: ``(dotted key, field)``, walking a default Config."""
    node = Config() if node is None else node
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            yield from _ruled_fields(value, prefix + f.name + ".")
        elif "choices" in f.metadata or "bound" in f.metadata:
            yield prefix + f.name, f


def _with(key: str, value) -> Config:
    *sections, name = key.split(".")
    data: dict = {}
    node = data
    for section in sections:
        node = node.setdefault(section, {})
    node[name] = value
    return Config.from_dict(data)


RULED = list(_ruled_fields())


def test_the_schema_states_the_rules_of_its_choice_and_count_keys():
    keys = {key for key, _ in RULED}
    # A sample of each kind, so that a rule dropped from the schema (and so from validate and
    # --help) is noticed here, not by a user whose typo ran with a silent default.
    assert {"optimizer.name", "launcher.name", "dist.backend", "trainer.progress", "trainer.checkpoint.mode"} <= keys
    assert {"trainer.epochs", "trainer.max_steps", "optimizer.lr", "dist.timeout_s", "doctor.steps"} <= keys
    assert len(keys) >= 35, sorted(keys)


@pytest.mark.parametrize("key, field", RULED, ids=[key for key, _ in RULED])
def test_every_rule_of_the_schema_refuses_a_value_just_outside_it_and_takes_its_edge(key, field):
    rule_broken = re.compile(rf"^{re.escape(key)}=\S+ (must be|is not one of)")
    if "choices" in field.metadata:
        choices = field.metadata["choices"]
        bad = field.default + "x" if isinstance(field.default, str) else max(choices) + 1  # a stage, say
        edge = choices[-1]
    else:
        low, above = field.metadata["bound"]["at_least"], field.metadata["bound"]["above"]
        bad, edge = (low - 1, low) if low is not None else (above, above + 0.5)
    with pytest.raises(ConfigError) as info:
        validate(_with(key, bad), 2)
    assert rule_broken.match(str(info.value)), str(info.value)
    try:
        validate(_with(key, edge), 2)
    except ConfigError as exc:  # another rule (the batch split, say) may refuse the edge value
        assert not rule_broken.match(str(exc)), str(exc)


def test_progress_takes_the_spellings_of_a_yes_no_value():
    # A command line's trainer.progress=False reaches the schema as the string "False".
    for spelling, meant in (("False", "false"), (True, "true"), ("AUTO", "auto")):
        assert Config.from_dict({"trainer": {"progress": spelling}}).trainer.progress == meant
    with pytest.raises(ConfigError, match=r"trainer.progress='maybe' is not one of auto, true, false"):
        validate(Config.from_dict({"trainer": {"progress": "maybe"}}), 2)


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("00:00:00:01", 1.0),
        ("00:00:02:00", 120.0),
        ("00:03:00:00", 10800.0),
        ("01:02:03:04", 93784.0),
        ("00:23:59:59", 86399.0),
    ],
)
def test_max_time_counts_every_field_in_seconds(value, seconds):
    assert max_time_seconds(value) == seconds


def _trainer_check(**trainer):
    check_fields(Config.from_dict({"trainer": trainer}))


@pytest.mark.parametrize("value", [True, False, 1, 5])
def test_fast_dev_run_takes_true_false_or_a_number_of_batches_from_1(value):
    _trainer_check(fast_dev_run=value)


@pytest.mark.parametrize("value", [0, -2])
def test_fast_dev_run_below_1_batch_is_refused(value):
    rule = rf"trainer.fast_dev_run={value} must be true \(1 batch\), false, or a number"
    with pytest.raises(ConfigError, match=rule):
        _trainer_check(fast_dev_run=value)


@pytest.mark.parametrize("value", [None, 1, 7, 0.25, 1.0])
def test_a_batch_limit_is_a_count_from_1_or_a_fraction_up_to_the_whole_epoch(value):
    _trainer_check(limit_train_batches=value, limit_val_batches=value)


@pytest.mark.parametrize("value", [0, 0.0, 1.5, -0.5, True])
def test_a_batch_limit_outside_its_range_is_refused_with_the_rule(value):
    rule = r"must be a number of batches \(an integer >= 1\), a fraction of the epoch in \(0, 1\]"
    with pytest.raises(ConfigError, match=rule):
        _trainer_check(limit_train_batches=value)


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"optimizer": {"betas": [0.9]}}, r"optimizer.betas=\[0.9\] must hold two numbers in \[0, 1\)"),
        ({"optimizer": {"betas": [1.0, 0.999]}}, r"optimizer.betas=\[1.0, 0.999\] must hold two numbers"),
        ({"trainer": {"device": "tpu"}}, r"trainer.device='tpu': use 'cpu' or 'cuda'"),
        ({"trainer": {"precision": "8-mixed"}}, r"trainer.precision='8-mixed' is not one of 32, bf16-mixed"),
        ({"trainer": {"precision": "16-mixed"}}, r"trainer.precision=16-mixed needs trainer.device=cuda"),
    ],
)
def test_the_rules_of_precision_device_and_betas_sit_on_their_fields(section, message):
    """check_fields alone (the schema, no job) refuses them: each rule is written on its field."""
    with pytest.raises(ConfigError, match=message):
        check_fields(Config.from_dict(section))


def test_a_checked_fields_rule_is_shown_with_its_type():
    fields = {f.name: f for f in dataclasses.fields(TrainerConfig)}
    assert field_type_text(fields["precision"]) == "str, 32, bf16-mixed or 16-mixed (CUDA)"
    assert field_type_text(fields["device"]) == "str, cpu or cuda"
    check_fields(Config.from_dict({"trainer": {"precision": "bf16"}, "optimizer": {"betas": [0.0, 0.5]}}))
