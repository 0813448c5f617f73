"""What DDP must compute, worked out in one process: the DDP unit tests' reference.

Rank ``r`` trains on its own batch ``batch(r, i)`` (``i`` counts backward passes, micro-steps
included); DDP averages the gradients over the world size. The reference runs the same batches
through one copy of the model and back-propagates ``sum_r loss_r / world_size`` over the ranks
that ran the step — torch DDP's semantics, join included: a rank that has joined contributes
nothing, and the division stays by the full world size.

``train_rank`` is the loop each rank runs (inside ``run_threaded``); ``train_reference`` its
single-process twin. Both return the gradients after each step and the final parameters.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn.functional as F

PER_RANK = 4
WORLD_SIZES = [2, 3, 8]
TOLERANCE = 1e-5  # float32 sums in another order; any bug named in the tests is >= 1e-3


def batch(rank: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100_003 * index + rank)
    return torch.randn(PER_RANK, 1, 28, 28, generator=g), torch.randint(0, 10, (PER_RANK,), generator=g)


def rank_loss(model, rank: int, index: int) -> torch.Tensor:
    x, y = batch(rank, index)
    return F.nll_loss(model(x), y)


def _grads(model) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def train_rank(ddp, rank: int, steps: int, micro: int = 1, lr: float = 0.1, set_to_none: bool = True, hook=None):
    """Train ``ddp`` (a DistributedDataParallel) as rank ``rank``: ``micro - 1`` backward passes
    under ``no_sync()`` then one synchronised, per step. ``hook(step)`` runs before each step."""
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    grads = []
    for step in range(steps):
        if hook is not None:
            hook(step)
        opt.zero_grad(set_to_none=set_to_none)
        for m in range(micro):
            ctx = ddp.no_sync() if m < micro - 1 else contextlib.nullcontext()
            with ctx:
                rank_loss(ddp, rank, step * micro + m).backward()
        grads.append(_grads(ddp.module))
        opt.step()
    return grads, _params(ddp.module)


def train_reference(template, world_size: int, steps: int, micro: int = 1, lr: float = 0.1, counts=None, setup=None):
    """``train_rank``'s twin in one process. ``counts[r]``: the steps rank ``r`` runs (join);
    ``setup(model, r)`` makes the model behave as rank ``r``'s (e.g. a branch only some ranks use)."""
    model = copy.deepcopy(template)
    counts = counts or [steps] * world_size
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    grads = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        active = [r for r in range(world_size) if step < counts[r]]
        for m in range(micro):
            loss = 0
            for r in active:
                if setup is not None:
                    setup(model, r)
                loss = loss + rank_loss(model, r, step * micro + m) / world_size
            loss.backward()
        grads.append(_grads(model))
        opt.step()
    return grads, _params(model)


def max_diff(a, b) -> float:
    """Largest absolute difference between two lists of tensors (None must match None)."""
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        if x is None or y is None:
            if x is not y:
                return float("inf")
            continue
        worst = max(worst, (x.double() - y.double()).abs().max().item())
    return worst


def assert_matches(results, reference, what: str) -> None:
    """Every rank's gradients (each step) and final parameters equal the reference's."""
    ref_grads, ref_params = reference
    for rank, (grads, params) in enumerate(results):
        assert len(grads) <= len(ref_grads), f"{what}: rank {rank} ran {len(grads)} steps"
        for step, (g, rg) in enumerate(zip(grads, ref_grads)):  # a joined rank ran fewer steps
            diff = max_diff(g, rg)
            assert diff <= TOLERANCE, f"{what}: rank {rank} step {step}: gradients differ by {diff:.3g}"
        diff = max_diff(params, ref_params)
        assert diff <= TOLERANCE, f"{what}: rank {rank}: final parameters differ by {diff:.3g}"
