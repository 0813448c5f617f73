"""Fashion-MNIST: ``python -m ddptrain recipe=fashion_mnist``.

Same loop as the MNIST recipe with another dataset and normalisation, proving a recipe is just a
small subclass. The files come from ``data.root``, ``$DDPTRAIN_DATA_SOURCES``, or Debian's
``dataset-fashion-mnist`` package (``/usr/share/datasets/fashion-mnist``), found automatically.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from .mnist import MnistTrainer


class MLP(nn.Module):
    """A two-layer perceptron, an alternative model (``model=mlp``)."""

    def __init__(self, hidden: int = 256, dropout: float = 0.2):
        super().__init__()
        self.fc1 = nn.Linear(28 * 28, hidden)
        self.fc2 = nn.Linear(hidden, 10)
        self.dropout = dropout

    def forward(self, x):
        x = F.relu(self.fc1(x.flatten(1)))
        x = F.dropout(x, p=self.dropout, training=self.training)
        return F.log_softmax(self.fc2(x), dim=1)


class FashionMnistTrainer(MnistTrainer):
    """MNIST's recipe on Fashion-MNIST (its mean 0.2860 and std 0.3530)."""

    dataset = "fashion_mnist"
    mean, std = 0.2860, 0.3530
