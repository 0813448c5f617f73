"""The Trainer's data wiring: preloading, batches in the sampler's order, micro-batches per step."""

import torch

from ddptrain.config import DataConfig
from ddptrain.data import DistributedSampler, SyntheticClassification
from ddptrain.trainer.data import TensorBatches, batch_size_of, default_dataset, group_micro_batches, preload


def test_preload_and_tensor_batches_follow_the_sampler():
    synthetic = SyntheticClassification(30, input_shape=(4,), seed=2)
    tensors = preload(synthetic)
    assert tensors.tensors[0] is synthetic.data  # no copy for tensor-backed datasets
    sampler = DistributedSampler(tensors, num_replicas=2, rank=1, shuffle=True, seed=5)
    sampler.set_epoch(3)
    batches = list(TensorBatches(tensors, sampler, 4))
    assert [batch_size_of(b) for b in batches] == [4, 4, 4, 3]
    expected = sampler.epoch_indices()
    assert torch.equal(torch.cat([b[1] for b in batches]), synthetic.targets[expected])

    class Items(torch.utils.data.Dataset):
        def __len__(self):
            return 3

        def __getitem__(self, i):
            return torch.full((2,), float(i)), i

    stacked = preload(Items())
    assert stacked.tensors[0].shape == (3, 2) and stacked.tensors[1].tolist() == [0, 1, 2]


def test_micro_batches_grouped_per_optimizer_step():
    assert list(group_micro_batches(range(8), 3)) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert list(group_micro_batches(range(4), 2)) == [[0, 1], [2, 3]]
    assert list(group_micro_batches(range(2), 1)) == [[0], [1]]
    assert list(group_micro_batches([], 2)) == []


def test_default_dataset_is_the_configured_one():
    config = DataConfig(name="synthetic", num_train_samples=24, num_val_samples=8)
    train, val = default_dataset(config, train=True), default_dataset(config, train=False)
    assert (len(train), len(val)) == (24, 8) and isinstance(train, torch.utils.data.TensorDataset)
    config.preload = False
    assert isinstance(default_dataset(config, train=True), SyntheticClassification)


def test_first_samples_keeps_a_tensor_dataset_one_and_cuts_any_other_to_a_subset():
    from torch.utils.data import Subset, TensorDataset

    from ddptrain.trainer.data import first_samples

    tensors = TensorDataset(torch.arange(10.0), torch.arange(10))
    cut = first_samples(tensors, 4)
    assert isinstance(cut, TensorDataset) and cut.tensors[0].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert cut.tensors[0].data_ptr() == tensors.tensors[0].data_ptr()  # a view, no copy
    assert first_samples(tensors, 10) is tensors and first_samples(tensors, 12) is tensors
    synthetic = SyntheticClassification(10, input_shape=(2,), seed=0)
    subset = first_samples(synthetic, 3)
    assert isinstance(subset, Subset) and list(subset.indices) == [0, 1, 2]


def test_the_limits_cut_the_datasets_to_whole_global_batches_or_a_fraction_of_the_validation():
    from torch.utils.data import TensorDataset

    from ddptrain import Config
    from ddptrain.trainer.data import limit_datasets

    train = TensorDataset(torch.arange(100.0))
    val = TensorDataset(torch.arange(60.0))

    def sizes(**trainer):
        config = Config.from_dict({"data": {"global_batch_size": 8}, "trainer": trainer})
        cut_train, cut_val = limit_datasets(config, train, val, world_size=2, val_batch_size=5)
        return len(cut_train), len(cut_val)

    assert sizes() == (100, 60)
    assert sizes(limit_val_batches=0.5) == (100, 30)  # a fraction of the validation set
    assert sizes(limit_val_batches=0.001) == (100, 1)  # at least one sample
    assert sizes(limit_val_batches=3) == (100, 3 * 2 * 5)  # batches per rank x ranks x batch
    assert sizes(overfit_batches=2) == (2 * 8, 2 * 2 * 5)  # N global batches; validation N batches too
