"""``trainer.compile=true``: the module compiled in place inside our DDP, on real gloo processes.

The gradient hooks must still fire and launch every bucket (the ranks end identical), and the
training must be the eager one's up to float noise: inductor fuses and reorders the float
arithmetic, so the bits differ (the task has no dropout, whose random numbers inductor draws
differently). The state dict keeps the module's own keys (``load_model`` reads it back). Against
torch's DDP around the same compiled module the parameters are bitwise equal.
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


def _against_torch_ddp(rank, world_size):
    """Our DDP around a compiled module and torch's DDP around a compiled copy, 20 steps of SGD."""
    import copy

    import torch.distributed as tdist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import ddptrain.comm as dist
    from ddptrain.ddp import DistributedDataParallel as DDP

    store = tdist.PrefixStore("torch", dist.get_store().c10d)
    tdist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        torch.manual_seed(0)
        ours_module = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))
        theirs_module = copy.deepcopy(ours_module)
        ours_module.compile()
        ours, theirs = DDP(ours_module), TorchDDP(torch.compile(theirs_module))
        optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ours, theirs)]
        g = torch.Generator().manual_seed(1)
        for _ in range(20):
            x = torch.randn(16, 8, generator=g)
            mine = slice(rank * 8, rank * 8 + 8)
            for model, optimizer in zip((ours, theirs), optimizers):
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(model(x[mine]), x[mine, :3].argmax(1)).backward()
                optimizer.step()
        pairs = zip(ours_module.parameters(), theirs_module.parameters())
        return [(a - b).abs().max().item() for a, b in pairs]
    finally:
        tdist.destroy_process_group()


def test_a_compiled_module_in_our_ddp_trains_as_in_torchs_ddp(tmp_path):
    diffs = run_distributed(_against_torch_ddp, 2, timeout_s=300)
    assert diffs[0] == diffs[1] and max(diffs[0]) == 0.0, diffs  # bitwise: the same graph, the same sums
