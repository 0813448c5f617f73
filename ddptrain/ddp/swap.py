"""Other values in a module's tensors for a block, the originals back afterwards, bit for bit.

Used where the ranks evaluate weights other than the ones they train: the moving average
(``trainer.ema.evaluate``) and local SGD / DiLoCo's consensus (:mod:`.outer`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

__all__ = ["swapped_in"]


@contextlib.contextmanager
def swapped_in(live: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> Iterator[None]:
    """``values`` copied into ``live`` (same shapes, in order) for the block; ``live``'s own
    contents restored afterwards, also when the block raises."""
    with torch.no_grad():
        kept = [t.clone() for t in live]
        torch._foreach_copy_(live, values)
    try:
        yield
    finally:
        with torch.no_grad():
            torch._foreach_copy_(live, kept)
