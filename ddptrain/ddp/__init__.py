"""ddptrain's DistributedDataParallel: buckets, gradient hooks, async all-reduce, comm hooks."""

from .buckets import GradBucket, assign_buckets
from .comm_hooks import (
    PowerSGDState,
    allreduce_hook,
    bf16_compress_hook,
    fp16_compress_hook,
    powerSGD_hook,
    ring_allreduce_hook,
)
from .module import DistributedDataParallel
from .reducer import IterationStats, UnusedParametersError
from .zero import ZeroOptimizer

__all__ = [
    "DistributedDataParallel",
    "assign_buckets",
    "GradBucket",
    "IterationStats",
    "UnusedParametersError",
    "allreduce_hook",
    "fp16_compress_hook",
    "bf16_compress_hook",
    "PowerSGDState",
    "powerSGD_hook",
    "ring_allreduce_hook",
    "ZeroOptimizer",
]
