"""Exchanging small picklable Python objects over any ProcessGroup (metadata, not tensors).

Used for configuration checks (does every rank hold the same model?), metrics and decisions
that all ranks must share. Objects travel as pickled bytes in uint8 tensors; each call costs two
collectives (lengths, then payload), so keep it off hot paths.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch

from .process_group import ProcessGroup


def all_gather_object(pg: ProcessGroup, obj: Any) -> list[Any]:
    """Every rank's ``obj``, in group-rank order, on every rank."""
    if pg.size() == 1:
        return [obj]
    dev = pg.device
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(dev)
    lengths = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(pg.size())]
    pg.all_gather(lengths, torch.tensor([payload.numel()], dtype=torch.int64, device=dev)).wait()
    longest = max(int(n.item()) for n in lengths)
    padded = torch.zeros(longest, dtype=torch.uint8, device=dev)
    padded[: payload.numel()] = payload
    chunks = [torch.empty(longest, dtype=torch.uint8, device=dev) for _ in range(pg.size())]
    pg.all_gather(chunks, padded).wait()
    return [pickle.loads(c[: int(n.item())].cpu().numpy().tobytes()) for c, n in zip(chunks, lengths)]


def broadcast_object(pg: ProcessGroup, obj: Any, src: int = 0) -> Any:
    """``obj`` of group rank ``src``, on every rank."""
    if pg.size() == 1:
        return obj
    dev = pg.device
    if pg.rank() == src:
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(dev)
        length = torch.tensor([payload.numel()], dtype=torch.int64, device=dev)
    else:
        length = torch.zeros(1, dtype=torch.int64, device=dev)
    pg.broadcast(length, src).wait()
    if pg.rank() != src:
        payload = torch.empty(int(length.item()), dtype=torch.uint8, device=dev)
    pg.broadcast(payload, src).wait()
    return obj if pg.rank() == src else pickle.loads(payload.cpu().numpy().tobytes())
