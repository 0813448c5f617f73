"""``trainer.compile=true``: the module compiled in place inside our DDP, on real gloo processes.

The gradient hooks must still fire and launch every bucket (the ranks end identical), and the
training must be the eager one's up to float noise: inductor fuses and reorders the float
arithmetic, so the bits differ (the task has no dropout, whose random numbers inductor draws
differently). The state dict keeps the module's own keys (``load_model`` reads it back).
"""

import pytest
import torch

from ddptrain.testing import run_distributed
from tests.unit.trainer.test_lightning_flags import Task, _config

pytestmark = [pytest.mark.timeout(400)]


def _fit(rank, world_size, out, compile_):
    task = Task(_config(out, epochs=1, compile=compile_))
    final = task.fit()
    state = task.model.module.state_dict()
    launched = [t is not None for t in task.model.last_iteration_stats.launch_times]  # the last step's buckets
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]  # what dynamo compiled in this process
    return {k: v.clone() for k, v in state.items()}, final["params_agree"], launched, graphs


def test_a_compiled_model_trains_like_the_eager_one_with_every_bucket_reduced(tmp_path):
    compiled = run_distributed(_fit, 2, str(tmp_path / "compiled"), True, timeout_s=300)
    eager = run_distributed(_fit, 2, str(tmp_path / "eager"), False, timeout_s=120)
    (state, agree, buckets, graphs), (eager_state, _, eager_buckets, eager_graphs) = compiled[0], eager[0]
    assert graphs > 0 and eager_graphs == 0  # compiled, and only when asked
    assert agree and all(torch.equal(state[k], compiled[1][0][k]) for k in state)  # the ranks hold one model
    assert list(state) == list(eager_state)  # no _orig_mod. prefix
    assert buckets == eager_buckets and all(buckets)  # the hooks launched every bucket, as in eager mode
    for key in state:
        assert torch.allclose(state[key], eager_state[key], rtol=1e-4, atol=1e-6), key
