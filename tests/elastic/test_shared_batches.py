"""SharedBatchSteps (ddptrain/trainer/global_batch_steps.py), the step strategy of an elastic job in
normal mode: the members present share each global batch by position, unevenly where the world
size does not divide it, and each rank's gradient is weighted by its share.

The strategy is reached through the Trainer's public hook ``configure_step_strategy`` on threaded
ranks, so no elastic job is needed; the whole elastic job is tests/elastic/test_cli.py."""

import pytest
import torch

from ddptrain import ConfigError
from ddptrain.testing import run_threaded
from ddptrain.trainer.callbacks import Callback
from ddptrain.trainer.global_batch_steps import SharedBatchSteps
from tests.invariant.test_trainer import ImagesTrainer, _config


class SharedTrainer(ImagesTrainer):
    """200 random images; every step shared by position (the elastic normal-mode strategy)."""

    def configure_step_strategy(self, votes):
        return SharedBatchSteps(self, votes)


def _fit(rank, world_size, trainer_class, config):
    torch.set_num_threads(1)
    trainer = trainer_class(config)
    final = trainer.fit()
    state = {k: v.detach().clone() for k, v in trainer.model.module.state_dict().items()}
    return state, final, trainer.loss_history


def _assert_close(state, expected):
    for name, want in expected.items():
        torch.testing.assert_close(state[name], want, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize(("world_size", "accum"), [(3, 1), (2, 2)])
def test_shares_of_any_size_train_what_one_rank_trains_on_the_whole_global_batch(tmp_path, world_size, accum):
    """Global batch 30 over 200 samples: 6 steps of 30 and a last one of 20. At 3 ranks the last
    step's shares are 7, 7 and 6 samples: a gradient weighted 1/W instead of by the share moves the
    parameters away from one rank's full-batch step. Dropout off: the same function on every rank."""
    config = _config(tmp_path, "tests.models.Net", invariant=False, epochs=1, grad_accum_steps=accum)
    config.data.global_batch_size = 30 if world_size == 3 else 32
    [(reference, ref_final, ref_losses)] = run_threaded(_fit, 1, ImagesTrainer, config, timeout_s=60)
    ranks = run_threaded(_fit, world_size, SharedTrainer, config, timeout_s=60)
    for state, final, losses in ranks:
        assert final["step"] == ref_final["step"] == 7
        _assert_close(state, reference)
        # The logged step loss is the mean over ranks of each rank's weighted loss: the step's mean.
        torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)


def test_a_last_step_too_small_to_give_every_rank_a_sample_is_refused_with_the_fix(tmp_path):
    """200 samples in global batches of 66: the last step holds 2 samples, fewer than 3 ranks."""
    config = _config(tmp_path, "tests.models.Net", invariant=False, epochs=1)
    config.data.global_batch_size = 66
    with pytest.raises(ConfigError) as err:
        run_threaded(_fit, 3, SharedTrainer, config, timeout_s=60)
    message = str(err.value)
    assert "the epoch's last step holds 2 sample(s) (200 % data.global_batch_size=66)" in message, message
    assert "fewer than trainer.grad_accum_steps x dist.world_size = 3" in message, message
    assert "leaves a last step of 0 or at least 3 samples, or set trainer.world_size_invariant=true" in message, message


class Indexed(torch.utils.data.Dataset):
    """A plain map-style dataset (not a TensorDataset): each sample goes through collate."""

    def __init__(self, inner):
        self.inner = inner

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        return self.inner[i]


class SharedIndexedTrainer(SharedTrainer):
    def train_dataloader(self):
        return Indexed(super().train_dataloader())


def test_a_dataset_of_any_kind_is_collated_into_the_same_shards(tmp_path):
    """The TensorDataset fast path (one index_select per tensor) and the collate path load the same
    samples: the runs end bitwise equal."""
    config = _config(tmp_path, "tests.models.Net", invariant=False, epochs=1)
    config.data.global_batch_size = 30
    tensors = run_threaded(_fit, 3, SharedTrainer, config, timeout_s=60)
    indexed = run_threaded(_fit, 3, SharedIndexedTrainer, config, timeout_s=60)
    for (state, _, losses), (state_i, _, losses_i) in zip(tensors, indexed):
        assert losses == losses_i
        assert all(torch.equal(state[k], state_i[k]) for k in state)


class StopOnRank1(SharedTrainer):
    """Rank 1 alone asks to stop after step 2: its vote must reach every rank."""

    def configure_callbacks(self):
        class Stop(Callback):
            def on_train_batch_end(self, trainer, loss):
                if trainer.rank == 1 and trainer.state.step == 2:
                    trainer.should_stop = True

        return [*super().configure_callbacks(), Stop()]


def test_a_stop_vote_of_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    config = _config(tmp_path, "tests.models.Net", invariant=False, epochs=1)
    config.data.global_batch_size = 30
    ranks = run_threaded(_fit, 3, StopOnRank1, config, timeout_s=60)
    assert [final["step"] for _, final, _ in ranks] == [3, 3, 3]  # the vote rides in step 3's gradients
    assert all(final["stopped_early"] for _, final, _ in ranks)
