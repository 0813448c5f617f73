"""``python -m ddptrain.dump <run dir>``: every live rank's Python stack and ledger tail, now.

Reads the ranks' collective ledgers (``<run dir>/ledger/rank<N>.ledger``, or a ledger directory
given directly), asks each live rank for its stack with ``SIGUSR1`` (:mod:`ddptrain.comm.stacks`
answers it: the job goes on), names stopped and exited ranks, and compares the ledgers as a timeout
would. The local launcher prints the same on ``kill -USR1 <launcher pid>``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .comm.forensics import dump


def ledger_directory(path: str | Path) -> Path:
    """``path`` itself if it holds ledgers, else ``path/ledger``."""
    path = Path(path)
    return path if any(path.glob("rank*.ledger")) else path / "ledger"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddptrain.dump", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="the run directory (outputs/<recipe>/<date_time>) or a ledger directory")
    args = parser.parse_args(argv)
    directory = ledger_directory(args.run_dir)
    if not directory.is_dir():
        print(
            f"ddptrain.dump: no ledger directory at {directory}: pass a run directory of a job started by "
            "`python -m ddptrain` (or the DDPTRAIN_LEDGER_DIR its ranks used)",
            file=sys.stderr,
        )
        return 2
    print(dump(directory))
    return 0


if __name__ == "__main__":
    sys.exit(main())
