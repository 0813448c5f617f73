"""ZeRO on real processes.

- gloo and mpi at two ranks, stage 2, AdamW with weight decay: over the ring, ``ZeroOptimizer``
  must end with plain ring DDP's parameters after 300 steps; over the backend's own
  ``reduce_scatter``/``all_gather`` it must end with plain DDP's over the backend's own all-reduce
  (at two ranks every reduction is one addition, so the order cannot differ); with gradients sent
  in bf16 (``reduce_dtype``), with plain DDP's under ``bf16_compress_hook``.
- gloo at three ranks with SGD and momentum, at four with Adam: both stages bitwise to plain ring
  DDP after 300 steps. (The optimizer's arithmetic does not depend on the backend: every
  optimizer at every world size runs on the threaded group, tests/zero/test_optimizer.py; here the
  backend's messages are what is tested, and each optimizer meets gloo at one world size.)
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
    from tests.zero.test_optimizer import _bf16_pair, _optimizer, _template, _train, zero_run

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
    runs["plain bf16"], runs["zero bf16"], _ = _bf16_pair(rank, world_size, 2)
    return runs


def _check(results):
    for rank, runs in enumerate(results):
        for algorithm in ("ring", "native", "bf16"):
            plain, zero = runs[f"plain {algorithm}"], runs[f"zero {algorithm}"]
            for i, (a, b) in enumerate(zip(plain, zero)):
                assert torch.equal(a, b), f"{algorithm}, rank {rank}, parameter {i}: {(a - b).abs().max().item()}"
            assert all(torch.equal(a, b) for a, b in zip(zero, results[0][f"zero {algorithm}"]))


def _both_stages(rank, world_size, opt_name):
    from tests.zero.test_optimizer import _template, plain_ring, zero_run

    template = _template()
    # One bucket: every chunk bound still falls inside a parameter, with a quarter of the messages.
    plain = plain_ring(template, opt_name, STEPS, bucket_cap_mb=1)
    return plain, [zero_run(template, opt_name, stage, STEPS, bucket_cap_mb=1) for stage in (1, 2)]


@pytest.mark.parametrize("world_size, opt_name", [(3, "sgd"), (4, "adam")])
def test_gloo_three_and_four_ranks_both_stages_bitwise_to_plain_ring_ddp(world_size, opt_name):
    results = run_distributed(_both_stages, world_size, opt_name, backend="gloo", timeout_s=240)
    for rank, (plain, stages) in enumerate(results):
        for stage, zero in zip((1, 2), stages):
            for i, (a, b) in enumerate(zip(plain, zero)):
                assert torch.equal(a, b), f"{opt_name} stage {stage} rank {rank} parameter {i}"
            assert all(torch.equal(a, b) for a, b in zip(zero, results[0][1][stage - 1])), "ranks diverged"


def test_gloo_two_ranks_bitwise_to_plain_ddp_over_the_ring_and_over_gloos_own_collectives():
    _check(run_distributed(_four_runs, 2, backend="gloo", timeout_s=240))


@pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found: install the mpi extra (pip install 'ddptrain[mpi]')")
def test_mpi_two_ranks_bitwise_to_plain_ddp_over_the_ring_and_over_mpis_own_collectives():
    env = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    _check(run_distributed(_four_runs, 2, backend="mpi", timeout_s=240, env=env))
