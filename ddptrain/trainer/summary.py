"""The model summary logged at fit start (``trainer.model_summary``), as Lightning's ``ModelSummary``:
one row per top-level module, then the totals.

Sizes count parameters and buffers at their own dtypes (what a checkpoint of the weights holds);
a parameter shared by two modules is counted once, in the first row that holds it.
"""

from __future__ import annotations

from torch import nn

__all__ = ["model_summary"]


def model_summary(module: nn.Module) -> str:
    """A text table of ``module``: name, type, parameters, trainable parameters and size in MB of
    each top-level child (the module itself when it has none), then the totals."""
    seen: set[int] = set()
    rows = []
    children = list(module.named_children()) or [("(model)", module)]
    for name, child in children:
        params = [p for p in child.parameters() if id(p) not in seen]
        seen.update(id(p) for p in params)
        buffers = list(child.buffers())
        count = sum(p.numel() for p in params)
        trainable = sum(p.numel() for p in params if p.requires_grad)
        size = sum(t.numel() * t.element_size() for t in [*params, *buffers])
        rows.append((name, type(child).__name__, count, trainable, size))
    own = [p for p in module.parameters() if id(p) not in seen]  # held by the root module itself
    if own:
        rows.append(("(own)", type(module).__name__, *_counts(own)))
    total = sum(r[2] for r in rows)
    trainable = sum(r[3] for r in rows)
    size = sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])
    table = [("", "name", "type", "params", "trainable", "size (MB)")]
    table += [(str(i), n, t, _count(c), _count(tr), f"{s / 1e6:.3f}") for i, (n, t, c, tr, s) in enumerate(rows)]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = [
        "  ".join(cell.ljust(w) if i < 3 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
        for row in table
    ]
    lines.insert(1, "-" * len(lines[0]))
    lines += [
        "-" * len(lines[0]),
        f"{_count(trainable)} trainable params, {_count(total - trainable)} non-trainable params, "
        f"{_count(total)} total params, {size / 1e6:.3f} MB (parameters and buffers)",
    ]
    return "\n".join(lines)


def _counts(params: list[nn.Parameter]) -> tuple[int, int, int]:
    count = sum(p.numel() for p in params)
    return count, sum(p.numel() for p in params if p.requires_grad), sum(p.numel() * p.element_size() for p in params)


def _count(n: int) -> str:
    """A parameter count as Lightning prints it: ``1.2 M``, ``431 K``, ``52``."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return str(n)
