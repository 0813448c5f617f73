"""ddptrain's own modes and features, each with its rules (the mechanics: :mod:`.registry`).

One declaration per owner, in the order their rules are checked: the modes first (their errors
name the rule a mode adds), then the features that any mode may meet. Capabilities a feature
needs and an owner may lack:

- ``bucket_collectives``: the gradients travel in DDP's buckets in every step's backward;
- ``bucket_all_reduces``: ... and as all-reduces (ZeRO reduce-scatters them);
- ``full_precision_gradients``: the gradients travel in their own precision;
- ``fixed_group``: the group of ranks stays the same for the whole fit.

Torch-free: the command line checks a config with these before any process imports torch.
"""

from __future__ import annotations

from ..config import Config, ConfigError, check_precision
from .registry import Feature, Mode, Refusal, refuse, register

__all__ = ["PLAIN", "INVARIANT", "ZERO", "LOCAL_STEPS", "ELASTIC", "SHARED_BATCHES", "check_virtual_ranks"]

# == modes =========================================================================================


def check_virtual_ranks(config: Config, world_size: int) -> None:
    """World-size-invariant mode's own rule: the world size divides ``trainer.virtual_ranks``
    (an elastic job spreads them over whoever is present instead)."""
    t = config.trainer
    if t.world_size_invariant and not t.elastic and t.virtual_ranks % world_size:
        valid = [w for w in range(1, t.virtual_ranks + 1) if t.virtual_ranks % w == 0]
        raise ConfigError(
            f"trainer.world_size_invariant=true: the world size must divide trainer.virtual_ranks (W must "
            f"divide V), got dist.world_size={world_size} and trainer.virtual_ranks={t.virtual_ranks}. "
            f"Use dist.world_size in {valid}, or set trainer.virtual_ranks to a multiple of {world_size}"
        )


_OUTSIDE_BUCKETS = "invariant mode sums the gradients exactly outside DDP's buckets (one exact sum per step)"

INVARIANT = register(
    Mode(
        name="world_size_invariant",
        active=lambda c: c.trainer.world_size_invariant,
        setting=lambda c: "trainer.world_size_invariant=true",
        way_back="set trainer.world_size_invariant=false",
        check=check_virtual_ranks,
        refuses=[
            Refusal(
                lambda c: c.data.drop_last,
                "data.drop_last=true",
                "it takes every sample once (the last global batch may be short)",
            ),
            Refusal(
                lambda c: c.dist.zero_stage == 2,
                "dist.zero_stage=2",
                "every rank holds the whole exact gradient, so there are no gradient buckets to shard "
                "(dist.zero_stage=1 shards the optimizer state, bit for bit)",
            ),
        ],
        needs={
            "full_precision_gradients": "invariant mode sums exact integer gradients, which half precision would round"
        },
        lacks={"bucket_collectives": _OUTSIDE_BUCKETS, "bucket_all_reduces": _OUTSIDE_BUCKETS},
        strategy="ddptrain.trainer.invariant:InvariantSteps",
        priority=40,
        whole_global_batches=True,
        same_bits_at_any_world_size=True,
    )
)


def _check_sharded_checkpoints(config: Config, world_size: int) -> None:
    """``trainer.checkpoint.sharded`` is ZeRO's: without it there is no shard to write."""
    if config.trainer.checkpoint.sharded and not config.dist.zero_stage:
        raise ConfigError(
            "trainer.checkpoint.sharded=true writes each rank's shard of a ZeRO optimizer's state, and "
            "dist.zero_stage=0 has none (every rank holds the whole state): set dist.zero_stage=1 or 2, "
            "or drop trainer.checkpoint.sharded"
        )


ZERO = register(
    Mode(
        name="zero",
        # In invariant mode its strategy shards the optimizer over whole gradients itself (stage 1).
        active=lambda c: bool(c.dist.zero_stage) and not c.trainer.world_size_invariant,
        setting=lambda c: f"dist.zero_stage={c.dist.zero_stage}",
        way_back="train with dist.zero_stage=0",
        check=_check_sharded_checkpoints,
        refuses=[
            Refusal(
                lambda c: c.dist.find_unused_parameters,
                "dist.find_unused_parameters=true",
                "a parameter without a gradient would still be stepped (with a zero gradient) in its shard, "
                "while plain DDP skips it",
            ),
            Refusal(
                lambda c: c.dist.gradient_as_bucket_view,
                "dist.gradient_as_bucket_view=true",
                "ZeRO keeps no full-size gradient for .grad to be a view of",
            ),
            Refusal(
                lambda c: check_precision(c.trainer.precision, c.trainer.device) == "16-mixed",
                "trainer.precision=16-mixed",
                "its gradient scaler unscales and checks for inf in the optimizer's .grad, and under ZeRO "
                "each rank holds only its shard's gradients (use trainer.precision=bf16-mixed)",
            ),
        ],
        lacks={"bucket_all_reduces": "ZeRO reduce-scatters them instead"},
        strategy="ddptrain.trainer.zero_steps:ZeroSteps",
        priority=10,
    )
)

_NO_REDUCTION = "local steps reduce no gradient in backward (the ranks meet only at outer steps)"

LOCAL_STEPS = register(
    Mode(
        name="local_steps",
        active=lambda c: c.dist.sync != "every_step",
        setting=lambda c: f"dist.sync={c.dist.sync}",
        way_back="set dist.sync=every_step",
        refuses=[
            Refusal(
                lambda c: c.trainer.world_size_invariant,
                "trainer.world_size_invariant=true",
                "invariant mode sums every step's gradients exactly over the ranks, and local steps sum none",
            ),
            Refusal(
                lambda c: bool(c.dist.zero_stage),
                lambda c: f"dist.zero_stage={c.dist.zero_stage}",
                "ZeRO shards the optimizer of one shared model, and local steps keep one model and optimizer per rank",
            ),
            Refusal(
                lambda c: c.trainer.ema.decay is not None,
                "trainer.ema.decay",
                "the moving average would follow one rank's local copy, not the model the ranks agree on",
            ),
            Refusal(
                lambda c: (
                    bool(c.trainer.check_sync_every_n_steps)
                    and c.trainer.check_sync_every_n_steps % c.dist.sync_every != 0
                ),
                lambda c: f"trainer.check_sync_every_n_steps={c.trainer.check_sync_every_n_steps}",
                lambda c, _: (
                    f"the ranks' models agree only after an outer step (every dist.sync_every="
                    f"{c.dist.sync_every} steps); use a multiple of it"
                ),
            ),
        ],
        lacks={"bucket_collectives": _NO_REDUCTION, "bucket_all_reduces": _NO_REDUCTION},
        strategy="ddptrain.trainer.local_steps:LocalSteps",
        priority=20,
    )
)


def _check_elastic(config: Config, world_size: int) -> None:
    """The elastic keys apply to elastic jobs only; an elastic job starts with enough ranks."""
    t, d = config.trainer, config.dist
    if not t.elastic:
        for key, value, unset in (
            ("dist.min_world_size", d.min_world_size, 1),
            ("launcher.spares", config.launcher.spares, 0),
            ("dist.elastic_store", d.elastic_store, None),
        ):
            if value != unset:
                raise ConfigError(
                    f"{key}={value} applies to elastic jobs only (a job that is not elastic stops at its first "
                    f"lost rank): set trainer.elastic=true, or drop {key}"
                )
    elif d.min_world_size > world_size:
        refuse(
            "trainer.elastic=true",
            f"dist.min_world_size={d.min_world_size}",
            f"the job starts with {world_size} rank(s), fewer than that; use at most dist.min_world_size={world_size}",
            ELASTIC.way_back,
        )


ELASTIC_REFUSES_MPI = "an MPI job cannot lose a process: MPI ends the whole job when one rank dies"
"""Why an elastic job cannot run over MPI: here for ``dist.backend=mpi``, in the runner for mpirun."""

ELASTIC = register(
    Feature(
        name="elastic",
        active=lambda c: c.trainer.elastic,
        setting=lambda c: "trainer.elastic=true",
        way_back="set trainer.elastic=false",
        check=_check_elastic,
        refuses=[
            Refusal(lambda c: c.dist.backend == "mpi", "dist.backend=mpi", ELASTIC_REFUSES_MPI),
            Refusal(
                lambda c: c.trainer.smoke_check,
                "trainer.smoke_check=true",
                "its loss probe starts on the ranks present at the start, and a member that joins later has none",
            ),
            Refusal(
                lambda c: bool(c.dist.zero_stage),
                lambda c: f"dist.zero_stage={c.dist.zero_stage}",
                "each rank holds the only copy of its shard of the optimizer state, and a lost rank takes it along",
            ),
            Refusal(
                lambda c: c.dist.sync != "every_step",
                lambda c: f"dist.sync={c.dist.sync}",
                "the ranks' copies of the model differ between outer steps, and a lost rank takes its local "
                "steps along: the survivors hold no common state to redo them from",
            ),
            Refusal(
                lambda c: c.data.drop_last,
                "data.drop_last=true",
                "the members present share each global batch by sample position and take every sample once "
                "(the epoch's last step may be short)",
            ),
        ],
        lacks={"fixed_group": "an elastic job's group of ranks changes with its membership"},
        uneven_shares=True,  # the members present share each global batch by position
    )
)


def _balanced(config: Config) -> bool:
    return config.trainer.balance.shares != "off"


def _check_balance(config: Config, world_size: int) -> None:
    """``trainer.balance``: one weight per rank, and a cap the shares can add up under."""
    balance = config.trainer.balance
    if isinstance(balance.shares, (list, tuple)) and len(balance.shares) != world_size:
        raise ConfigError(
            f"trainer.balance.shares={list(balance.shares)} names {len(balance.shares)} weight(s), and the job has "
            f"{world_size} rank(s) (dist.world_size={world_size}): give one weight per rank, or "
            "trainer.balance.shares=auto"
        )
    if balance.max_share is not None and balance.max_share * world_size < 1 - 1e-9:
        raise ConfigError(
            f"trainer.balance.max_share={balance.max_share} is below the fair share of {world_size} rank(s), "
            f"1/{world_size} = {1 / world_size:.4g}: the shares could not add up to a whole batch. Set it to at "
            f"least {1 / world_size:.4g}, or null for no cap"
        )


BALANCE = register(
    Feature(
        name="balance",
        active=_balanced,
        setting=lambda c: f"trainer.balance.shares={c.trainer.balance.shares}",
        way_back="set trainer.balance.shares=off",
        check=_check_balance,
        refuses=[
            Refusal(
                lambda c: c.dist.sync != "every_step",
                lambda c: f"dist.sync={c.dist.sync}",
                "local steps give every rank whole batches of its own between outer steps",
            ),
            Refusal(
                lambda c: c.trainer.elastic and isinstance(c.trainer.balance.shares, (list, tuple)),
                "trainer.elastic=true",
                "a list names one weight per rank, and an elastic job's ranks change (trainer.balance.shares=auto "
                "re-decides after each change)",
            ),
        ],
    )
)

SHARED_BATCHES = register(
    Mode(
        name="shared_batches",
        # invariant mode spreads its own shards
        active=lambda c: (c.trainer.elastic or _balanced(c)) and not c.trainer.world_size_invariant,
        setting=lambda c: "trainer.elastic=true" if c.trainer.elastic else "trainer.balance.shares",
        way_back="set trainer.elastic=false and trainer.balance.shares=off",
        strategy="ddptrain.trainer.global_batch_steps:SharedBatchSteps",
        priority=30,
        whole_global_batches=True,
        # with dist.zero_stage its steps take ZeRO's update: the shares cut samples, ZeRO's shards
        # cut parameters (an elastic job refuses ZeRO on its own account)
        composes_with=frozenset({"zero"}),
        uneven_shares=True,  # one share per rank, sized by trainer.balance's weights
    )
)

PLAIN = register(
    Mode(
        name="plain",
        active=lambda c: True,
        setting=lambda c: "plain DDP",
        way_back="",
        strategy="ddptrain.trainer.steps:DataParallelSteps",
        priority=0,
        fallback=True,
    )
)

# == features that any mode may meet ===============================================================

register(
    Feature(
        name="grad_compression",
        active=lambda c: c.dist.grad_compression != "none",
        setting=lambda c: f"dist.grad_compression={c.dist.grad_compression}",
        way_back="set dist.grad_compression=none",
        refuses=[
            Refusal(
                lambda c: c.dist.algorithm == "ring" and not c.dist.zero_stage and c.dist.sync == "every_step",
                "dist.algorithm=ring",
                "plain DDP sends its buckets either through the ring or through the compression hook, not "
                "both (under ZeRO, dist.zero_stage=1|2, the ring reduce-scatter does compress, and so does "
                "the outer step of dist.sync=local_sgd|diloco)",
            ),
        ],
        lacks={"full_precision_gradients": "dist.grad_compression sends the gradients in half precision"},
    )
)

register(
    Feature(
        name="async_checkpoints",
        active=lambda c: c.trainer.checkpoint.async_save,
        setting=lambda c: "trainer.checkpoint.async_save=true",
        way_back="set trainer.checkpoint.async_save=false",
        refuses=[
            Refusal(
                lambda c: c.trainer.checkpoint.sharded,
                "trainer.checkpoint.sharded=true",
                "every rank's shard must be on disk before rank 0's file appears, which takes a collective "
                "after the writes, and a background write cannot join one",
            ),
        ],
    )
)

register(
    Feature(
        name="dcp_checkpoints",
        active=lambda c: c.trainer.checkpoint.format == "dcp",
        setting=lambda c: "trainer.checkpoint.format=dcp",
        way_back="set trainer.checkpoint.format=torch",
        needs={
            "fixed_group": "every rank writes its part of a DCP checkpoint, so a rank lost during a save would "
            "leave it incomplete (the torch format is written by rank 0 alone)"
        },
    )
)

register(
    Feature(
        name="doctor",
        active=lambda c: c.trainer.doctor,
        setting=lambda c: "trainer.doctor=true",
        way_back="set trainer.doctor=false",
        needs={
            "bucket_collectives": "the doctor measures and predicts DDP's bucket collectives of every step",
            "full_precision_gradients": "the doctor's model of a step predicts full-precision all-reduces",
        },
    )
)

register(
    Feature(
        name="bucket_autotune",
        active=lambda c: c.dist.bucket_cap_mb == "auto",
        setting=lambda c: "dist.bucket_cap_mb=auto",
        way_back="give dist.bucket_cap_mb a size in MiB",
        needs={
            "bucket_all_reduces": "the autotuner times DDP's bucket all-reduces in the first steps",
            "fixed_group": "its measurements span steps of one fixed group of ranks",
        },
    )
)

register(
    Feature(
        name="lr_find",
        active=lambda c: c.trainer.lr_find,
        setting=lambda c: "trainer.lr_find=true",
        way_back="set trainer.lr_find=false",
        needs={"fixed_group": "its measurements span steps of one fixed group of ranks"},
    )
)
