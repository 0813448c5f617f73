"""MNIST with the PyTorch distributed tutorial's network: ``python -m ddptrain recipe=mnist``.

The tutorial's setup: its ``Net``, SGD (lr 0.01, momentum 0.5), a global batch of 128 split over
the ranks, 10 epochs, seed 1234, MNIST normalised with mean 0.1307 and std 0.3081. This file is
user-level code: it shows how to subclass ``ddptrain.Trainer`` using only the public API.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import ddptrain
from ddptrain.data import build_dataset, prepare_dataset_files


class Net(nn.Module):
    """The tutorial's (and PyTorch's MNIST example's) convolutional network.

    Args:
        conv_dropout: channel dropout after the second convolution (tutorial: 0.5).
        fc_dropout: dropout before the last layer (tutorial: 0.5).
    """

    def __init__(self, conv_dropout: float = 0.5, fc_dropout: float = 0.5):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d(conv_dropout)
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)
        self.fc_dropout = fc_dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.view(-1, 320)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, p=self.fc_dropout, training=self.training)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


def as_normalized_tensors(dataset, mean: float, std: float) -> TensorDataset:
    """A torchvision MNIST-style dataset as normalised float images and labels, in one go.

    Same values as ``ToTensor()`` then ``Normalize((mean,), (std,))`` per item, computed for the
    whole uint8 array at once: seconds of per-item PIL work become a fraction of a second, and
    batches become one tensor gather.
    """
    images = dataset.data.unsqueeze(1).to(torch.float32).div(255).sub(mean).div(std)
    return TensorDataset(images, dataset.targets.clone())


class MnistTrainer(ddptrain.Trainer):
    """The tutorial's distributed synchronous SGD on MNIST, as a Trainer subclass.

    The model (``model._target_``, here :class:`Net`) and the optimizer come from the config;
    this class supplies the data and the loss, which is all a new task usually needs.
    """

    dataset = "mnist"  # a name of ddptrain.data.DATASET_NAMES
    mean, std = 0.1307, 0.3081

    @classmethod
    def prepare_data(cls, config: ddptrain.Config) -> None:
        # Find, decompress and check the files once, before the workers start, without loading them.
        for train in (True, False):
            prepare_dataset_files(cls.dataset, config.data.root, train=train, download=config.data.download)

    def train_dataloader(self) -> Dataset:
        return self._split(train=True)

    def val_dataloader(self) -> Dataset:
        return self._split(train=False)

    def _split(self, train: bool) -> Dataset:
        dataset = build_dataset(self.dataset, self.config.data.root, train=train)
        return as_normalized_tensors(dataset, self.mean, self.std)

    def training_step(self, model: nn.Module, batch) -> torch.Tensor:
        images, labels = batch
        return F.nll_loss(model(images), labels)  # Net returns log-probabilities

    def validation_step(self, model: nn.Module, batch) -> dict[str, torch.Tensor]:
        images, labels = batch
        log_probs = model(images)
        return {
            "loss": F.nll_loss(log_probs, labels, reduction="none"),
            "accuracy": (log_probs.argmax(dim=1) == labels).float(),
        }
