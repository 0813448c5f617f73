"""scripts/mutate.py's planting: which mutants it makes of a piece of source, and that each one is
that source with exactly one change (the tool's runs are in docs/contributing.md)."""

import ast
import importlib.util
import sys

from tests.conftest import REPO

_spec = importlib.util.spec_from_file_location("mutate", REPO / "scripts" / "mutate.py")
mutate = importlib.util.module_from_spec(_spec)
sys.modules["mutate"] = mutate  # its dataclass looks its module up there
_spec.loader.exec_module(mutate)

SOURCE = '''LIMIT = 3


def clip(value, low, high):
    """Docstrings are not mutated."""
    if value < low and not high:
        return low + 1
    record(value, strict=True, loose=False)
    total = (value  # an operation over two lines is left alone: its replacement would reflow them
             * low)
    return value * 2
'''


def test_each_mutant_is_one_plausible_slip_and_the_rest_is_untouched():
    mutants = mutate.mutants_of(SOURCE)
    changed = [(m.line, m.what, m.apply(SOURCE).splitlines()[m.line - 1].strip()) for m in mutants]
    assert sorted(changed) == sorted(
        [
            (1, "3 -> 4", "LIMIT = 4"),
            (6, "condition negated", "if not (value < low and (not high)):"),
            (6, "And -> Or", "if value < low or not high:"),
            (6, "Lt -> LtE", "if value <= low and not high:"),
            (6, "not dropped", "if value < low and high:"),
            (7, "Add -> Sub", "return low - 1"),
            (7, "1 -> 2", "return low + 2"),
            (8, "call deleted", "pass"),
            (8, "True -> False", "record(value, strict=False, loose=False)"),
            (8, "False -> True", "record(value, strict=True, loose=True)"),
            (11, "Mult -> Div", "return value / 2"),
            (11, "2 -> 3", "return value * 3"),
        ]
    )
    assert [m.start for m in mutants] == sorted(m.start for m in mutants)  # source order: --seed draws the same
    for m in mutants:
        planted = m.apply(SOURCE)
        ast.parse(planted)  # still Python
        others = [i for i, (a, b) in enumerate(zip(SOURCE.splitlines(), planted.splitlines())) if a != b]
        assert others == [m.line - 1] and m.function == ("<module>" if m.line == 1 else "clip"), m


def test_folders_are_split_into_their_test_files_and_node_ids_kept():
    units = mutate.test_units(["tests/zero", "tests/unit/test_tune.py::test_the_plot_closes_its_figure"])
    assert "tests/zero/test_optimizer.py" in units and "tests/zero/__init__.py" not in units
    assert units[-1] == "tests/unit/test_tune.py::test_the_plot_closes_its_figure"
