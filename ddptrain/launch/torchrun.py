"""``ddptrain torchrun ...``: torchrun, with the exit a ddptrain job has on every other launcher.

torchrun's agent answers Ctrl-C (SIGINT) or SIGTERM by raising ``SignalException``: once its
workers are gone (ddptrain's ranks stop at an agreed step with a checkpoint and say how to resume),
it ends with that exception's traceback and exit status 1. This runs the same torchrun
(``torch.distributed.run.main``, every argument as torchrun takes it) and ends such a stop with one
line and ``128 + signal`` instead: 130 for Ctrl-C, 143 for SIGTERM. Anything else ends as torchrun
ends it. Usage, as torchrun's::

    ddptrain torchrun --standalone --nproc-per-node=2 -m ddptrain recipe=mnist launcher=torchrun
"""

from __future__ import annotations

import signal
import sys


def main(argv: list[str]) -> None:
    """Run torchrun with ``argv`` (what follows ``ddptrain torchrun``)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun

    try:
        torchrun(list(argv))
    except SignalException as exc:
        name = signal.Signals(exc.sigval).name
        print(f"ddptrain: torchrun stopped by {name}; each rank's last lines say where it stopped", file=sys.stderr)
        sys.exit(128 + exc.sigval)
