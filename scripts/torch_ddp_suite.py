#!/usr/bin/env python
"""torch's own DDP tests against torch's DDP and against ddptrain's, side by side.

Runs every DDP test of the ``distributed_test.py`` that the installed torch wheel ships (imported
from the wheel, not copied: ``tests/conformance/torch_distributed_suite.py``) twice, over gloo at
world size 2 — once with ``torch.nn.parallel.DistributedDataParallel``, once with
``ddptrain.ddp.DistributedDataParallel`` swapped in — and prints each test's two verdicts. A test
that needs GPUs skips for both (counted in the summary). Tests that read torch's private internals
are listed in ``docs/torch-ddp-conformance.md``; this script marks them ``(private)``.

Usage::

    .venv/bin/python scripts/torch_ddp_suite.py [-k SUBSTRING ...] [--json PATH] [--show-skipped]

Exit status: 0 when ours passes every test torch's passes here, except the private-internals ones;
1 otherwise. Takes about a minute on two cores (each test forks its two ranks).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PRIVATE_INTERNALS = {
    # test -> the private torch attribute or behaviour it reads (docs/torch-ddp-conformance.md)
    "test_ddp_logging_data_cpu": "DistributedDataParallel._get_ddp_logging_data()",
    "test_ddp_python_error_logged": "DistributedDataParallel._get_ddp_logging_data()",
    "test_ddp_comm_hook_logging": "DistributedDataParallel._get_ddp_logging_data()",
}
"""Tests of torch's private DDP internals, not of behaviour a user relies on: not counted."""


def run_one(impl: str, patterns: list[str], timeout: float) -> dict[str, dict]:
    """Each selected test's verdict ({"verdict": pass|fail|error|skip, "detail": ...}) for ``impl``."""
    with tempfile.TemporaryDirectory(prefix="ddptrain-suite-") as tmp:
        out = Path(tmp) / "verdicts.json"
        env = dict(os.environ, DDPTRAIN_SUITE_DDP=impl, TEMP_DIR=tmp, PYTHONPATH=str(REPO))
        env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        log = Path(tmp) / "log.txt"
        with open(log, "w") as sink:
            proc = subprocess.run(
                [sys.executable, "-m", "tests.conformance.verdicts", str(out), *patterns],
                cwd=REPO,
                env=env,
                stdout=sink,
                stderr=subprocess.STDOUT,
                timeout=timeout,
            )
        if proc.returncode != 0 or not out.exists():
            tail = log.read_text()[-4000:]
            raise SystemExit(f"the suite for {impl} did not complete (exit {proc.returncode}):\n{tail}")
        return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", dest="patterns", action="append", default=[], help="only tests whose name contains this")
    parser.add_argument("--json", type=Path, help="write both implementations' verdicts here")
    parser.add_argument("--show-skipped", action="store_true", help="list the skipped tests too")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per implementation (default 900)")
    args = parser.parse_args(argv)

    verdicts = {impl: run_one(impl, args.patterns, args.timeout) for impl in ("torch", "ours")}
    torch_v, ours_v = verdicts["torch"], verdicts["ours"]
    if args.json:
        args.json.write_text(json.dumps(verdicts, indent=1))
    width = max(len(n) for n in torch_v)
    print(f"| {'test':<{width}} | torch DDP | ddptrain DDP |")
    print(f"|{'-' * (width + 2)}|-----------|--------------|")
    skipped, missed = 0, []
    for name in sorted(torch_v):
        t, o = torch_v[name]["verdict"], ours_v.get(name, {"verdict": "absent"})["verdict"]
        if t == "skip" and o == "skip":
            skipped += 1
            if not args.show_skipped:
                continue
        note = f" (private: {PRIVATE_INTERNALS[name]})" if name in PRIVATE_INTERNALS else ""
        print(f"| {name:<{width}} | {t:<9} | {o + note} |")
        if t == "pass" and o != "pass" and name not in PRIVATE_INTERNALS:
            missed.append(name)
    ran = [n for n in torch_v if torch_v[n]["verdict"] != "skip"]
    print(
        f"\n{len(torch_v)} DDP tests; {skipped} skip for both (GPUs needed); of the {len(ran)} that run, torch "
        f"passes {sum(torch_v[n]['verdict'] == 'pass' for n in ran)}, ddptrain "
        f"{sum(ours_v.get(n, {}).get('verdict') == 'pass' for n in ran)}; "
        f"{len(PRIVATE_INTERNALS.keys() & set(ran))} read torch's private internals."
    )
    for name in missed:
        print(f"\nddptrain fails {name}: {ours_v[name]['detail']}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
