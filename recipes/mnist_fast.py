"""MNIST, fast: ``python -m ddptrain recipe=mnist_fast``.

Beats the tutorial recipe (``recipe=mnist``) on both axes on the same machine: higher test
accuracy (>= 99.2% against ~97.8%) in less training time. What buys it:

- a small CNN whose convolutions are followed by BatchNorm (:class:`FastNet`), which tolerates a
  large learning rate;
- AdamW with a one-cycle-like schedule (linear warm-up, then cosine decay to zero) instead of
  SGD at a constant 0.01;
- a global batch of 256 (fewer, larger steps: less per-step overhead and communication);
- 4 epochs instead of 10;
- bf16 autocast (``trainer.precision=bf16-mixed``): faster convolutions on CPUs with bf16 units, and
  on GPUs.

The data, the loss and the evaluation are the tutorial's (:class:`~ddptrain.recipes.mnist.MnistTrainer`);
only the model and the hyper-parameters differ, all of them in ``conf/recipe/mnist_fast.yaml``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .mnist import MnistTrainer

__all__ = ["FastNet", "MnistTrainer"]


def _conv_bn_relu(in_channels: int, out_channels: int, kernel_size: int) -> list[nn.Module]:
    # No conv bias: BatchNorm's shift makes it redundant.
    return [nn.Conv2d(in_channels, out_channels, kernel_size, bias=False), nn.BatchNorm2d(out_channels), nn.ReLU()]


class FastNet(nn.Module):
    """Two 5x5 convolutions with BatchNorm and max-pooling, then a hidden linear layer (~80k parameters).

    Returns log-probabilities, like the tutorial's ``Net``, so the tutorial's loss and accuracy apply.

    Args:
        channels: output channels of the two convolutions.
        hidden: width of the hidden linear layer.
    """

    def __init__(self, channels: tuple[int, int] = (16, 32), hidden: int = 128):
        super().__init__()
        c1, c2 = channels
        self.features = nn.Sequential(
            *_conv_bn_relu(1, c1, 5),  # 28x28 -> 24x24
            nn.MaxPool2d(2),  # -> 12x12
            *_conv_bn_relu(c1, c2, 5),  # -> 8x8
            nn.MaxPool2d(2),  # -> 4x4
        )
        self.classifier = nn.Sequential(nn.Linear(c2 * 4 * 4, hidden), nn.ReLU(), nn.Linear(hidden, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.classifier(self.features(x).flatten(1)), dim=1)
