"""How often ``ddptrain doctor`` names a cause on a healthy run: the tutorial Net, nothing injected.

    .venv/bin/python scripts/doctor_false_alarms.py                       # gloo and mpi, 3 ranks, 2 launches each
    .venv/bin/python scripts/doctor_false_alarms.py --backends gloo --world-size 2 --launches 4

Each launch fits the healthy scenario of ``tests/doctor/test_injected_causes.py`` (batch 32 per rank, a 10-step
window) ``--runs`` times in one process group. One line per run: its first cause and share, the
step, the wait for the batch and, of that wait, the time the rank had no core (medians, ms), and
the rest's share of the step (what the data_loading rule weighs against its 10% on such a host).
Last, how many runs were ``healthy``. 3 ranks on this 2-core VM is where the wait for a core is large.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from ddptrain.testing import run_distributed  # noqa: E402
from tests.doctor.tasks import run_doctored  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", nargs="+", default=["gloo", "mpi"], choices=["gloo", "mpi"])
    parser.add_argument("--world-size", type=int, default=3)
    parser.add_argument("--launches", type=int, default=2, help="process groups per backend")
    parser.add_argument("--runs", type=int, default=6, help="doctored fits per launch")
    args = parser.parse_args()
    ws, healthy, total = args.world_size, 0, 0
    print("| backend | first cause | share | step ms | wait for the batch ms | without a core ms | loading's share |")
    print("|---|---|---|---|---|---|---|")
    for backend in args.backends:
        for _ in range(args.launches):
            runs = [(f"h{i}", dict(model={"kind": "net"}, batch=32 * ws, steps=10)) for i in range(args.runs)]
            with tempfile.TemporaryDirectory() as root:
                reports = run_distributed(run_doctored, ws, runs, root, backend=backend, timeout_s=300)[0]
            for report in reports:
                first, b = report["causes"][0], report["breakdown"]
                healthy += first["cause"] == "healthy"
                total += 1
                print(
                    f"| {backend} | {first['cause']} | {first['share']:.3f} | {report['step_s'] * 1e3:.2f} | "
                    f"{b['data_s'] * 1e3:.2f} | {b['data_core_wait_s'] * 1e3:.2f} | "
                    f"{(b['data_s'] - b['data_core_wait_s']) / report['step_s']:.3f} |"
                )
    print(f"\nhealthy: {healthy} of {total} runs ({ws} ranks, {os.cpu_count()} cores)")
    print(json.dumps({"healthy": healthy, "runs": total, "world_size": ws}))
    return 0 if total else 1


if __name__ == "__main__":
    raise SystemExit(main())
