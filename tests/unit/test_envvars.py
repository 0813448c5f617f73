"""ddptrain.envvars: one table of every DDPTRAIN_* variable, read at use."""

import re
from pathlib import Path

import pytest

from ddptrain import envvars

PACKAGE = Path(envvars.__file__).resolve().parent


def test_every_variable_the_package_mentions_is_in_the_table():
    mentioned = set()
    for path in PACKAGE.rglob("*.py"):
        mentioned |= set(re.findall(r"DDPTRAIN_[A-Z0-9_]+", path.read_text()))
    assert mentioned - set(envvars.VARIABLES) == set()
    assert all(v.doc for v in envvars.VARIABLES.values())


def test_no_module_reads_a_ddptrain_variable_behind_the_tables_back():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"(environ|getenv)\W+(get\W+)?[\"']DDPTRAIN_", line) and path.name != "envvars.py":
                offenders.append(f"{path.name}:{n}: {line.strip()}")
    assert offenders == []


def test_values_are_read_at_use_not_at_import(monkeypatch):
    monkeypatch.setenv("DDPTRAIN_MPI_POLL_MAX_S", "0.25")
    assert envvars.get_float("DDPTRAIN_MPI_POLL_MAX_S") == 0.25
    monkeypatch.delenv("DDPTRAIN_MPI_POLL_MAX_S")
    assert envvars.get_float("DDPTRAIN_MPI_POLL_MAX_S") == 0.001


@pytest.mark.parametrize("raw,expected", [("1", True), ("true", True), ("YES", True), ("0", False), ("off", False)])
def test_flags(raw, expected):
    assert envvars.get_flag("DDPTRAIN_CHECK_COLLECTIVES", {"DDPTRAIN_CHECK_COLLECTIVES": raw}) is expected


def test_a_bad_flag_names_the_variable_and_the_accepted_values():
    with pytest.raises(ValueError, match=r"DDPTRAIN_STORE_BIND_ALL='maybe' is not a yes/no value: use 1 or 0"):
        envvars.get_flag("DDPTRAIN_STORE_BIND_ALL", {"DDPTRAIN_STORE_BIND_ALL": "maybe"})


def test_an_unknown_name_is_a_programming_error():
    with pytest.raises(KeyError):
        envvars.get_str("DDPTRAIN_NOT_IN_THE_TABLE")


def test_typos_in_the_environment_are_found_with_a_suggestion():
    found = envvars.unknown_variables({"DDPTRAIN_DATA_SOURCE": "/x", "DDPTRAIN_DATA": "/y", "PATH": "/bin"})
    assert found == ["DDPTRAIN_DATA_SOURCE (did you mean DDPTRAIN_DATA_SOURCES?)"]
