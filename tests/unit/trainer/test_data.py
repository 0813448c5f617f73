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
