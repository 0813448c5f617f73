"""Helpers for testing distributed code, in ddptrain's own suite and in users' CI.

* :func:`run_threaded` — N ranks as threads of this process over a :class:`ThreadedProcessGroup`
  (the full ProcessGroup interface in memory): DDP, comm hooks, collectives and the Trainer's
  loop at 2-8 ranks in milliseconds. The default for logic tests.
* :func:`run_distributed` — N real processes joined by a real backend (gloo, mpi): for what
  needs processes — sockets, MPI, signals, crashes.

Both return each rank's return value and fail with the failing rank's error; both have hard
timeouts, so a test can never hang.
"""

from .processes import run_distributed
from .threaded import PeerFailedError, ThreadedProcessGroup, ThreadedWorld, run_threaded

__all__ = ["run_threaded", "run_distributed", "ThreadedProcessGroup", "ThreadedWorld", "PeerFailedError"]
