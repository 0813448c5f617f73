"""``DistributedDataParallel``: ddptrain's own data-parallel wrapper (not torch's).

Synchronisation points, each a collective that every rank must reach:

* construction — a check that every rank holds the same parameters, then a broadcast of
  parameters and buffers from rank 0 (``init_sync=True``);
* every forward with gradients enabled — a broadcast of buffers from rank 0
  (``broadcast_buffers=True`` and the module has buffers), and once, at the second iteration,
  a broadcast of rank 0's gradient order to rebuild the buckets;
* every backward of such a forward — one all-reduce per bucket, launched while backward is still
  running; with ``find_unused_parameters=True`` also a small all-reduce of which parameters were
  used. Under ``no_sync()`` backward communicates nothing.

So a forward that only one rank runs (e.g. validation on rank 0) must run under
``torch.no_grad()``, or on ``ddp.module``.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..comm import api as comm_api
from ..comm.objects import all_gather_object
from ..comm.process_group import ProcessGroup
from ..comm.types import ReduceOp
from ..config import DEFAULT_BUCKET_CAP_MB
from .buckets import MB
from .comm_hooks import check_comm_hook
from .reducer import IterationStats, Reducer

_IGNORED_TORCH_KWARGS = {"check_reduction"}  # deprecated in torch too; accepted for drop-in use


def resolve_process_group(process_group=None) -> ProcessGroup:
    """Our group if given or initialised; else torch.distributed's default group, adapted."""
    if isinstance(process_group, ProcessGroup):
        return process_group
    if process_group is not None:  # a torch.distributed group object
        from ..comm.backends.torch_c10d import TorchProcessGroup

        return TorchProcessGroup.from_torch(process_group)
    if comm_api.is_initialized():
        return comm_api.get_process_group()
    import torch.distributed as tdist

    if tdist.is_available() and tdist.is_initialized():
        from ..comm.backends.torch_c10d import TorchProcessGroup

        return TorchProcessGroup.from_torch(None)
    raise RuntimeError(
        "DistributedDataParallel needs a process group: call ddptrain.comm.init_process_group(...) "
        "(or torch.distributed.init_process_group) first, or pass process_group=."
    )


class ModelsDifferError(RuntimeError, ValueError):
    """Ranks built different models (parameter names, shapes, dtypes or requires_grad differ).

    A ``RuntimeError``, as torch DDP raises for it, and a ``ValueError``, as ddptrain raised before."""


class DistributedDataParallel(nn.Module):
    """Data-parallel training: each rank runs its own batch, gradients are averaged in backward.

    Takes ``torch.nn.parallel.DistributedDataParallel``'s keyword names, so swapping the class
    in an existing script works. Keywords: ``device_ids`` (at most one device, the module's),
    ``output_device``, ``dim`` (0), ``broadcast_buffers``, ``init_sync``, ``process_group`` (a
    ddptrain ProcessGroup or a torch.distributed group), ``bucket_cap_mb`` (default
    ``ddptrain.config.DEFAULT_BUCKET_CAP_MB``, torch's 25),
    ``find_unused_parameters``, ``gradient_as_bucket_view``, ``static_graph`` (accepted: the
    graph is treated as dynamic, which is always correct), ``check_reduction`` (ignored, as in
    torch). Any other keyword raises ``TypeError`` naming it.

    Behaves as torch's where torch's own tests look (docs/torch-ddp-conformance.md): sparse
    gradients of ``nn.Embedding``/``nn.EmbeddingBag(sparse=True)`` stay sparse and are averaged;
    ``backward(create_graph=True)`` works; ``torch.save(ddp)`` and ``copy.deepcopy(ddp)`` drop the
    process group and reducer and rebuild them on load (default group only; a comm hook must be
    registered again); errors have torch's exception types.

    After construction, ``last_iteration_stats`` describes the latest synchronised backward
    (buckets, launch times, time spent waiting for communication).
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids=None,
        output_device=None,
        dim: int = 0,
        broadcast_buffers: bool = True,
        init_sync: bool = True,
        process_group=None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        **kwargs,
    ):
        super().__init__()
        _check_torch_keywords(kwargs, dim)
        self.module = module
        self.process_group = resolve_process_group(process_group)
        self._check_devices(device_ids, output_device)
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.bucket_cap_mb = DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else float(bucket_cap_mb)
        if self.bucket_cap_mb < 0:
            raise ValueError(f"bucket_cap_mb must be >= 0, got {bucket_cap_mb}")
        self.require_backward_grad_sync = True
        self._join_depth = 0
        self._join_iterations = 0

        self._picklable = process_group is None  # the default group: the one unpickling can find again
        named = _unique_named_parameters(module)
        # Compare the models first: a rank whose copy alone is all frozen must not leave the others
        # waiting in that comparison. A module with nothing to train is refused by _build_reducer.
        self._verify_same_model(named)
        if init_sync:
            self._broadcast_coalesced([p.detach() for _, p in named] + list(module.buffers()))
        self._build_reducer()

    def _build_reducer(self) -> None:
        """The reducer of the module's trainable parameters, with this module's settings (at
        construction, and again after unpickling: a reducer holds hooks, never pickled)."""
        trainable = _trainable(_unique_named_parameters(self.module))
        self._param_names = [n for n, _ in trainable]
        self._buffers_to_sync = list(self.module.buffers())
        self.reducer = Reducer(
            [p for _, p in trainable],
            self._param_names,
            self.process_group,
            int(self.bucket_cap_mb * MB),
            self.gradient_as_bucket_view,
            self.find_unused_parameters,
            sparse=_sparse_gradient_params(self.module, [p for _, p in trainable]),
        )

    # -- pickling (torch.save(ddp), copy.deepcopy(ddp)) ---------------------------------------
    def __getstate__(self) -> dict:
        """The module and settings; not the process group or the reducer (torch DDP's rule)."""
        if not self._picklable:
            raise RuntimeError(
                "DDP Pickling/Unpickling are only supported when using DDP with the default process "
                "group. That is, when you have called init_process_group and have not passed "
                "process_group argument to DDP constructor. (ddptrain cannot find a group passed "
                "explicitly again when the copy is loaded.) Save ddp.module, or its state_dict, instead."
            )
        state = dict(self.__dict__)
        del state["process_group"], state["reducer"]
        return state

    def __setstate__(self, state: dict) -> None:
        """Join the default process group and build a new reducer; a comm hook is not carried over
        (register it again), as in torch. Parameters are not broadcast: the copy holds what was saved."""
        super().__setstate__(state)
        self.process_group = resolve_process_group(None)
        self._build_reducer()

    # -- construction checks ----------------------------------------------------------------
    def _check_devices(self, device_ids, output_device) -> None:
        devices = {p.device for p in self.module.parameters()}
        if len(devices) > 1:
            raise ValueError(
                f"the module's parameters live on several devices {sorted(map(str, devices))}; "
                "DistributedDataParallel needs one device per process (move the module first)."
            )
        if device_ids is not None:
            ids = list(device_ids)
            if len(ids) > 1:
                raise ValueError(
                    f"device_ids={ids}: one device per process, as in torch DDP; start one process per GPU instead."
                )
            if ids and devices:
                want = torch.device(ids[0]) if not isinstance(ids[0], int) else torch.device("cuda", ids[0])
                have = next(iter(devices))
                if want != have:
                    raise ValueError(
                        f"device_ids={ids} but the module is on {have}; call "
                        f"module.to({str(want)!r}) before wrapping it."
                    )

    def _verify_same_model(self, named) -> None:
        """Fail with the first parameter that differs, naming it and the ranks that disagree."""
        pg = self.process_group
        if pg.size() == 1:
            return
        meta = [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in named]
        digest = zlib.crc32(repr(meta).encode())
        t = torch.tensor([digest, -digest], dtype=torch.int64, device=pg.device)
        pg.all_reduce(t, ReduceOp.MAX).wait()
        if int(t[0]) == -int(t[1]):
            return
        metas = all_gather_object(pg, meta)
        ref = metas[0]
        for rank, other in enumerate(metas[1:], start=1):
            if other == ref:
                continue
            if len(other) != len(ref):
                detail = f"rank 0 has {len(ref)} parameters, rank {pg.global_ranks[rank]} has {len(other)}"
            else:
                i = next(i for i, (a, b) in enumerate(zip(ref, other)) if a != b)
                detail = (
                    f"parameter #{i}: rank 0 has {ref[i][0]} shape {ref[i][1]} {ref[i][2]} "
                    f"requires_grad={ref[i][3]}, rank {pg.global_ranks[rank]} has {other[i][0]} "
                    f"shape {other[i][1]} {other[i][2]} requires_grad={other[i][3]}"
                )
            raise ModelsDifferError(
                "DistributedDataParallel needs the same model on every rank, and ranks disagree: "
                f"{detail}. Build the model identically on every rank (same config, same code path)."
            )

    def _broadcast_coalesced(self, tensors: list[torch.Tensor], src: int = 0) -> None:
        """Broadcast tensors from group rank ``src`` with one collective per dtype."""
        pg = self.process_group
        if pg.size() == 1 or not tensors:
            return
        by_dtype: dict[tuple, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault((t.dtype, t.device), []).append(t)
        with torch.no_grad():
            for group in by_dtype.values():
                flat = torch.cat([t.reshape(-1) for t in group])
                pg.broadcast(flat, src).wait()
                offset = 0
                for t in group:
                    t.copy_(flat[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()

    # -- forward ----------------------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        grad_enabled = torch.is_grad_enabled()
        if grad_enabled:
            if self._join_depth:
                self._join_vote(active=True)
            self._pre_forward()
        output = self.module(*inputs, **kwargs)
        if grad_enabled:
            self.reducer.prepare_for_backward(output, sync=self.require_backward_grad_sync)
        return output

    def _pre_forward(self) -> None:
        self.reducer.prepare_for_forward()
        self.sync_buffers()

    def sync_buffers(self) -> None:
        """Give every rank rank 0's buffers (BatchNorm's running statistics, say); collective.

        Every training forward does this first (with ``broadcast_buffers=True``, torch's rule), so
        the buffers a rank updates in its own forward differ from rank 0's until the next one.
        Call it before using the module outside a training forward — evaluation, a checksum — so
        that every rank holds the model rank 0 checkpoints. Does nothing with
        ``broadcast_buffers=False`` (each rank keeps its own buffers, by request) or no buffers.
        """
        if self.broadcast_buffers and self._buffers_to_sync:
            self._broadcast_coalesced(self._buffers_to_sync)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally; the next synchronised backward averages their sum."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    # -- hooks and stats --------------------------------------------------------------------
    def register_comm_hook(self, state: object, hook: Callable) -> None:
        """Replace the bucket all-reduce with ``hook(state, bucket) -> Future[Tensor]``.

        Register before the first backward, once (as in torch). ``state=None`` lets the built-in
        hooks use this module's process group. Built in (``ddptrain.ddp.comm_hooks``):
        ``allreduce_hook``, ``fp16_compress_hook``, ``bf16_compress_hook``, ``powerSGD_hook``
        (state: ``PowerSGDState``) and ``ring_allreduce_hook`` (state:
        ``ddptrain.comm.ring.RingAllReducer(group)``). A hook sees each bucket's whole flat
        buffer, so large gradients are then copied into it rather than reduced in place. Refused as
        torch refuses it: not callable (``TypeError``), ``bucket`` or the return annotated as
        something other than a GradBucket / ``torch.futures.Future`` (``ValueError``), a second
        hook (``RuntimeError``); a hook that returns no Future fails its backward (``RuntimeError``).
        """
        check_comm_hook(hook)
        if self.reducer.comm_hook is not None:
            raise RuntimeError(
                "register_comm_hook or register_builtin_comm_hook can only be called once. This DDP "
                f"module already sends its buckets through {getattr(self.reducer.comm_hook, '__name__', 'a hook')}."
            )
        if self.reducer.iteration > 0:
            raise RuntimeError("register_comm_hook must be called before the first backward")
        if state is not None and getattr(state, "process_group", "absent") is None:
            state.process_group = self.process_group
        self.reducer.set_comm_hook(hook, state)

    def _register_builtin_comm_hook(self, comm_hook_type) -> None:
        """torch DDP's ``_register_builtin_comm_hook`` (its name, underscore included, for scripts that
        call it): ``torch.distributed.BuiltinCommHookType.ALLREDUCE``
        or ``FP16_COMPRESS`` (the string names work too), as the built-in hooks of this package."""
        from .comm_hooks import allreduce_hook, fp16_compress_hook

        name = getattr(comm_hook_type, "name", str(comm_hook_type)).upper()
        hooks = {"ALLREDUCE": allreduce_hook, "FP16_COMPRESS": fp16_compress_hook}
        if name not in hooks:
            raise ValueError(f"unknown built-in comm hook {comm_hook_type!r}; choose one of {sorted(hooks)}")
        self.register_comm_hook(None, hooks[name])

    def check_parameters_in_sync(self) -> None:
        """Raise ``RuntimeError`` naming the ranks whose parameters or buffers differ from the rest.

        A cheap desynchronisation guard: one CRC32 of every parameter and buffer per rank, all
        gathered (one small collective). Call it every N steps (the trainer's
        ``check_sync_every_n_steps``); every rank must call it at the same step.
        """
        pg = self.process_group
        crc = 0
        for t in list(self.module.parameters()) + self._buffers_to_sync:
            crc = zlib.crc32(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes(), crc)
        mine = torch.tensor([crc], dtype=torch.int64, device=pg.device)
        every = [torch.zeros(1, dtype=torch.int64, device=pg.device) for _ in range(pg.size())]
        pg.all_gather(every, mine).wait()
        sums = [int(e.item()) for e in every]
        if len(set(sums)) == 1:
            return
        majority = max(set(sums), key=sums.count)
        diverged = [pg.global_ranks[r] for r, v in enumerate(sums) if v != majority]
        raise RuntimeError(
            f"parameters are no longer identical on every rank: rank(s) {diverged} diverged from the "
            f"others (checksums {sums}). Something changed a replica outside DDP's control (an "
            "optimizer step on one rank only, rank-dependent code that writes parameters, a "
            "non-deterministic buffer update). Resume from the last checkpoint and fix that code path."
        )

    def register_sideband(self, size: int, values: Callable[[], Sequence[float]]) -> None:
        """Sum ``values()`` over ranks in every synchronised backward, riding in a gradient bucket's
        all-reduce (no collective of its own); read the sums with :meth:`take_sideband`.

        For small non-negative integers such as votes (they are summed in the gradients' dtype).
        The trainer sends its stop votes this way. See :meth:`.reducer.Reducer.register_sideband`.
        """
        self.reducer.register_sideband(size, values)

    def take_sideband(self) -> list[float] | None:
        """The sideband sums of the latest synchronised backward, once; None if none came since."""
        return self.reducer.take_sideband()

    @property
    def last_iteration_stats(self) -> IterationStats | None:
        return self.reducer.last_stats

    @property
    def bucket_assignment(self) -> list[list[str]]:
        """Parameter names per bucket, in launch order."""
        return [[self._param_names[i] for i in b] for b in self.reducer.plan.assignment]

    # -- uneven inputs ----------------------------------------------------------------------
    @contextlib.contextmanager
    def join(self, enable: bool = True):
        """Let ranks run different numbers of iterations without hanging.

        Inside the context every forward first agrees on how many ranks are still training (one
        small all-reduce). A rank that leaves the context early shadows the others' collectives
        with zero gradients until every rank is done; then all ranks take the parameters and
        buffers of a rank that ran the most iterations, so they end identical. Gradients are
        averaged over the full world size, as torch DDP's default.
        """
        if not enable:
            yield
            return
        self._join_depth += 1
        self._join_iterations = 0
        ok = False
        try:
            yield
            ok = True
        finally:
            self._join_depth -= 1
            if ok:
                self._shadow_until_all_joined()

    def _join_vote(self, active: bool) -> int:
        flag = torch.tensor([1 if active else 0], dtype=torch.int64, device=self.process_group.device)
        self.process_group.all_reduce(flag, ReduceOp.SUM).wait()
        if active:
            self._join_iterations += 1
        return int(flag.item())

    def _shadow_until_all_joined(self) -> None:
        while self._join_vote(active=False) > 0:
            self._pre_forward()
            self.reducer.shadow_iteration()
        pg = self.process_group
        # Pick the rank that ran the most iterations (lowest rank on ties) as the reference.
        score = torch.tensor(
            [self._join_iterations * pg.size() + (pg.size() - 1 - pg.rank())], dtype=torch.int64, device=pg.device
        )
        pg.all_reduce(score, ReduceOp.MAX).wait()
        src = pg.size() - 1 - int(score.item()) % pg.size()
        self._broadcast_coalesced([p.detach() for p in self.module.parameters()] + self._buffers_to_sync, src)


def _check_torch_keywords(kwargs: dict, dim: int) -> None:
    """Refuse torch DDP's keywords that ddptrain does not implement, naming them."""
    unsupported = sorted(set(kwargs) - _IGNORED_TORCH_KWARGS)
    if unsupported:
        raise TypeError(
            f"DistributedDataParallel got keyword(s) {unsupported} that ddptrain does not support; "
            "supported: device_ids, output_device, dim, broadcast_buffers, init_sync, process_group, "
            "bucket_cap_mb, find_unused_parameters, gradient_as_bucket_view, static_graph. "
            "Remove the keyword or use torch.nn.parallel.DistributedDataParallel for it."
        )
    if dim != 0:
        raise ValueError(
            f"dim={dim}: ddptrain's DistributedDataParallel does not scatter inputs; "
            "each rank feeds its own batch. Leave dim=0."
        )


def _trainable(named: list[tuple[str, torch.nn.Parameter]]) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters that require a gradient; refuses a module without any."""
    trainable = [(n, p) for n, p in named if p.requires_grad]
    if not trainable:
        raise RuntimeError(  # RuntimeError and this first sentence: torch's, which code catches
            "DistributedDataParallel is not needed when a module doesn't have any parameter that "
            f"requires a gradient. This one has {len(named)} parameter(s), all frozen or none at all: "
            "there is nothing to train or synchronise. Unfreeze some parameters, or don't wrap this "
            "module in DDP."
        )
    return trainable


def _sparse_gradient_params(module: nn.Module, params: list[torch.Tensor]) -> frozenset[int]:
    """Indices (in ``params``) of the parameters whose gradient is sparse: those of an
    ``nn.Embedding`` or ``nn.EmbeddingBag`` with ``sparse=True`` (torch DDP's rule)."""
    sparse_ids = {
        id(p)
        for m in module.modules()
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
        for p in m.parameters(recurse=False)
    }
    return frozenset(i for i, p in enumerate(params) if id(p) in sparse_ids)


def _unique_named_parameters(module: nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """Named parameters with tied (shared) ones listed once, in registration order."""
    seen, out = set(), []
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        out.append((name, p))
    return out
