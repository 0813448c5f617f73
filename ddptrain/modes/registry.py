"""The registry of training modes and features, and the one place their rules are applied.

A **mode** is one way of turning a step's micro-batches into a parameter update: plain DDP, ZeRO,
local SGD / DiLoCo, world-size-invariant shards, an elastic job's shared batches. Each is a
:class:`Mode`: when it applies, its step strategy class (``ddptrain.trainer.steps.StepStrategy``)
and its rules. One mode trains a run: the one that applies with the highest ``priority``; plain
DDP is the fallback: it applies to every config, at the lowest priority.

A **feature** is a setting with rules of its own that any mode may meet (the doctor, the bucket
autotuner, gradient compression, elastic membership): a :class:`Feature`. A mode is a feature
that also picks the step strategy.

Each rule is written once, by its owner:

- ``check``: the owner's own rules (invariant mode: the world size divides the virtual ranks), run
  for every config, so that an owner may also refuse its keys set while it is off;
- ``refuses``: other settings the owner cannot be combined with, each with why;
- ``needs`` / ``lacks``: capabilities. A feature that needs one (the doctor needs bucket
  collectives to measure) and an active owner that lacks it (invariant mode sends none) are
  refused together, with both reasons, and neither names the other;
- two modes that apply to one config, and that no ``refuses`` rule tells apart, are refused:
  a run has one step strategy, unless the higher one declares that its strategy does the other's
  job too (``composes_with``).

Every refusal is a :class:`~ddptrain.config.ConfigError` that names both settings, why, and both
ways out. This module and the built-in declarations (:mod:`.builtin`) import no torch: the command
line checks a config before any process imports it. A mode registered by a user (``register``)
names its strategy class directly; the built-in ones by import path, imported when picked.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from ..config import Config, ConfigError
from ..objects import locate

__all__ = [
    "Refusal",
    "Feature",
    "Mode",
    "register",
    "registered",
    "mode_of",
    "check_config",
    "features",
    "refuse",
    "shares_unevenly",
]


@dataclass(frozen=True)
class Refusal:
    """A setting an owner cannot be combined with.

    Attributes:
        on: whether ``config`` has that setting.
        what: the setting as the user wrote it (``"dist.find_unused_parameters=true"``), or a
            function of the config that says it.
        why: why the two cannot be combined, in a few words (no final full stop).
    """

    on: Callable[[Config], bool]
    what: str | Callable[[Config], str]
    why: str | Callable[[Config, int], str]

    def describe(self, config: Config, world_size: int) -> tuple[str, str]:
        what = self.what(config) if callable(self.what) else self.what
        why = self.why(config, world_size) if callable(self.why) else self.why
        return what, why


@dataclass(frozen=True)
class Feature:
    """A setting with rules of its own (see the module docstring).

    Attributes:
        name: a short unique name (``"doctor"``).
        active: whether ``config`` turns it on.
        setting: how the config turned it on, as the user wrote it (``"trainer.doctor=true"``).
        way_back: how to turn it off, as a user would (``"set trainer.doctor=false"``).
        check: its own rules, given the config and the job's world size; run for every config.
        refuses: settings it cannot be combined with, when active.
        needs: capability -> why this feature needs it (``"the doctor measures..."``).
        lacks: capability -> why this feature, when active, does not offer it.
        uneven_shares: when active, the ranks take shares of each global batch of different sizes
            (cut by position), so the world size need not divide the global batch.
    """

    name: str
    active: Callable[[Config], bool]
    setting: Callable[[Config], str]
    way_back: str
    check: Callable[[Config, int], None] | None = None
    refuses: Sequence[Refusal] = ()
    needs: Mapping[str, str] = field(default_factory=dict)
    lacks: Mapping[str, str] = field(default_factory=dict)
    uneven_shares: bool = False


@dataclass(frozen=True)
class Mode(Feature):
    """A feature that picks the step strategy (see the module docstring).

    Attributes:
        strategy: the ``StepStrategy`` subclass, or its import path ``"package.module:Class"``;
            built as ``strategy(loop, votes)`` (``ddptrain.trainer.steps.StepStrategy``).
        priority: when several modes apply, the highest wins (two that no ``refuses`` rule tells
            apart are refused before that).
        fallback: the mode of every config that asks for no other (plain DDP); it meets the
            others without a conflict.
        whole_global_batches: the strategy walks each epoch by global batch, whatever the world
            size (the epoch's step count is then its number of global batches).
        same_bits_at_any_world_size: training takes the same bits at every world size, so a
            checkpoint resumes exactly at another one (no ``trainer.allow_world_size_change``).
        composes_with: names of lower-priority modes whose job this mode's strategy does too
            (shared batches take ZeRO's update): the two apply together, and the other's rules
            still hold.
    """

    strategy: str | type = ""
    priority: int = 0
    fallback: bool = False
    whole_global_batches: bool = False
    same_bits_at_any_world_size: bool = False
    composes_with: frozenset[str] = frozenset()

    def strategy_class(self) -> type:
        """The strategy class (imported now when given by path)."""
        if not isinstance(self.strategy, str):
            return self.strategy
        return locate(self.strategy.replace(":", "."), f"the strategy of mode {self.name}")


_FEATURES: list[Feature] = []  # in registration order: the order in which rules are checked


def register(feature: Feature) -> Feature:
    """Add a mode or feature; its rules apply to every config checked from now on.

    Raises:
        ValueError: a mode or feature of that name is registered already.
    """
    if any(f.name == feature.name for f in _FEATURES):
        raise ValueError(f"a mode or feature named {feature.name!r} is registered already")
    _FEATURES.append(feature)
    return feature


@contextlib.contextmanager
def registered(feature: Feature) -> Iterator[Feature]:
    """``feature`` registered for the block only (tests, experiments)."""
    register(feature)
    try:
        yield feature
    finally:
        _FEATURES.remove(feature)


def features() -> list[Feature]:
    """Every registered mode and feature, in the order their rules are checked."""
    return list(_FEATURES)


def shares_unevenly(config: Config) -> bool:
    """Whether an active mode or feature cuts each global batch into shares of different sizes."""
    return any(f.uneven_shares and f.active(config) for f in _FEATURES)


def mode_of(config: Config) -> Mode:
    """The mode that trains ``config``: of those that apply, the one of highest priority."""
    modes = [f for f in _FEATURES if isinstance(f, Mode) and f.active(config)]
    return max(modes, key=lambda m: m.priority)  # the fallback (plain DDP) applies to every config


def check_config(config: Config, world_size: int) -> None:
    """Apply every registered rule to ``config`` for a job of ``world_size`` ranks.

    Raises:
        ConfigError: the first rule broken, naming the settings, why, and the ways out.
    """
    active = [f for f in _FEATURES if f.active(config)]
    for feature in _FEATURES:
        if feature.check is not None:
            feature.check(config, world_size)
    for feature in active:
        for refusal in feature.refuses:
            if refusal.on(config):
                what, why = refusal.describe(config, world_size)
                refuse(feature.setting(config), what, why, feature.way_back)
    for lacking in active:
        for needing in active:
            for capability, need in needing.needs.items():
                if needing is not lacking and capability in lacking.lacks:
                    why = f"{need}, and {lacking.lacks[capability]}"
                    refuse(lacking.setting(config), needing.setting(config), why, lacking.way_back)
    modes = sorted((f for f in active if isinstance(f, Mode) and not f.fallback), key=lambda m: -m.priority)
    for first, second in itertools.combinations(modes, 2):
        if second.name in first.composes_with:
            continue
        raise ConfigError(
            f"{first.setting(config)} and {second.setting(config)} each pick how a step trains "
            f"({_strategy_name(first)} and {_strategy_name(second)}), and a run has one: "
            f"{first.way_back}, or {second.way_back}."
        )


def _strategy_name(mode: Mode) -> str:
    return mode.strategy.rpartition(":")[2] if isinstance(mode.strategy, str) else mode.strategy.__name__


def refuse(setting: str, what: str, why: str, way_back: str) -> None:
    """Raise the ConfigError of every refusal: ``setting`` cannot be combined with ``what``
    because ``why``; drop ``what``, or ``way_back``."""
    raise ConfigError(f"{setting} cannot be combined with {what}: {why}. Drop {what.split('=')[0]}, or {way_back}.")
