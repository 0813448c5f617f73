#!/usr/bin/env python
"""Mutation testing: plant small bugs in one module, run the tests that should catch them, list survivors.

Usage::

    .venv/bin/python scripts/mutate.py ddptrain/ddp/reducer.py --tests tests/unit/ddp tests/conformance
    .venv/bin/python scripts/mutate.py ddptrain/ddp/reducer.py --since main~3 --sample 25 --tests ...
    .venv/bin/python scripts/mutate.py ddptrain/ddp/reducer.py --list      # the mutants, nothing run

Each mutant is one small change a developer could plausibly make: an operator swapped (``+``/``-``,
``*``/``/``, ``<``/``<=``, ``==``/``!=``, ``in``/``not in``, ``and``/``or``), a ``not`` dropped, a
condition negated, a constant changed (``True``/``False``, ``n``/``n+1``), a call statement deleted.
The mutant is written into the module **in place**, so that every process the tests start — the
ranks that ``run_distributed``, the CLI, torchrun or mpirun spawn — imports it; the original is
restored after each run, on an error and on Ctrl-C too (and a ``.orig`` copy stays beside the module
while the tool runs). That is why this is our own tool: mutmut 3 runs the tests against a copy of the
sources in ``mutants/``, which the spawned ranks (importing the installed package) never see, so every
mutant of code that runs in a rank would survive.

A mutant is **killed** when the tests fail (or time out), **survived** when they pass. Survivors
are printed with their diff. Read each one (docs/contributing.md): a real gap (write the test that
kills it, from outside the code), an equivalent mutant (the same behaviour; say why), or dead code
(delete it).

**Tests chosen by coverage** (the default): ``--tests`` names candidates (files, directories or node
ids). Before planting anything, each candidate file runs once under coverage.py, in every process it
starts (``patch = subprocess, fork, _exit``: the ranks, the CLI, the fork server's children), and the
tool records which lines of the module it executed. A mutant then runs only the candidates that
executed its line; a mutant no candidate reaches is reported ``uncovered`` (a survivor: no test sees
that line). That pass is also the unmutated run that must pass (a file that failed under coverage
runs again plainly). ``--all-tests`` skips the coverage pass and runs every candidate for every mutant.

Options: ``--since REV`` keeps the mutants on lines changed since REV (what a change touched);
``--functions a,b`` those inside these functions; ``--sample N`` (seed ``--seed``) draws N of them;
``--timeout`` bounds each test run. The tests run with ``-x`` so that a killed mutant costs seconds.
Exit status: 0 when no mutant survived, 1 otherwise.
"""

from __future__ import annotations

import argparse
import ast
import copy
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTHON = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv" / "bin" / "python").exists() else sys.executable

_SWAPS = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.Div,
    ast.Div: ast.Mult,
    ast.FloorDiv: ast.Mult,
    ast.Mod: ast.FloorDiv,
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
    ast.And: ast.Or,
    ast.Or: ast.And,
}


@dataclass(frozen=True)
class Mutant:
    """One planted change: replace ``source[start:end]`` (character offsets) with ``replacement``."""

    line: int
    start: int
    end: int
    replacement: str
    what: str
    function: str

    def apply(self, source: str) -> str:
        return source[: self.start] + self.replacement + source[self.end :]

    def diff(self, source: str) -> str:
        old = source.splitlines()[self.line - 1]
        new = self.apply(source).splitlines()[self.line - 1]
        return f"  line {self.line} ({self.function}): {self.what}\n  - {old.strip()}\n  + {new.strip()}"


def _offsets(source: str) -> list[int]:
    """Character offset of the start of each line (1-based line numbers index it)."""
    starts, total = [0, 0], 0
    for line in source.splitlines(keepends=True):
        total += len(line)
        starts.append(total)
    return starts


def mutants_of(source: str) -> list[Mutant]:
    """Every mutant of ``source``, in source order."""
    tree = ast.parse(source)
    line_start = _offsets(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}

    def span(node):
        return line_start[node.lineno] + node.col_offset, line_start[node.end_lineno] + node.end_col_offset

    def function_of(node):
        while node is not None and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            node = parents.get(node)
        return node.name if node is not None else "<module>"

    found: list[Mutant] = []

    def add(node, new_node, what):
        if getattr(node, "end_lineno", None) is None or node.lineno != node.end_lineno:
            return  # one line only: the replacement is unparsed, and must not reflow a block
        start, end = span(node)
        found.append(Mutant(node.lineno, start, end, ast.unparse(new_node), what, function_of(node)))

    for node in ast.walk(tree):
        if isinstance(node, (ast.BinOp, ast.AugAssign)) and type(node.op) in _SWAPS:
            new = copy.deepcopy(node)
            new.op = _SWAPS[type(node.op)]()
            add(node, new, f"{type(node.op).__name__} -> {type(new.op).__name__}")
        elif isinstance(node, ast.Compare):
            for k, op in enumerate(node.ops):
                if type(op) in _SWAPS:
                    new = copy.deepcopy(node)
                    new.ops[k] = _SWAPS[type(op)]()
                    add(node, new, f"{type(op).__name__} -> {type(new.ops[k]).__name__}")
        elif isinstance(node, ast.BoolOp):
            new = copy.deepcopy(node)
            new.op = _SWAPS[type(node.op)]()
            add(node, new, f"{type(node.op).__name__} -> {type(new.op).__name__}")
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            add(node, node.operand, "not dropped")
        elif isinstance(node, (ast.If, ast.While)) and not isinstance(node.test, ast.UnaryOp):
            add(node.test, ast.UnaryOp(ast.Not(), node.test), "condition negated")
        elif isinstance(node, ast.Constant):  # booleans and integers only (strings, docstrings too, stay)
            if node.value is True or node.value is False:
                add(node, ast.Constant(not node.value), f"{node.value} -> {not node.value}")
            elif type(node.value) is int:
                add(node, ast.Constant(node.value + 1), f"{node.value} -> {node.value + 1}")
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            add(node, ast.Pass(), "call deleted")
    found.sort(key=lambda m: (m.start, m.what))
    return found


def changed_lines(path: Path, since: str) -> set[int]:
    """Line numbers of ``path`` added or changed since git revision ``since``."""
    diff = subprocess.run(
        ["git", "diff", "-U0", since, "--", str(path)], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    lines: set[int] = set()
    for m in re.finditer(r"^@@ -\S+ \+(\d+)(?:,(\d+))? @@", diff, re.MULTILINE):
        first, count = int(m.group(1)), int(m.group(2) or 1)
        lines.update(range(first, first + count))
    return lines


def run_tests(tests: list[str], timeout: float) -> tuple[str, float, str]:
    """('killed' | 'survived' | 'timeout', seconds, the failure's first line) for one run."""
    started = time.monotonic()
    command = [PYTHON, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", *tests]
    try:
        proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", time.monotonic() - started, f"no verdict within {timeout:.0f} s"
    seconds = time.monotonic() - started
    if proc.returncode == 0:
        return "survived", seconds, ""
    failure = next((ln for ln in proc.stdout.splitlines() if ln.startswith(("FAILED", "ERROR", "E "))), "")
    return "killed", seconds, failure[:200]


def test_units(tests: list[str]) -> list[str]:
    """The candidates as units the coverage pass can run one by one: each test file under a
    directory, a file or a node id as given."""
    units: list[str] = []
    for t in tests:
        path = REPO / t.split("::")[0]
        if path.is_dir():
            units.extend(str(f.relative_to(REPO)) for f in sorted(path.rglob("test_*.py")))
        else:
            units.append(t)
    return units


_COVERAGE_RC = """[run]
parallel = true
data_file = {data}
include = {module}
patch = subprocess, fork, _exit
"""


def lines_run_by(unit: str, module: Path, workdir: Path, timeout: float) -> tuple[set[int], bool]:
    """The lines of ``module`` that the tests of ``unit`` execute, in every process they start, and
    whether those tests passed."""
    import coverage  # a dev dependency: only this mode needs it

    workdir.mkdir(parents=True)
    rc = workdir / "coveragerc"
    rc.write_text(_COVERAGE_RC.format(data=workdir / ".coverage", module=module))
    env = {**os.environ, "COVERAGE_RCFILE": str(rc)}
    command = [PYTHON, "-m", "coverage", "run", "-m", "pytest", "-q", "-p", "no:cacheprovider", unit]
    try:
        passed = subprocess.run(command, cwd=REPO, env=env, capture_output=True, timeout=timeout).returncode == 0
    except subprocess.TimeoutExpired:
        passed = False  # what ran until then still counts
    combiner = coverage.Coverage(data_file=str(workdir / ".coverage"), config_file=str(rc))
    combiner.combine([str(workdir)], keep=False)
    return set(combiner.get_data().lines(str(module)) or ()), passed


def coverage_map(units: list[str], module: Path, timeout: float) -> tuple[dict[str, set[int]], list[str]]:
    """unit -> the lines of ``module`` it executes (one coverage run per unit), and the units whose
    tests failed in that run."""
    covered, failed = {}, []
    with tempfile.TemporaryDirectory(prefix="mutate-coverage-") as tmp:
        for k, unit in enumerate(units):
            started = time.monotonic()
            covered[unit], passed = lines_run_by(unit, module, Path(tmp) / str(k), timeout)
            if not passed:
                failed.append(unit)
            seconds = time.monotonic() - started
            print(f"  coverage: {unit} runs {len(covered[unit])} lines ({seconds:.0f} s)", flush=True)
    return covered, failed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("module", type=Path, help="the file to mutate, e.g. ddptrain/ddp/reducer.py")
    ap.add_argument("--tests", nargs="+", default=[], help="test paths or node ids that should catch the mutants")
    ap.add_argument("--since", help="only lines changed since this git revision")
    ap.add_argument("--functions", help="only inside these functions (comma-separated)")
    ap.add_argument("--sample", type=int, default=0, help="draw this many mutants (0: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=300, help="seconds per test run (default 300)")
    ap.add_argument("--list", action="store_true", help="print the mutants and exit")
    ap.add_argument("--all-tests", action="store_true", help="run every candidate for every mutant (no coverage pass)")
    args = ap.parse_args(argv)

    path = (REPO / args.module).resolve() if not args.module.is_absolute() else args.module
    source = path.read_text()
    mutants = mutants_of(source)
    if args.since:
        lines = changed_lines(path, args.since)
        mutants = [m for m in mutants if m.line in lines]
    if args.functions:
        wanted = set(args.functions.split(","))
        mutants = [m for m in mutants if m.function in wanted]
    if args.sample and len(mutants) > args.sample:
        mutants = sorted(random.Random(args.seed).sample(mutants, args.sample), key=lambda m: m.start)
    if args.list or not mutants:
        for m in mutants:
            print(m.diff(source))
        print(f"{len(mutants)} mutants of {args.module}")
        return 0
    if not args.tests:
        ap.error("--tests is required to run the mutants (the tests that cover the module)")

    print(f"{len(mutants)} mutants of {args.module}; tests: {' '.join(args.tests)}")
    units = test_units(args.tests)
    covered = None
    # The unmutated run: the coverage pass is one; a file that failed under coverage (tracing
    # slows it: a duration bound may fail) runs again plainly, and only that verdict counts.
    if args.all_tests:
        unproven = args.tests
    else:
        covered, unproven = coverage_map(units, path, args.timeout)
    if unproven:
        verdict, seconds, failure = run_tests(unproven, args.timeout)
        if verdict != "survived":
            print(f"the tests fail without any mutant ({verdict}: {failure}): fix them first", file=sys.stderr)
            return 2
    print("unmutated: the tests pass")

    backup = path.with_suffix(path.suffix + ".orig")
    shutil.copyfile(path, backup)
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    results = []
    try:
        for n, m in enumerate(mutants, 1):
            chosen = args.tests if covered is None else [u for u in units if m.line in covered[u]]
            if chosen:
                path.write_text(m.apply(source))
                verdict, seconds, failure = run_tests(chosen, args.timeout)
                path.write_text(source)
            else:
                verdict, seconds, failure = "uncovered", 0.0, ""
            results.append((m, verdict, failure))
            print(
                f"[{n}/{len(mutants)}] {verdict:9s} {seconds:5.0f} s  line {m.line} {m.what}"
                f"  ({len(chosen)} test file{'s' * (len(chosen) != 1)})" + (f"\n      by {failure}" if failure else ""),
                flush=True,
            )
    finally:
        path.write_text(source)
        backup.unlink(missing_ok=True)
        signal.signal(signal.SIGTERM, previous)

    survivors = [(m, v) for m, v, _ in results if v in ("survived", "uncovered")]
    killed = len(results) - len(survivors)
    uncovered = sum(v == "uncovered" for _, v in survivors)
    print(
        f"\n{args.module}: {len(results)} mutants, {killed} killed, {len(survivors)} survived"
        f" ({uncovered} on lines no candidate test runs)"
    )
    for m, v in survivors:
        print(f"\n{v}:\n" + m.diff(source))
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
