"""Elastic training's rules and its state hand-over (ddptrain/trainer/elastic.py). The whole
job, with workers killed from outside, is tests/elastic/test_cli.py."""

import pytest

from ddptrain import Config, ConfigError
from ddptrain.preflight import validate
from ddptrain.testing import run_threaded
from ddptrain.trainer.elastic import ElasticTraining, MembershipChange, TrainingStateLost

ELASTIC = {"trainer": {"elastic": True, "world_size_invariant": True}}
NORMAL = {"trainer": {"world_size_invariant": False}}


@pytest.mark.parametrize(
    ("override", "named", "why"),
    [
        ({"dist": {"backend": "mpi"}}, "dist.backend=mpi", "an MPI job cannot lose a process"),
        ({"trainer": {"lr_find": True}}, "trainer.lr_find", "one fixed group of ranks"),
        ({"trainer": {"smoke_check": True}}, "trainer.smoke_check=true", "a member that joins later has none"),
        ({"dist": {"min_world_size": 5}}, "dist.min_world_size=5", "the job starts with 4 rank(s), fewer than that"),
        # in normal mode: invariant mode refuses these three itself
        ({"dist": {"zero_stage": 1}, **NORMAL}, "dist.zero_stage=1", "a lost rank takes it along"),
        ({"dist": {"sync": "diloco"}, **NORMAL}, "dist.sync=diloco", "hold no common state to redo them from"),
        ({"data": {"drop_last": True}, **NORMAL}, "data.drop_last=true", "take every sample once"),
    ],
)
def test_what_elastic_training_cannot_be_combined_with_is_refused_with_the_reason(override, named, why):
    raw = {
        "data": override.get("data", {}),
        "dist": override.get("dist", {}),
        "launcher": override.get("launcher", {}),
        "trainer": {**ELASTIC["trainer"], **override.get("trainer", {})},
    }
    with pytest.raises(ConfigError) as err:
        validate(Config.from_dict(raw), 4)
    message = str(err.value)
    assert message.startswith(f"trainer.elastic=true cannot be combined with {named}"), message
    assert why in message and message.endswith("or set trainer.elastic=false."), message


def test_normal_mode_takes_any_world_size_too():
    """Without invariant mode the members present share each global batch by position (weighted
    by their shares: tests/elastic/test_shared_batches.py), so 3 of 128 is accepted."""
    validate(Config.from_dict({"trainer": {"elastic": True}}), 3)


def test_the_elastic_keys_without_elastic_are_refused_not_ignored():
    with pytest.raises(ConfigError, match=r"dist.min_world_size=2 applies to elastic jobs only"):
        validate(Config.from_dict({"dist": {"min_world_size": 2}}), 4)
    with pytest.raises(ConfigError, match=r"launcher.spares=1 applies to elastic jobs only"):
        validate(Config.from_dict({"launcher": {"spares": 1}}), 4)
    with pytest.raises(ConfigError, match=r"dist.elastic_store=host:29400 applies to elastic jobs only"):
        validate(Config.from_dict({"dist": {"elastic_store": "host:29400"}}), 4)


def test_any_world_size_is_accepted_even_one_that_divides_neither_v_nor_the_batch():
    validate(Config.from_dict(ELASTIC), 3)  # V=8, global batch 128: shared unevenly by position
    with pytest.raises(ConfigError, match="W must divide V"):
        validate(Config.from_dict({"trainer": {"world_size_invariant": True}}), 3)  # not elastic: refused


def _agree(rank, world_size, steps):
    from ddptrain import comm

    mine = None if steps[rank] is None else {"step": steps[rank], "from": rank}
    try:
        return ElasticTraining.agree_on_state(comm.get_process_group(), mine)
    except TrainingStateLost as exc:
        return str(exc)


def test_the_state_comes_from_the_member_with_most_steps_the_lowest_rank_among_them():
    # rank 2 is a newcomer (no state); ranks 1 and 3 completed a step that rank 0 did not
    results = run_threaded(_agree, 4, [5, 6, None, 6], timeout_s=60)
    assert results == [({"step": 6, "from": 1}, 1)] * 4


def test_no_member_with_a_state_is_an_error_that_says_how_to_resume():
    results = run_threaded(_agree, 2, [None, None], timeout_s=60)
    assert all(
        "every member that held the training state is gone" in r and "trainer.resume=latest" in r for r in results
    )


def test_a_change_is_one_line_naming_who_left_who_joined_the_sizes_the_step_and_the_time():
    change = MembershipChange(3, 120, 4, 4, ("2.0",), ("2.1",), "all_reduce failed: a peer closed", 0.63)
    assert change.describe() == (
        "elastic: generation 3: lost 2.0 and took in 2.1; 4 -> 4 rank(s); training goes on after step 120 "
        "(0.63 s lost; why: all_reduce failed: a peer closed)"
    )


def test_a_member_waiting_to_be_admitted_leaves_when_the_job_finishes():
    """A worker restarted near the end registers, but the job ends before a step boundary admits
    it: it must not wait for a generation that never comes (the launcher would wait on it)."""
    import threading
    import time

    import torch.distributed as tdist

    from ddptrain.comm.elastic import ElasticMembership, JobFinished
    from ddptrain.comm.store import Store

    store = Store(tdist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False))
    first = ElasticMembership(store, "a")
    first.join(1, timeout_s=10)
    late = ElasticMembership(store, "b")
    outcome: list = []

    def join() -> None:
        try:
            late.join(1, timeout_s=30)
        except JobFinished as exc:
            outcome.append((str(exc), time.monotonic()))

    waiter = threading.Thread(target=join)
    waiter.start()
    time.sleep(0.3)
    assert not outcome  # still waiting to be admitted
    finished = time.monotonic()
    first.finish()
    waiter.join(10)
    assert outcome and "it finished before member b was admitted" in outcome[0][0]
    assert outcome[0][1] - finished < 2
    first.close()
    late.close()


def test_the_state_a_survivor_keeps_is_a_copy_that_rebinding_cannot_change():
    """Between the copy and the hand-over, DDP's construction in the new group writes rank 0's
    weights into the module; the member with the most steps may be another rank."""
    from types import SimpleNamespace

    import torch

    weights = torch.nn.Linear(2, 2)
    membership = SimpleNamespace(generation=SimpleNamespace(members=("0.0", "1.0")))
    kept = ElasticTraining(Config(), membership=membership).with_membership({"model": weights.state_dict(), "step": 7})
    before = kept["model"]["weight"].clone()
    with torch.no_grad():
        weights.weight.add_(1.0)  # what the broadcast of rank 0's weights does in place
    assert torch.equal(kept["model"]["weight"], before)
    assert kept["elastic"] == {"members": ["0.0", "1.0"], "changes": []}


@pytest.mark.parametrize("invariant", [True, False])
def test_an_elastic_epoch_counts_global_batches_whatever_the_world_size(invariant):
    """100 samples in global batches of 10 are 10 steps at any world size: the members present
    share each global batch. Counted by this rank's padded share instead (34 samples in per-rank
    batches of 4 at W=3) the epoch would be 9 steps, and the last global batch never trained."""
    import torch
    from torch.utils.data import TensorDataset

    from ddptrain.trainer.data import plan_epochs

    raw = {"data": {"global_batch_size": 10}, "trainer": {"elastic": True, "world_size_invariant": invariant}}
    samples = TensorDataset(torch.zeros(100, 1))
    for world_size in (1, 2, 3, 4):
        plan = plan_epochs(Config.from_dict(raw), samples, None, world_size, 0)
        assert plan.steps_per_epoch == 10, (world_size, plan.steps_per_epoch)


def test_a_min_world_size_equal_to_the_starting_size_is_accepted():
    validate(Config.from_dict({**ELASTIC, "dist": {"min_world_size": 4}}), 4)
    with pytest.raises(ConfigError, match=r"dist.min_world_size=5.*the job starts with 4 rank"):
        validate(Config.from_dict({**ELASTIC, "dist": {"min_world_size": 5}}), 4)
