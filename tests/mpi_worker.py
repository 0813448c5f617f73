"""Run under a bare `mpiexec` (not ddptrain's launcher) by tests/dist/test_mpi.py: what a user's own
`mpirun -n 2 python script.py` meets. The collectives and DDP run on mpi through
`run_distributed(..., backend="mpi")` in tests/dist/test_comm_*.py and test_ddp.py."""

import sys

import ddptrain.comm as dist
from ddptrain.comm.types import RendezvousError

if len(sys.argv) > 1 and sys.argv[1] == "wrong-size":
    try:
        dist.init_process_group("mpi", world_size=5)
    except RendezvousError as exc:
        print("refused:", exc)
    sys.exit(0)

if len(sys.argv) > 1 and sys.argv[1] == "crash":
    dist.init_process_group("mpi", timeout=60)
    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 crashes on purpose")
    dist.barrier()  # rank 0 would wait here for ever: mpiexec must end the job instead
    sys.exit(0)
