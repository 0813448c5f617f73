"""ZeRO on real processes: gloo and mpi at two ranks, stage 2, AdamW with weight decay.

Over the ring, ``ZeroOptimizer`` must end with plain ring DDP's parameters after 300 steps; over
the backend's own ``reduce_scatter``/``all_gather`` it must end with plain DDP's over the backend's
own all-reduce (at two ranks every reduction is one addition, so the order cannot differ). The
world sizes 2-4, both stages and the three optimizers run on the threaded group
(tests/unit/ddp/test_zero.py).
"""

from __future__ import annotations

import pytest
import torch

from ddptrain.testing import run_distributed
from tests.conftest import MPIEXEC

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

STEPS = 300


def _four_runs(rank, world_size):
    import copy

    from ddptrain.comm import api as comm_api
    from ddptrain.comm.ring import RingAllReducer
    from ddptrain.ddp import DistributedDataParallel as DDP
    from ddptrain.ddp import ring_allreduce_hook
    from tests.unit.ddp.test_zero import _optimizer, _template, _train, zero_run

    template = _template()
    runs = {}
    for algorithm in ("ring", "native"):
        model = copy.deepcopy(template)
        ddp = DDP(model, bucket_cap_mb=0.0004)
        if algorithm == "ring":
            ddp.register_comm_hook(RingAllReducer(comm_api.get_process_group()), ring_allreduce_hook)
        opt = _optimizer("adamw", model)
        runs[f"plain {algorithm}"] = _train(ddp, opt.step, opt.zero_grad, rank, STEPS)
        runs[f"zero {algorithm}"] = zero_run(template, "adamw", 2, STEPS, algorithm=algorithm)
    return runs


def _check(results):
    for rank, runs in enumerate(results):
        for algorithm in ("ring", "native"):
            plain, zero = runs[f"plain {algorithm}"], runs[f"zero {algorithm}"]
            for i, (a, b) in enumerate(zip(plain, zero)):
                assert torch.equal(a, b), f"{algorithm}, rank {rank}, parameter {i}: {(a - b).abs().max().item()}"
            assert all(torch.equal(a, b) for a, b in zip(zero, results[0][f"zero {algorithm}"]))


def test_gloo_two_ranks_bitwise_to_plain_ddp_over_the_ring_and_over_gloos_own_collectives():
    _check(run_distributed(_four_runs, 2, backend="gloo", timeout_s=240))


@pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found: install the mpi extra (pip install 'ddptrain[mpi]')")
def test_mpi_two_ranks_bitwise_to_plain_ddp_over_the_ring_and_over_mpis_own_collectives():
    env = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    _check(run_distributed(_four_runs, 2, backend="mpi", timeout_s=240, env=env))
