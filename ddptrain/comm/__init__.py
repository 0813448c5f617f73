"""ddptrain's communication layer: a drop-in for the ``torch.distributed`` calls of the tutorial.

``import ddptrain.comm as dist`` and the tutorial's examples run unchanged. Underneath, every
backend implements :class:`ProcessGroup`, which the DDP module uses directly.
"""

from .api import (
    GroupMember,
    all_gather,
    all_reduce,
    all_to_all,
    barrier,
    broadcast,
    destroy_process_group,
    gather,
    get_backend,
    get_process_group,
    get_rank,
    get_store,
    get_world_size,
    init_process_group,
    irecv,
    is_initialized,
    isend,
    new_group,
    recv,
    reduce,
    reduce_scatter,
    ring_all_reduce,
    scatter,
    send,
)
from .backends import BACKENDS, create_backend
from .process_group import ProcessGroup
from .store import Store, rendezvous
from .types import CommError, CommTimeoutError, CompletedWork, FutureWork, GroupError, ReduceOp, RendezvousError, Work

__all__ = [
    "ReduceOp",
    "Work",
    "CompletedWork",
    "FutureWork",
    "ProcessGroup",
    "Store",
    "rendezvous",
    "CommError",
    "CommTimeoutError",
    "GroupError",
    "RendezvousError",
    "GroupMember",
    "BACKENDS",
    "create_backend",
    "init_process_group",
    "destroy_process_group",
    "is_initialized",
    "get_rank",
    "get_world_size",
    "get_backend",
    "get_process_group",
    "get_store",
    "new_group",
    "send",
    "recv",
    "isend",
    "irecv",
    "broadcast",
    "all_reduce",
    "reduce",
    "all_gather",
    "gather",
    "scatter",
    "reduce_scatter",
    "all_to_all",
    "barrier",
    "ring_all_reduce",
]
