"""Elastic training's rules and its state hand-over (ddptrain/trainer/elastic.py). The whole
job, with workers killed from outside, is tests/e2e/test_elastic_cli.py."""

import pytest

from ddptrain import Config, ConfigError
from ddptrain.comm import CommError
from ddptrain.preflight import validate
from ddptrain.testing import run_threaded
from ddptrain.trainer.elastic import ElasticTraining, MembershipChange

ELASTIC = {"trainer": {"elastic": True, "world_size_invariant": True}}


@pytest.mark.parametrize(
    ("override", "named", "why"),
    [
        ({"dist": {"backend": "mpi"}}, "dist.backend=mpi", "an MPI job cannot lose a process"),
        ({"launcher": {"name": "torchrun"}}, "launcher=torchrun", "the local launcher's"),
        ({"trainer": {"doctor": True}}, "trainer.doctor", "one fixed group of ranks"),
        ({"trainer": {"smoke_check": True}}, "trainer.smoke_check=true", "a member that joins later has none"),
    ],
)
def test_what_elastic_training_cannot_be_combined_with_is_refused_with_the_reason(override, named, why):
    raw = {
        "dist": override.get("dist", {}),
        "launcher": override.get("launcher", {}),
        "trainer": {**ELASTIC["trainer"], **override.get("trainer", {})},
    }
    with pytest.raises(ConfigError) as err:
        validate(Config.from_dict(raw), 4)
    message = str(err.value)
    assert message.startswith(f"trainer.elastic=true cannot be combined with {named}"), message
    assert why in message and message.endswith("or set trainer.elastic=false."), message


def test_normal_mode_is_refused_naming_the_mode_it_needs():
    with pytest.raises(ConfigError, match=r"trainer.elastic=true needs trainer.world_size_invariant=true"):
        validate(Config.from_dict({"trainer": {"elastic": True}}), 4)


def test_any_world_size_is_accepted_even_one_that_divides_neither_v_nor_the_batch():
    validate(Config.from_dict(ELASTIC), 3)  # V=8, global batch 128: shared unevenly by position
    with pytest.raises(ConfigError, match="W must divide V"):
        validate(Config.from_dict({"trainer": {"world_size_invariant": True}}), 3)  # not elastic: refused


def _agree(rank, world_size, steps):
    from ddptrain import comm

    mine = None if steps[rank] is None else {"step": steps[rank], "from": rank}
    try:
        return ElasticTraining.agree_on_state(comm.get_process_group(), mine)
    except CommError as exc:
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
