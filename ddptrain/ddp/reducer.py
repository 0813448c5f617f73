"""The reducer: how one gradient gets from autograd to the average over every rank.

Follow the gradient of one parameter ``i`` through a synchronised iteration:

1. **Layout** (at construction, and once more at the rebuild): :func:`~.buckets.plan_buckets`
   gives ``i`` a :class:`~.buckets.Slot` — its bucket, its position in the bucket's flat
   buffer, and whether it is reduced in place. The plan is immutable; only a rebuild or a
   newly registered comm hook replaces it.
2. **Forward** — :meth:`Reducer.prepare_for_backward` starts a fresh :class:`_Iteration`
   (pending counts, in-flight work, arrival order, stats). With ``find_unused_parameters`` it
   walks the autograd graph from the outputs and marks the parameters it does not reach.
3. **Hook** — autograd has accumulated ``p.grad`` and calls ``i``'s post-accumulate-grad hook.
   The first hook of a backward queues :meth:`Reducer._finalize` on the autograd engine;
   :meth:`Reducer._mark_ready` counts the gradient against its bucket.
4. **Stage** (:meth:`Reducer._stage_batch`, every ``STAGE_BATCH`` gradients of a bucket and when
   its last one arrives; under ZeRO each gradient at once, so that it can be freed) — a gradient
   in an in-place slot is averaged where it lies (``grad *= 1/world_size``); the others are copied
   into their slots of the flat buffer and averaged there, a batch in two ``torch._foreach_*``
   loops (no Python per gradient: on a model of many small tensors the host's work per gradient is
   what a step costs). (An in-place slot whose gradient may not be changed —
   it may share storage with another gradient, is not a plain dense tensor, or is missing — is
   staged in the buffer too, and that slot is sent instead: the collectives stay the same on
   every rank.)
5. **Launch** (:meth:`Reducer._launch_ready_buckets`) — a bucket whose count reached zero
   starts its async all-reduces: one SUM per transfer of the plan, or the registered comm hook
   with the whole flat buffer (then the buffer holds raw sums and the hook divides). Buckets go
   strictly in order, so every rank issues the same collectives in the same order.
6. **Write back** (:meth:`Reducer._finalize`, once backward is done) — wait for each bucket;
   gradients reduced in place already hold the average, the others are copied back from the
   flat buffer (with ``gradient_as_bucket_view`` they *are* views of it); with
   ``find_unused_parameters``, a parameter no rank used keeps ``grad=None`` (or the gradient it
   had: it is left alone). A gradient accumulated under ``no_sync`` counts as used in the next
   synchronised backward even if that backward does not reach it, as in torch, so it is averaged.

**CUDA streams** (torch's reducer's rules; no ``synchronize()`` anywhere on this path). A hook
runs on the stream autograd produced its gradient on (the leaf's stream), so staging there reads a
finished gradient; a launch makes the process group's stream wait for the current one (NCCL and
gloo's CUDA path do that themselves; the mpi backend records an event, :mod:`ddptrain.comm.backends.mpi`).
Staging is batched, so a gradient may be copied, and its bucket launched, from a later gradient's
hook: when one backward's gradients come from more than one stream, the current stream first waits
for all of them (:meth:`Reducer._join_streams`; one stream, the common case, costs a set insert per
gradient). :meth:`Reducer._finalize` runs as the engine's final callback, on the stream that called
``backward()``, which the engine made wait for every leaf stream; waiting for a bucket's work makes
that stream wait for the collective (a stream wait, not a host one), and the write back is queued
after it.

**Sparse gradients** (the parameters of ``nn.Embedding`` / ``nn.EmbeddingBag`` built with
``sparse=True``, as torch DDP decides): they belong to no bucket. Once backward is done and every
bucket has launched, :meth:`Reducer._reduce_sparse` all-reduces each one as a sparse COO tensor
(divided by the world size first, as torch divides), one collective each, in parameter order — the
same on every rank; a rank without that gradient sends an empty one. With a comm hook, each goes
through the hook as a bucket of its own (``buffer()`` is the sparse gradient). ``.grad`` stays sparse.

**backward(create_graph=True)**: a gradient that requires grad is staged detached (the same bits);
its ``.grad`` becomes the average over ranks through :class:`_GraphedAverage`, whose derivative
reaches this rank's own gradient — torch DDP's semantics: higher-order terms are not synchronised.

**Sideband** (:meth:`Reducer.register_sideband`): a few small numbers a caller wants summed over
ranks every synchronised step — the trainer's stop votes — ride at the end of a bucket's flat
buffer, after its gradients, in that bucket's last all-reduce: no collective of their own. The
bucket is the last one (in launch order) whose last transfer is a flat run, so its values are read
when that bucket launches, during backward, after the forward and the loss. With a comm hook, or
when no bucket ends in a flat run, they travel in one small all-reduce of their own, launched
after the last bucket.

**Sharded gradients** (:meth:`Reducer.shard_gradients`, ZeRO: :mod:`.zero`): every gradient goes
through the flat buffer (padded as :class:`~.shards.ShardLayout` says), divided by the world size
on its way in (a division, as the ring comm hook's, not a multiplication by the inverse, which
rounds differently); the launch *reduce-scatters* the buffer, and the write back
keeps only this rank's chunk, in :attr:`Reducer.shard_grads`: parameters' ``.grad`` are set to
``None`` as soon as they are staged. Stage 1 keeps the buckets' buffers. Stage 2 lays each bucket
over one of two reused buffers (``ZERO2_BUFFERS``, each the size of the largest bucket) as its first
gradient comes, and gives it back once its chunk is copied out; a bucket that finds both taken
waits for the older one's reduce-scatter. So no full-size gradient outlives backward (the shard and
two buckets' worth of scratch do), and no backward allocates (on CPU a fresh buffer costs a page
fault per 4 KiB: at 16.8M parameters and 2 ranks, freeing and allocating the buckets every backward
made the step 1.18-1.30x plain DDP's, against 0.98-1.06x with the reuse, both measured before the
two-rank exchange of :mod:`.shards` made it faster still).

The next forward (:meth:`Reducer.prepare_for_forward`) refuses to go on if a backward left a
bucket unlaunched (a parameter got no gradient), and after the first iteration rebuilds the
buckets once, in the order gradients actually arrived on rank 0 (broadcast, so ranks agree). The
first layout already assumed the reverse of registration order, so for a model that runs its
modules in registration order the rebuild finds nothing to change and installs nothing.

Why in place: copying a gradient into the flat buffer and the result back costs two passes
over memory, which on a CPU-bound rank costs as much as a large part of the all-reduce itself;
coalescing only pays for small tensors (one collective instead of many). So, without a comm
hook and without ``gradient_as_bucket_view``, gradients of at least ``DIRECT_MIN_BYTES`` are
averaged and all-reduced where they lie, while the small ones still travel together.

Which gradients may change in place is learnt, not guessed: autograd can hand two parameters
gradients that share one buffer (``(p1.view(-1) + p2.view(-1)) * x`` gives both views of the
sum's gradient), and when the first one's hook fires the second does not exist yet. So the first
synchronised backward stages every gradient in the flat buffers (the same bits: the average is the
same multiplication either way) and, once all exist, records which parameters' gradients shared
a storage (:attr:`Reducer.shares_storage`); those never go in place. Every later backward checks
again, after the fact, that no in-place gradient shared its storage, and raises if one did (a
graph whose aliasing changed), rather than return a silently wrong average.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..comm.process_group import ProcessGroup
from ..comm.types import ReduceOp
from .buckets import (
    FIRST_BUCKET_CAP_MB,
    MB,
    BucketPlan,
    FlatBuffer,
    FlatRun,
    GradBucket,
    ParamSpec,
    Transfer,
    allocate,
    assign_buckets,
    bucket_in,
    plan_buckets,
)
from .shards import ShardComm, ShardLayout

# Gradients at least this big are all-reduced in place instead of through the flat buffer.
DIRECT_MIN_BYTES = 1 << 20
# ZeRO-2's bucket buffers kept for reuse, per dtype and device (double buffering: one bucket fills
# while the previous one is reduce-scattered). A bucket that needs a third waits for the oldest
# launched one to finish; only when none is launched yet (gradients out of layout order) is
# another allocated.
ZERO2_BUFFERS = 2
# Gradients are staged into their bucket in batches of this many as they arrive (a bucket's last
# ones as it completes): few Python calls per gradient, and little left to copy when a bucket's last
# gradient arrives — for the step's last bucket that copy delays the all-reduce everyone waits for.
STAGE_BATCH = 32

CommHook = Callable[[object, GradBucket], torch.futures.Future]


class UnusedParametersError(RuntimeError):
    """The previous backward gave no gradient to ``names`` (raised at the next forward): their
    buckets were never all-reduced. ``fix``: how the caller turns on unused-parameter detection, in
    its own terms (a framework names its config key)."""

    def __init__(
        self, names: Sequence[str], fix: str = "construct DistributedDataParallel(..., find_unused_parameters=True)"
    ):
        self.names = list(names)
        super().__init__(
            "DDP expected every parameter to receive a gradient in the previous backward, but "
            f"these did not: {', '.join(self.names)}. Their buckets were never all-reduced, so "
            f"gradients would be wrong. Either make the forward use these parameters, or {fix} "
            "(slower: it walks the autograd graph every iteration), or set requires_grad=False on "
            "parameters that should not train."
        )


@dataclass
class IterationStats:
    """What one synchronised backward did, for the trainer's logs and for benchmarks.

    Moments are read with ``Reducer.clock``: ``time.perf_counter()`` seconds, unless a measuring
    tool set a :class:`~.timing.DeviceClock` on a GPU (then they are CUDA events until it resolves
    them, and ``finalize_wait_s`` is left at 0: it is ``finalize_end - backward_end``, resolved);
    ``launch_offsets_s`` are relative to the first gradient hook, ``None`` for a bucket that was
    never launched. ``done_times`` (only while
    ``Reducer.track_completion`` is set, for ``ddptrain doctor``): when each bucket's result was
    in — ``backward_end`` for one already complete when backward ended, else when its wait
    returned; ``ready_times``: (parameter index, when its gradient hook fired), in arrival order.
    ``find_unused_s``: time spent finding unused parameters (the graph walk at forward,
    plus ``find_unused_comm_s``, the all-reduce of the used flags inside ``finalize_wait_s``).
    """

    iteration: int
    bucket_bytes: list[int]
    bucket_num_params: list[int]
    backward_start: float = 0.0
    backward_end: float = 0.0
    launch_times: list[float | None] = field(default_factory=list)
    finalize_end: float = 0.0
    finalize_wait_s: float = 0.0
    rebuilt_buckets: bool = False
    done_times: list[float | None] = field(default_factory=list)
    ready_times: list[tuple[int, float]] = field(default_factory=list)
    find_unused_s: float = 0.0
    find_unused_comm_s: float = 0.0
    unused_on_rank: int = 0

    @property
    def launch_offsets_s(self) -> list[float | None]:
        return [None if t is None else t - self.backward_start for t in self.launch_times]

    @property
    def comm_wait_s(self) -> float:
        return self.finalize_wait_s


class _Iteration:
    """What one backward records; a new one per forward, so nothing leaks into the next."""

    def __init__(self, plan: BucketPlan, num_params: int, index: int, sync: bool):
        n_buckets = len(plan.buckets)
        self.sync = sync  # False inside no_sync(): hooks leave the gradients alone
        self.finalize_queued = False
        self.finalized = False
        self.pending = [len(b.params) for b in plan.buckets]  # gradients still to come, per bucket
        self.ready = [False] * num_params
        self.arrival_order: list[int] = []
        self.used = [False] * num_params  # got a gradient on this rank (find_unused_parameters)
        self.in_place: dict[int, torch.Tensor] = {}  # parameter -> its gradient, reduced where it lies
        self.graph_grads: dict[int, torch.Tensor] = {}  # backward(create_graph=True): parameter -> its scaled gradient
        self.arrived: list[list[int]] = [[] for _ in range(n_buckets)]  # per bucket: ready, not yet staged
        # per bucket: (position, gradient) of gradients _stage left for its batch to copy in
        self.deferred: list[list[tuple[int, torch.Tensor]]] = [[] for _ in range(n_buckets)]
        self.work: list[object] = [None] * n_buckets  # per launched bucket: list of Work, or the hook's Future
        self.kept = [False] * n_buckets  # ZeRO-2: its shard taken (its buffer given back) before backward ended
        self.sideband: torch.Tensor | None = None  # this iteration's sideband values, summed once waited for
        self.sideband_work: object = None  # its own all-reduce, when it does not ride in a bucket
        self.next_bucket = 0
        self.streams: set = set()  # CUDA: the streams this backward's gradients came on (module doc)
        self.stats = IterationStats(
            index,
            [b.nbytes for b in plan.buckets],
            [len(b.params) for b in plan.buckets],
            launch_times=[None] * n_buckets,
        )


class Reducer:
    """Averages gradients across ``process_group`` while backward runs (see the module doc)."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        names: Sequence[str],
        process_group: ProcessGroup,
        bucket_cap_bytes: int,
        gradient_as_bucket_view: bool = False,
        find_unused_parameters: bool = False,
        sparse: frozenset[int] = frozenset(),
    ):
        self.params = list(params)
        self.sparse = frozenset(sparse)  # parameters with sparse gradients: no bucket (module doc)
        if self.sparse and process_group.backend == "mpi":
            raise RuntimeError(
                f"sparse gradients ({', '.join(self.names[i] for i in sorted(self.sparse))}, of a module "
                "built with sparse=True) need the gloo or nccl backend: the mpi backend all-reduces dense "
                "buffers only. Use backend=gloo, or build the embedding with sparse=False."
            )
        self.names = list(names)
        self.pg = process_group
        self.world_size = process_group.size()
        self.bucket_cap_bytes = bucket_cap_bytes
        self.as_view = gradient_as_bucket_view
        self.find_unused = find_unused_parameters
        # parameters whose gradient hook fired under no_sync since the last synchronised backward:
        # they count as used there even if that backward does not reach them (torch's
        # local_used_map), so that the gradient they accumulated is averaged, not left local
        self._used_without_sync: set[int] = set()
        self.in_place_min_bytes = DIRECT_MIN_BYTES
        self.shares_storage: set[int] | None = None  # learnt in the first synchronised backward (module doc)
        self.track_completion = False  # ddptrain doctor: record when each bucket completed
        # What IterationStats' moments are read with: the doctor sets a DeviceClock's now on a GPU
        self.clock: Callable[[], object] = time.perf_counter
        self.comm_hook: CommHook | None = None
        self.comm_hook_state: object = None
        self._sideband_size = 0
        self._sideband_values: Callable[[], Sequence[float]] | None = None
        self._sideband_bucket: int | None = None  # the bucket it rides in (None: its own all-reduce)
        self.sideband: list[float] | None = None  # the sums of the latest synchronised backward
        self._specs = [ParamSpec.of(p) for p in self.params]
        self._on_cuda = any(p.is_cuda for p in self.params)  # then hooks note their stream (module doc)
        self.shard_comm: ShardComm | None = None  # set by shard_gradients (ZeRO)
        self.zero_stage = 0
        self.shard_layouts: list[ShardLayout] = []  # per bucket, while sharded
        self.shard_grads: list[torch.Tensor] = []  # per bucket: this rank's chunk of the averaged gradients
        self.spare_buffers: dict[tuple, list[torch.Tensor]] = {}  # ZeRO-2: bucket buffers for reuse (ZERO2_BUFFERS)
        self._lent: dict[int, tuple[tuple, torch.Tensor]] = {}  # ZeRO-2: bucket -> its (key, buffer) this backward
        self.layout_version = 0  # counts installed layouts: a sharded optimizer re-splits when it changes
        self._install(self._layout_in(reversed(range(len(self.params)))))
        self._sparse_order = sorted(self.sparse)
        self.iteration = 0
        self.rebuilt = False
        self._rebuild_due = False
        self._arrival_order: list[int] = []  # of the latest finished backward; rank 0's drives the rebuild
        self._incomplete: list[str] = []  # parameters the previous backward never got (raised at next forward)
        self.last_stats: IterationStats | None = None
        self._it = _Iteration(self.plan, len(self.params), 0, sync=False)
        self._hook_handles = [
            p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(self.params)
        ]

    # -- layout ------------------------------------------------------------------------------
    def _assign(self, cap_bytes: int | None = None, **kwargs) -> list[list[int]]:
        sizes = [s.nbytes for s in self._specs]
        keys = [(s.dtype, s.device) for s in self._specs]
        return assign_buckets(sizes, keys, self.bucket_cap_bytes if cap_bytes is None else cap_bytes, **kwargs)

    def _install(self, assignment: list[list[int]]) -> None:
        """Plan ``assignment``, allocate its buffers; a comm hook gets raw sums and the whole buffer
        (so does a sharded launch, which divides before it reduce-scatters)."""
        # The old layout's buffers go first, so old and new are never allocated together (a peak of
        # one extra model-sized gradient). What still needs them (gradient_as_bucket_view's .grad,
        # a sharded optimizer's gradient views) holds its own reference until it is moved.
        self.flat, self.shard_grads = [], []
        self._scale = 1.0 if (self.comm_hook is not None or self.shard_comm is not None) else 1.0 / self.world_size
        # Gradients bound for the flat buffer are copied in by batches (Reducer._stage_batch),
        # except where staging does more than copy and scale: a sharded launch divides, and
        # gradient_as_bucket_view makes .grad the buffer's view.
        self._defer_copy = self.shard_comm is None and not self.as_view
        self.plan = plan_buckets(self._specs, assignment, self._in_place_min(), self.sparse)
        self._sideband_bucket = self._sideband_carrier()
        if self.shard_comm is not None:
            self.shard_layouts = [self.shard_comm.layout(b.numel) for b in self.plan.buckets]
            tail = {b.index: lay.padded_numel - b.numel for b, lay in zip(self.plan.buckets, self.shard_layouts)}
        else:
            tail = {} if self._sideband_bucket is None else {self._sideband_bucket: self._sideband_size}
        self._tail = tail
        if self.zero_stage == 2:  # taken as gradients arrive, given back once their chunk is kept
            self.flat: list[FlatBuffer | None] = [None] * len(self.plan.buckets)
            self.spare_buffers, self._lent = {}, {}
            self._buffer_numel = {}  # per (dtype, device): the largest bucket's padded length
            for b, lay in zip(self.plan.buckets, self.shard_layouts):
                key = (b.dtype, b.device)
                self._buffer_numel[key] = max(self._buffer_numel.get(key, 0), lay.padded_numel)
            self.shard_grads = [
                torch.zeros(lay.size, dtype=b.dtype, device=b.device)
                for lay, b in zip(self.shard_layouts, self.plan.buckets)
            ]
        else:
            self.flat = allocate(self.plan, tail)
        self._split_members()
        if self.zero_stage == 1:
            # The owned chunk of each bucket's buffer, which the buffers keep between steps: the
            # reduce-scatter leaves the average there, and only the next synchronised backward
            # (after the step used it) writes the buffer again. No copy of it is kept.
            self.shard_grads = [f.buffer[lay.start : lay.stop] for f, lay in zip(self.flat, self.shard_layouts)]
        self.layout_version += 1
        if self.as_view:  # existing gradients move into the new buffers
            for i, p in enumerate(self.params):
                if p.grad is not None and i not in self.sparse:
                    view = self._slot_views[i]
                    view.copy_(p.grad)
                    p.grad = view

    def _split_members(self) -> None:
        """Index the layout for the hot path. Per parameter: whether its slot is flat-only (not
        in place) and its slot's view (None: no bucket, or ZeRO-2's buffers, laid out as gradients
        come). Per bucket: its flat-only members (``_flat_only[b]``: indices and views, copied out
        in one batch), its in-place members (``_in_place_slots[b]``: (position, index)) and the
        views of its flat runs (``_run_views[b]``, averaged in one kernel each)."""
        slots = self.plan.slots
        self._flat_only_param = [slot is not None and not slot.in_place for slot in slots]
        self._slot_views: list[torch.Tensor | None] = [None] * len(self.params)
        self._flat_only, self._in_place_slots, self._run_views = [], [], []
        for bucket, flat in zip(self.plan.buckets, self.flat):
            if flat is not None:
                for i, view in zip(bucket.params, flat.views):
                    self._slot_views[i] = view
            flat_only = [i for i in bucket.params if not slots[i].in_place]
            self._flat_only.append((flat_only, [self._slot_views[i] for i in flat_only] if flat is not None else []))
            self._in_place_slots.append([(pos, i) for pos, i in enumerate(bucket.params) if slots[i].in_place])
            runs = [t for t in bucket.transfers if isinstance(t, FlatRun)]
            self._run_views.append([flat.run(t) for t in runs] if flat is not None else [])

    def rebucket(self, bucket_cap_bytes: int) -> None:
        """Lay the buckets out again with another cap, keeping the current launch order (between
        iterations; every rank must call it with the same cap: ``dist.bucket_cap_mb=auto``)."""
        assignment = self.layout_at(bucket_cap_bytes)
        self.bucket_cap_bytes = int(bucket_cap_bytes)
        self._install(assignment)

    def layout_at(self, bucket_cap_bytes: int) -> list[list[int]]:
        """The buckets :meth:`rebucket` would lay out with this cap, without installing them."""
        order = [i for bucket in self.plan.assignment for i in bucket]
        first_cap = min(int(FIRST_BUCKET_CAP_MB * MB), int(bucket_cap_bytes))
        return self._assign(int(bucket_cap_bytes), first_cap_bytes=first_cap, order=order, reverse=False)

    def plan_at(self, bucket_cap_bytes: int) -> BucketPlan:
        """The plan :meth:`rebucket` would install with this cap (``ddptrain doctor``'s what-ifs)."""
        return plan_buckets(self._specs, self.layout_at(bucket_cap_bytes), self._in_place_min(), self.sparse)

    def _sideband_carrier(self) -> int | None:
        """The bucket the sideband rides in: the last whose last all-reduce is a flat run (None: none
        does, or a comm hook, which may compress its buffer, or a reduce-scatter sends the buckets)."""
        if not self._sideband_size or self.comm_hook is not None or self.shard_comm is not None:
            return None
        ends_flat = [b.index for b in self.plan.buckets if isinstance(b.transfers[-1], FlatRun)]
        return ends_flat[-1] if ends_flat else None

    def register_sideband(self, size: int, values: Callable[[], Sequence[float]]) -> None:
        """Sum ``values()`` (``size`` numbers) over ranks in every synchronised backward, at no extra collective.

        ``values`` is called once per synchronised backward, when the carrying bucket launches (in
        backward, so after the forward that produced the loss); :attr:`sideband` then holds the
        sums. They are summed in the gradients' dtype: pass small non-negative integers (votes)
        and test ``> 0``. Every rank must register the same size; call between iterations.
        """
        self._sideband_size, self._sideband_values = int(size), values
        self._install(self.plan.assignment)

    def take_sideband(self) -> list[float] | None:
        """The sideband sums of the latest synchronised backward, once (None if none came since)."""
        sums, self.sideband = self.sideband, None
        return sums

    def _in_place_min(self) -> int | None:
        sends_buffer = self.comm_hook is not None or self.as_view or self.shard_comm is not None
        return None if sends_buffer else self.in_place_min_bytes

    def set_comm_hook(self, hook: CommHook, state: object) -> None:
        """Send buckets through ``hook(state, GradBucket)``; the layout is planned again for it."""
        if self.shard_comm is not None:
            raise RuntimeError(_SHARDED_REFUSES.format(what="a comm hook", why=_HOOK_UNDER_ZERO))
        self.comm_hook, self.comm_hook_state = hook, state
        self._install(self.plan.assignment)

    def shard_gradients(self, comm: ShardComm, stage: int) -> None:
        """Reduce-scatter the buckets instead of all-reducing them (ZeRO ``stage`` 1 or 2; module doc).

        After each synchronised backward, :attr:`shard_grads` ``[b]`` holds the average over ranks
        of this rank's chunk (:attr:`shard_layouts` ``[b]``) of bucket ``b``, and every parameter's
        ``.grad`` is ``None``. Call before the first backward, once.
        """
        if stage not in (1, 2):
            raise ValueError(f"ZeRO stage must be 1 or 2 to shard gradients, got {stage}")
        if self.shard_comm is not None or self.iteration > 0:
            raise RuntimeError("shard_gradients must be called once, before the first backward")
        for what, why, on in (
            ("a comm hook", _HOOK_UNDER_ZERO, self.comm_hook is not None),
            ("gradient_as_bucket_view=True", "no full-size gradient is kept to be a view of", self.as_view),
            (
                "find_unused_parameters=True",
                "a parameter without a gradient would still be stepped (with a zero gradient) in its "
                "shard, while plain DDP skips it",
                self.find_unused,
            ),
            (
                "sparse gradients (nn.Embedding(sparse=True))",
                "a sparse gradient has no fixed chunks to shard",
                bool(self.sparse),
            ),
        ):
            if on:
                raise RuntimeError(_SHARDED_REFUSES.format(what=what, why=why))
        self.shard_comm, self.zero_stage = comm, stage
        self._install(self.plan.assignment)

    def _layout_in(self, order) -> list[list[int]]:
        """Buckets filled in the order gradients arrive (``order``): the first one small (it launches
        early), the others up to the cap."""
        first_cap = min(int(FIRST_BUCKET_CAP_MB * MB), self.bucket_cap_bytes)
        return self._assign(first_cap_bytes=first_cap, order=[i for i in order if i not in self.sparse], reverse=False)

    def _rebuild(self) -> None:
        """Re-bucket once in the order gradients arrived on rank 0, so all ranks agree.

        The first layout assumed the reverse of registration order (what a model that runs its
        modules in that order gives); where the gradients did arrive so, the layout stands as it is
        (no new buffers, and a sharded optimizer's state is not re-split)."""
        seen = set(self._arrival_order)
        order = self._arrival_order + [i for i in range(len(self.params)) if i not in seen]
        order_t = torch.tensor(order, dtype=torch.int64, device=self.pg.device)
        self.pg.broadcast(order_t, 0).wait()
        assignment = self._layout_in(order_t.cpu().tolist())
        if assignment != self.plan.assignment:
            self._install(assignment)
        self.rebuilt = True
        self._rebuild_due = False

    # -- forward -----------------------------------------------------------------------------
    def prepare_for_forward(self) -> bool:
        """Check the previous iteration and rebuild buckets when due; True if it rebuilt."""
        if self._incomplete:
            missing, self._incomplete = self._incomplete, []
            raise UnusedParametersError(missing)
        if self._rebuild_due and not self.rebuilt:
            self._rebuild()
            return True
        return False

    def prepare_for_backward(self, outputs, sync: bool) -> None:
        """Start a new iteration; ``sync=False`` (no_sync) makes the coming backward local."""
        self._it = _Iteration(self.plan, len(self.params), self.iteration, sync)
        if sync and self.find_unused:
            started = time.perf_counter()
            reached = _reachable_params(outputs)
            self._it.stats.find_unused_s = time.perf_counter() - started
            used_without_sync, self._used_without_sync = self._used_without_sync, set()
            for i, p in enumerate(self.params):
                if id(p) not in reached:
                    self._mark_ready(i, used=i in used_without_sync)

    # -- backward: hook, stage, launch -------------------------------------------------------
    def _make_hook(self, index: int):
        def hook(param: torch.Tensor) -> None:
            it = self._it
            if not it.sync:  # inside no_sync(), or a forward whose backward is not synchronised
                if self.find_unused:
                    self._used_without_sync.add(index)
                return
            if it.finalized:  # a gradient arrived after this iteration was already reduced
                self._raise_ready_twice(index)
            if not it.finalize_queued:
                it.finalize_queued = True
                it.stats.backward_start = self.clock()
                torch.autograd.Variable._execution_engine.queue_callback(self._finalize)
            if self._on_cuda and param.is_cuda:
                it.streams.add(torch.cuda.current_stream(param.device))
            self._mark_ready(index, used=True)

        return hook

    def _raise_ready_twice(self, i: int) -> None:
        raise RuntimeError(
            f"parameter {self.names[i]!r} was marked ready twice in one backward pass: its "
            "gradient hook fired again after its bucket was already counted. This happens with "
            "reentrant activation checkpointing (torch.utils.checkpoint(..., use_reentrant=True)) "
            "or when a parameter takes part in two backward passes of one forward (a second "
            "backward after backward(create_graph=True), say: torch DDP would leave that gradient "
            "unsynchronised on each rank). Use use_reentrant=False; for a gradient penalty, compute "
            "the inner gradient with torch.autograd.grad(..., create_graph=True) and call backward once."
        )

    def _mark_ready(self, i: int, used: bool) -> None:
        """Count parameter ``i``'s gradient as ready; once a bucket's are all ready, stage and launch
        it (under ZeRO each gradient is staged as it comes instead, so that it is freed at once)."""
        it = self._it
        if it.ready[i]:
            self._raise_ready_twice(i)
        it.ready[i] = True
        if not self.rebuilt:  # only the rebuild reads the order
            it.arrival_order.append(i)
        if self.track_completion:
            it.stats.ready_times.append((i, self.clock()))
        it.used[i] = used
        slot = self.plan.slots[i]
        if slot is None:  # a sparse gradient: all-reduced on its own once backward is done
            return
        b = slot.bucket
        it.pending[b] -= 1
        if self.shard_comm is not None:  # ZeRO: each gradient at once, so that it is freed at once
            self._stage(it, i, slot.position)
        else:
            it.arrived[b].append(i)
            if len(it.arrived[b]) >= STAGE_BATCH or it.pending[b] == 0:
                self._stage_batch(it, b)
        if it.pending[b] == 0:
            self._average_runs(b)
            self._launch_ready_buckets(it)

    def _stage_batch(self, it: _Iteration, b: int) -> None:
        """Stage the gradients of bucket ``b`` that arrived since its last batch (see :meth:`_stage`).

        The common case — flat-only slots, plain dense gradients — takes no Python per gradient:
        one ``torch._foreach_copy_`` into their views. They are averaged when the bucket is
        complete, by :meth:`_average_runs`."""
        batch, it.arrived[b] = it.arrived[b], []
        self._join_streams(it)
        grads = [self.params[i].grad for i in batch]
        if self._defer_copy and all(self._flat_only_param[i] for i in batch) and all(map(_copies_plainly, grads)):
            torch._foreach_copy_([self._slot_views[i] for i in batch], grads)
            return
        for i in batch:
            self._stage(it, i, self.plan.slots[i].position)
        if it.deferred[b]:
            deferred, it.deferred[b] = it.deferred[b], []
            views = self.flat[b].views
            torch._foreach_copy_([views[pos] for pos, _ in deferred], [grad for _, grad in deferred])

    def _average_runs(self, b: int) -> None:
        """Divide bucket ``b``'s flat runs by the world size, one kernel per run: the gradients
        :meth:`_stage_batch` copied in. The same bits as ``torch.mul(grad, 1/world_size, out=view)``
        per gradient (one multiplication each), for a dispatch per run instead of per gradient."""
        if self._defer_copy and self._scale != 1.0 and self._run_views[b]:
            torch._foreach_mul_(self._run_views[b], self._scale)

    def _stage(self, it: _Iteration, i: int, position: int) -> None:
        """Stage parameter ``i``'s gradient: averaged in place, or bound for its slot of the flat
        buffer. A plain gradient of a flat-only slot is left in ``it.deferred`` for
        :meth:`_stage_batch` to copy, and is averaged with its run."""
        b = self.plan.slots[i].bucket
        grad = self.params[i].grad
        if grad is not None and grad.requires_grad:  # backward(create_graph=True) (see _GraphedAverage)
            it.graph_grads[i] = grad if self._scale == 1.0 else grad * self._scale
            grad = grad.detach()
        if (
            self.plan.slots[i].in_place
            and it.used[i]
            and self.shares_storage is not None  # None: still learning (module doc)
            and i not in self.shares_storage
            and i not in it.graph_grads
            and _may_change_in_place(grad, self._flat_of(b).views[position])
        ):
            it.in_place[i] = grad if self._scale == 1.0 else grad.mul_(self._scale)
        elif self._defer_copy and self._flat_only_param[i] and grad is not None and grad.layout == torch.strided:
            it.deferred[b].append((position, grad))
        else:  # the flat buffer; an in-place slot's view stands in for a gradient we may not change
            self._stage_in_buffer(i, grad, self._flat_of(b).views[position])
            if self.shard_comm is not None:
                self.params[i].grad = None  # its bucket's reduce-scatter owns it now (module doc)

    def _flat_of(self, b: int) -> FlatBuffer:
        """Bucket ``b``'s flat buffer (ZeRO-2: laid over a reused buffer as its first gradient comes)."""
        flat = self.flat[b]
        if flat is None:
            bucket = self.plan.buckets[b]
            key = (bucket.dtype, bucket.device)
            buffer = self._take_buffer(key)
            self._lent[b] = (key, buffer)
            padded = buffer[: self.shard_layouts[b].padded_numel]
            padded[bucket.numel :].zero_()  # padding: reduced with its chunk, never kept
            flat = self.flat[b] = bucket_in(bucket, padded)
        return flat

    def _take_buffer(self, key: tuple) -> torch.Tensor:
        """A ZeRO-2 bucket buffer for ``key``: a spare one, else the oldest launched bucket's once its
        shard is kept, else a new one (see ``ZERO2_BUFFERS``)."""
        spare = self.spare_buffers.setdefault(key, [])
        if not spare and sum(k == key for k, _ in self._lent.values()) >= ZERO2_BUFFERS:
            launched = [b for b, (k, _) in self._lent.items() if k == key and self._it.work[b] is not None]
            if launched:
                b = min(launched)
                self._collect(b, self._it.work[b])
                self._keep_shard(b)
                self._it.kept[b] = True
        if spare:
            return spare.pop()
        dtype, device = key
        return torch.empty(self._buffer_numel[key], dtype=dtype, device=device)

    def _stage_in_buffer(self, i: int, grad: torch.Tensor | None, view: torch.Tensor) -> None:
        """Copy ``grad`` into its slot, averaged in the same pass (without a comm hook)."""
        if grad is None:
            view.zero_()
        elif grad.layout != torch.strided:
            raise RuntimeError(
                f"parameter {self.names[i]!r} got a {grad.layout} gradient, but DDP expected a dense "
                "one: only the parameters of nn.Embedding / nn.EmbeddingBag modules built with "
                "sparse=True are reduced as sparse gradients. Build that module with sparse=True, or "
                "make the gradient dense."
            )
        elif self.shard_comm is not None:  # divided, as the ring comm hook divides its buffer: the same bits
            torch.div(grad, self.world_size, out=view)
        elif grad.data_ptr() == view.data_ptr():  # gradient_as_bucket_view: it already lives there
            if self._scale != 1.0:
                view.mul_(self._scale)
        else:
            if self._scale == 1.0:
                view.copy_(grad)
            else:
                torch.mul(grad, self._scale, out=view)
            if self.as_view:
                self.params[i].grad = view

    def _join_streams(self, it: _Iteration) -> None:
        """CUDA: make the current stream wait for every stream this backward's gradients came on, so
        that a gradient produced on another stream is finished before it is copied or sent (module
        doc). Nothing to do with one stream: the hooks, and so the copies and launches, run on it."""
        if len(it.streams) > 1:
            current = torch.cuda.current_stream()
            for stream in it.streams:
                if stream != current:
                    current.wait_stream(stream)

    def _launch_ready_buckets(self, it: _Iteration) -> None:
        # Strictly in bucket order: every rank must issue the same collectives in the same order.
        self._join_streams(it)  # ZeRO and in-place slots stage or send gradients of other hooks
        while it.next_bucket < len(self.plan.buckets) and it.pending[it.next_bucket] == 0:
            b = it.next_bucket
            it.stats.launch_times[b] = self.clock()
            if b == self._sideband_bucket:
                self._post_sideband(it, b)  # into the buffer's tail, before it travels
            self.pg.label_next_collective(f"DDP bucket {b}")
            if self.shard_comm is not None:
                it.work[b] = self.shard_comm.reduce_scatter(self._flat_of(b).buffer, self.shard_layouts[b])
            elif self.comm_hook is not None:
                it.work[b] = self._call_hook(self._grad_bucket(b))
            else:  # already averaged while staging
                it.work[b] = [
                    self.pg.all_reduce(self._tensor_of(t, b, it), ReduceOp.SUM) for t in self.plan.buckets[b].transfers
                ]
            it.next_bucket += 1
            if b == len(self.plan.buckets) - 1 and self._sideband_size and self._sideband_bucket is None:
                self._post_sideband(it, None)  # its own small all-reduce, after the last bucket

    def _post_sideband(self, it: _Iteration, bucket: int | None) -> None:
        """This rank's sideband values (zeros outside a synchronised backward: join's shadow
        iterations), in ``bucket``'s tail or in an all-reduce of their own."""
        values = list(self._sideband_values()) if it.sync else [0.0] * self._sideband_size
        if len(values) != self._sideband_size:
            raise ValueError(f"the sideband gave {len(values)} values; register_sideband said {self._sideband_size}")
        if bucket is not None:
            it.sideband = self.flat[bucket].buffer[self.plan.buckets[bucket].numel :]
            it.sideband.copy_(torch.tensor(values, dtype=it.sideband.dtype))
        else:
            it.sideband = torch.tensor(values, dtype=torch.float64, device=self.pg.device)
            self.pg.label_next_collective("DDP sideband")
            it.sideband_work = self.pg.all_reduce(it.sideband, ReduceOp.SUM)

    def _tensor_of(self, transfer: Transfer, b: int, it: _Iteration) -> torch.Tensor:
        """The tensor one transfer of bucket ``b`` all-reduces this iteration."""
        flat = self.flat[b]
        if isinstance(transfer, FlatRun):  # the run that ends the bucket also carries a sideband tail
            stop = flat.buffer.numel() if transfer.stop == self.plan.buckets[b].numel else transfer.stop
            return flat.buffer[transfer.start : stop]
        i = self.plan.buckets[b].params[transfer.position]
        return it.in_place.get(i, flat.views[transfer.position]).view(-1)

    def _grad_bucket(self, b: int) -> GradBucket:
        params = [self.params[i] for i in self.plan.buckets[b].params]
        return GradBucket(b, self.flat[b], params, b == len(self.plan.buckets) - 1 and not self.sparse, self.pg)

    def _call_hook(self, bucket: GradBucket) -> torch.futures.Future:
        """The comm hook's future for ``bucket``, refusing anything else (torch's check and words)."""
        fut = self.comm_hook(self.comm_hook_state, bucket)
        if not isinstance(fut, torch._C.Future):
            hook = getattr(self.comm_hook, "__name__", repr(self.comm_hook))
            raise RuntimeError(
                "DDP communication hook's callback must return a torch.futures.Future object, but got "
                f"{type(fut).__module__}.{type(fut).__qualname__} from {hook} for bucket {bucket.index()}. "
                "Return pg.all_reduce(...).get_future(), or a torch.futures.Future you complete."
            )
        return fut

    # -- sparse gradients ---------------------------------------------------------------------
    def _reduce_sparse(self, zeros: bool = False) -> list[tuple[int, torch.Tensor, object]]:
        """Launch one all-reduce (or comm hook) per sparse gradient, in parameter order, once the
        buckets have all launched: the same collectives in the same order on every rank. A rank
        without that gradient (unused here, or ``zeros`` for join's shadow iterations) sends an
        empty one. Without a hook the gradient is divided first, as torch DDP does."""
        launched = []
        for k, i in enumerate(self._sparse_order):
            p = self.params[i]
            grad = None if zeros else p.grad
            if grad is None:
                grad = torch.sparse_coo_tensor(
                    torch.empty((1, 0), dtype=torch.int64, device=p.device),
                    torch.empty((0, *p.shape[1:]), dtype=p.dtype, device=p.device),
                    p.shape,
                    check_invariants=False,  # built valid here; saying so keeps torch from warning
                )
            elif grad.layout != torch.sparse_coo:
                raise RuntimeError(
                    f"parameter {self.names[i]!r} belongs to a module built with sparse=True but got a "
                    f"{grad.layout} gradient; DDP all-reduces it as a sparse COO tensor."
                )
            self.pg.label_next_collective(f"DDP sparse gradient {self.names[i]}")
            if self.comm_hook is not None:
                index, last = len(self.plan.buckets) + k, k == len(self._sparse_order) - 1
                work = self._call_hook(GradBucket(index, FlatBuffer(grad, (grad,)), [p], last, self.pg))
            else:
                work = self.pg.all_reduce(grad.div_(self.world_size), ReduceOp.SUM)
            launched.append((i, grad, work))
        return launched

    def _write_back_sparse(self, launched, unused: frozenset[int]) -> None:
        """Wait for the sparse all-reduces; each parameter's ``.grad`` becomes its average (a
        parameter no rank used keeps ``grad=None``)."""
        for i, grad, work in launched:
            result = _wait(work)
            if i not in unused:
                self.params[i].grad = result if isinstance(result, torch.Tensor) else grad

    # -- after backward: wait, write back ----------------------------------------------------
    def _finalize(self) -> None:
        """Runs once the autograd engine finished backward: wait, then write gradients back."""
        it = self._it
        it.stats.backward_end = self.clock()
        it.finalized = True
        if it.next_bucket < len(self.plan.buckets):  # some gradient never came: fail at the next forward
            for work in it.work[: it.next_bucket]:
                _wait(work)
            self._incomplete = [self.names[i] for i, ready in enumerate(it.ready) if not ready]
            return
        self._check_storage_sharing(it)
        unused = self._unused_everywhere(it)
        sparse = self._reduce_sparse() if self.sparse else ()
        if self.track_completion:
            it.stats.done_times = [it.stats.backward_end if _is_done(w) else None for w in it.work]
        for b in range(len(self.plan.buckets)):
            if it.kept[b]:
                continue  # ZeRO-2 took its shard already, to reuse its buffer
            self._collect(b, it.work[b])
            if self.track_completion and it.stats.done_times[b] is None:
                it.stats.done_times[b] = self.clock()  # after the (stream) wait: when its result is in
            if self.shard_comm is not None:
                self._keep_shard(b)
            else:
                self._write_back(b, it, unused)
        if sparse:
            self._write_back_sparse(sparse, unused)
        if it.sideband is not None:
            _wait(it.sideband_work)
            self.sideband = it.sideband.tolist()
        it.stats.finalize_end = end = self.clock()
        if isinstance(end, float):  # else a DeviceClock's event: its owner resolves it
            it.stats.finalize_wait_s = end - it.stats.backward_end
        it.stats.rebuilt_buckets = self.rebuilt
        self.last_stats = it.stats
        self.iteration += 1
        self._arrival_order = it.arrival_order
        self._rebuild_due = not self.rebuilt

    def _check_storage_sharing(self, it: _Iteration) -> None:
        """Learn which gradients share a storage (first backward), or check that none reduced in
        place did (later ones). Runs when every gradient of this backward exists."""
        if self.shares_storage is not None and not it.in_place:
            return  # nothing was changed in place: nothing to check (the common case of small models)
        owners: dict[int, list[int]] = {}
        for i, p in enumerate(self.params):
            if p.grad is not None and p.grad.layout == torch.strided:
                owners.setdefault(p.grad.untyped_storage().data_ptr(), []).append(i)
        shared = {i for group in owners.values() if len(group) > 1 for i in group}
        if self.as_view:  # every gradient is a view of its bucket's buffer, by design
            shared = set()
        if self.shares_storage is None:
            self.shares_storage = shared
            return
        clobbered = sorted(i for i in it.in_place if i in shared)
        if clobbered:
            names = ", ".join(self.names[i] for i in sorted(shared))
            raise RuntimeError(
                f"the gradients of {names} shared one buffer in this backward but not in the first "
                f"one, and {', '.join(self.names[i] for i in clobbered)} was averaged in place, so "
                "these gradients are wrong. The graph changed how autograd hands out gradients. "
                "Construct DistributedDataParallel(..., gradient_as_bucket_view=True) (no in-place "
                "reduction) for this model."
            )

    def _unused_everywhere(self, it: _Iteration) -> frozenset[int]:
        """Parameters no rank used (only with find_unused_parameters: one small all-reduce)."""
        if not self.find_unused:
            return frozenset()
        started = time.perf_counter()
        it.stats.unused_on_rank = it.used.count(False)
        used = torch.tensor(it.used, dtype=torch.int32, device=self.pg.device)
        self.pg.all_reduce(used, ReduceOp.SUM).wait()
        it.stats.find_unused_comm_s = time.perf_counter() - started
        it.stats.find_unused_s += it.stats.find_unused_comm_s
        return frozenset(i for i, n in enumerate(used.cpu().tolist()) if n == 0)

    def _keep_shard(self, b: int) -> None:
        """Keep this rank's chunk of bucket ``b``'s averaged gradients: ZeRO-2 copies it out and
        gives the bucket's buffer back for reuse; at ZeRO-1 ``shard_grads[b]`` is that chunk of the
        buffer already."""
        if self.zero_stage == 2:
            layout = self.shard_layouts[b]
            self.shard_grads[b].copy_(self.flat[b].buffer[layout.start : layout.stop])
            self.flat[b] = None
            key, buffer = self._lent.pop(b)
            spare = self.spare_buffers.setdefault(key, [])
            if len(spare) < ZERO2_BUFFERS:  # more were lent only while gradients came out of order
                spare.append(buffer)

    def _collect(self, b: int, work: object) -> None:
        """Wait for bucket ``b``; a comm hook's result lands in the flat buffer."""
        result = _wait(work)
        if self.shard_comm is not None:
            return  # the reduce-scatter wrote its chunk in place
        buffer = self.flat[b].buffer
        if isinstance(result, torch.Tensor) and result.data_ptr() != buffer.data_ptr():
            buffer.copy_(result.view_as(buffer))

    def _write_back(self, b: int, it: _Iteration, unused: frozenset[int]) -> None:
        """Give bucket ``b``'s parameters their averaged gradients from the flat buffer (existing
        ``.grad`` tensors are overwritten in one ``torch._foreach_copy_``)."""
        indices, views = self._flat_only[b]
        members = zip(self.plan.buckets[b].params, self.flat[b].views)
        if self._defer_copy and not unused and not it.graph_grads:  # the common case: one batched copy
            grads = [self.params[i].grad for i in indices]
            if all(g is not None for g in grads):
                if grads:
                    torch._foreach_copy_(grads, views)
                members = ((i, self.flat[b].views[pos]) for pos, i in self._in_place_slots[b])
        overwritten, averages = [], []
        for i, view in members:
            if i in it.in_place or i in unused:
                continue  # already averaged where it lies / unused on every rank: None stays None
            p = self.params[i]
            if i in it.graph_grads:
                with torch.enable_grad():
                    p.grad = _GraphedAverage.apply(it.graph_grads[i], view)
            elif self.as_view:
                if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                    p.grad = view
            elif p.grad is None:
                p.grad = view.clone()
            else:
                overwritten.append(p.grad)
                averages.append(view)
        if overwritten:
            torch._foreach_copy_(overwritten, averages)

    # -- join support ------------------------------------------------------------------------
    def shadow_iteration(self) -> None:
        """Issue the collectives of one synchronised backward with zero gradients (for join)."""
        if self.shard_comm is not None:
            raise RuntimeError(
                _SHARDED_REFUSES.format(what="join()", why="a joined rank would have to step its shard too")
            )
        it = _Iteration(self.plan, len(self.params), self.iteration, sync=False)
        it.pending = [0] * len(self.plan.buckets)
        for flat in self.flat:
            flat.buffer.zero_()  # in-place slots send their (zero) view: the same collectives
        self._launch_ready_buckets(it)
        self._unused_everywhere(it)
        for _, _, work in self._reduce_sparse(zeros=True):
            _wait(work)
        for work in (*it.work, it.sideband_work):
            _wait(work)
        self._rebuild_due = not self.rebuilt

    def remove_hooks(self) -> None:
        for h in self._hook_handles:
            h.remove()
        self._hook_handles = []


_HOOK_UNDER_ZERO = (
    "the buckets are reduce-scattered, not all-reduced (to send gradients in bf16 or fp16, as the "
    "compress hooks do, pass reduce_dtype=torch.bfloat16 or torch.float16 to ZeroOptimizer)"
)
_SHARDED_REFUSES = (
    "ZeRO (sharded gradients) does not work with {what}: {why}. Use plain DDP (zero stage 0) for that, or drop {what}."
)


def _may_change_in_place(grad: torch.Tensor | None, like: torch.Tensor) -> bool:
    """Whether ``grad`` may be averaged and reduced where it lies: a dense, contiguous tensor of the
    bucket's dtype and device that is the whole of its storage (that the storage is not another
    gradient's too is learnt per parameter: the module doc)."""
    return (
        grad is not None
        and grad.layout == torch.strided
        and not grad.requires_grad
        and grad.is_contiguous()
        and grad.dtype == like.dtype
        and grad.device == like.device
        and grad.storage_offset() == 0
        and grad.untyped_storage().nbytes() == grad.numel() * grad.element_size()
    )


class _GraphedAverage(torch.autograd.Function):
    """``backward(create_graph=True)``: the parameter's ``.grad`` holds the average over ranks,
    bit for bit as without a graph, and differentiating it reaches this rank's own gradient
    (scaled by ``1/world_size``) — what torch DDP's reducer leaves: the all-reduce itself is not
    differentiated, so higher-order terms are not synchronised (pytorch/pytorch#63812)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, average: torch.Tensor) -> torch.Tensor:
        return average.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _copies_plainly(grad: torch.Tensor | None) -> bool:
    """Whether ``grad`` goes into the flat buffer by a plain copy: dense, and outside any graph."""
    return grad is not None and grad.layout == torch.strided and not grad.requires_grad


def _is_done(work) -> bool:
    """Whether a bucket's Work / Future (or list of them) has completed, without waiting."""
    if isinstance(work, list):
        return all(_is_done(w) for w in work)
    if work is None:
        return True
    if isinstance(work, torch._C.Future):
        return work.done()
    return bool(work.is_completed())


def _wait(work):
    """Wait for a Work or a Future (or a list of them); return the reduced tensor if a future
    produced one."""
    if isinstance(work, list):
        for w in work:
            _wait(w)
        return None
    if work is None:
        return None
    # torch._C.Future, not torch.futures.Future: a future made by .then() is only the former
    if isinstance(work, torch._C.Future):
        value = work.wait()
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        return value
    work.wait()
    return None


def _reachable_params(outputs) -> set:
    """ids of the parameters whose AccumulateGrad node the autograd graph of ``outputs`` reaches."""
    roots = [t.grad_fn for t in _tensors_in(outputs) if t.grad_fn is not None]
    seen, reached, stack = set(), set(), roots
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        var = getattr(fn, "variable", None)
        if var is not None:
            reached.add(id(var))
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return reached


def _tensors_in(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors_in(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors_in(x)
