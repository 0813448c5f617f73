"""Elastic training (``trainer.elastic=true``): a fit that loses ranks and takes them back in place.

The membership is :mod:`ddptrain.comm.elastic`'s: a sequence of generations agreed through the
job's store, each with its own process group. This module is what the Trainer does around it.

A generation changes when a collective fails (a member died, hung or was aborted: ``CommError``)
or when rank 0 sees newcomers waiting at a step boundary (its vote rides in the step's
reduction). Every member of the new generation then runs the same sequence, so that their
collectives line up:

1. a survivor copies its training state in memory (the Checkpointer's, without the RNG gather)
   before anything is rebuilt. No step is half-applied: a failed step raised before its update;
2. the members agree on the generation (a survivor: :meth:`ElasticTraining.regroup`; a newcomer:
   :meth:`ElasticTraining.join`, which returns once the members admit it) and form its group;
3. the group-bound parts are built for the new ranks (the Trainer's ``setup`` on a newcomer, its
   ``bind_to_group`` on a survivor: the same collectives in the same order);
4. :meth:`ElasticTraining.agree_on_state`: the member with the most steps done (the lowest rank
   among them) sends its state to everyone, and everyone loads it. A step that only some
   members completed (the member died after sending its part) is so kept, and a step nobody
   completed is redone. Nothing is read from disk.

In invariant mode the step's shards do not depend on who computes them, so the run keeps the
bits of an uninterrupted one whatever the membership did. In normal mode the members present
share each global batch by position, each gradient weighted by its share
(:class:`.global_batch_steps.SharedBatchSteps`): the same samples per step, float sums in the
order the shares give.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import time
from typing import TYPE_CHECKING, Any, Protocol

from ..comm import CommError
from ..comm.elastic import ElasticMembership, Generation
from ..comm.objects import all_gather_object, broadcast_object
from ..comm.process_group import ProcessGroup
from ..config import Config
from ..launch.env import detect_environment
from ..launch.join import Membership, claim_device
from ..logs import follow_rank
from ..preflight import resolve_backend
from .view import LoopView

if TYPE_CHECKING:
    from .checkpoint import Checkpointer

__all__ = ["ElasticTraining", "MEMBERSHIP_CAUSES", "MembershipChange", "MembershipChangeDue", "TrainingStateLost"]

log = logging.getLogger("ddptrain.trainer")

_ASK_EVERY_S = 0.1
"""How often rank 0 asks the store whether newcomers wait (one round trip; admission waits at most this)."""


class MembershipChangeDue(Exception):
    """Raised at a step boundary when the members agreed to admit newcomers (the Trainer regroups)."""


MEMBERSHIP_CAUSES = (CommError, MembershipChangeDue)
"""What ends a generation: a collective that failed (a member died, hung or was aborted), or the
members' agreement to admit newcomers. An elastic job answers them with a membership change; a
job that is not elastic lets them through."""


class TrainingStateLost(RuntimeError):
    """Every member that held the training state is gone: the job cannot go on in place (not a
    ``CommError``: regrouping again cannot help)."""


@dataclasses.dataclass(frozen=True)
class MembershipChange:
    """One change of an elastic job's membership, as rank 0 of the new generation records it
    (``membership_changes`` in ``metrics.json``, and one log line)."""

    generation: int
    """The new generation's number."""
    step: int
    """Steps done when training went on: the next step is ``step + 1`` (redone if it was in flight)."""
    world_size_before: int
    world_size: int
    left: tuple[str, ...]
    """Member ids that are gone (``<slot>.<attempt>`` under the local launcher)."""
    joined: tuple[str, ...]
    reason: str
    """What ended the old generation: the failed collective's first line, or ``newcomers waiting``."""
    seconds_lost: float
    """From the start of the step in flight (a failure: its timeout included) or the vote to
    admit newcomers, until the state was agreed."""

    def describe(self) -> str:
        who = []
        if self.left:
            who.append(f"lost {', '.join(self.left)}")
        if self.joined:
            who.append(f"took in {', '.join(self.joined)}")
        return (
            f"elastic: generation {self.generation}: {' and '.join(who) or 'regrouped'}; "
            f"{self.world_size_before} -> {self.world_size} rank(s); training goes on after step {self.step} "
            f"({self.seconds_lost:.2f} s lost; why: {self.reason})"
        )


class Regrouping(LoopView, Protocol):
    """What a membership change uses of the loop: its view, its checkpointer, and a way to
    rebuild its group-bound parts (the Trainer's ``bind_to_group``)."""

    checkpointer: Checkpointer

    def bind_to_group(self, membership: Membership) -> None:
        """Rebuild what belongs to the old group (DDP, samplers, strategy...) for the new one."""


class ElasticTraining:
    """This process's part in an elastic fit: its membership, and the state handed over at changes.

    Args:
        config: the run's config (``dist.world_size``: the first generation's size;
            ``dist.timeout_s``: the groups' collective timeout and how long a live member that
            does not arrive at a regroup is waited for; ``dist.init_timeout_s``: how long a member
            waits to be admitted).
        membership: the job's membership (default: the store at ``dist.elastic_store``, else the
            local launcher's, :meth:`ElasticMembership.from_environment`).
    """

    def __init__(self, config: Config, membership: ElasticMembership | None = None):
        self.config = config
        self.membership = membership or ElasticMembership.from_environment(config.dist.elastic_store)
        self.changes: list[MembershipChange] = []
        self.joined_late = False
        """True for a member admitted into a running job (it gets the state from a peer)."""
        self._asked_at = 0.0
        self._joined: Membership | None = None  # this process's place, as join() found it

    @property
    def generation(self) -> Generation:
        return self.membership.generation

    def join(self) -> Membership:
        """Join the job: form the first generation with the others, or wait to be admitted into a
        running one; this process's :class:`~ddptrain.launch.join.Membership` in its group (its
        device and thread count picked as :func:`~ddptrain.launch.join.join_process_group` does)."""
        env = detect_environment()
        device = claim_device(env, self.config.trainer.device, self.config.dist.threads_per_worker or None)
        generation = self.membership.join(self.config.dist.world_size, timeout_s=self.config.dist.init_timeout_s)
        self.joined_late = generation.number > 0
        group = self._form_group()
        follow_rank(group.rank(), self.config.trainer.output_dir)  # this rank's stamp, from the first line
        log.info(
            "elastic: member %s (pid %d) joined generation %d as rank %d of %d",
            self.membership.id,
            os.getpid(),
            self.generation.number,
            group.rank(),
            group.size(),
        )
        self._joined = Membership(group, device, env, created=True)
        return self._joined

    def regroup(self, output_dir: str | os.PathLike) -> Membership:
        """Agree with the other members on the next generation and form its group (see the
        module docstring); this process's membership in it. Its log lines then carry the new rank
        (rank 0's go to ``output_dir``'s train.log). Raises ``Fenced`` when this member was left
        out: it must exit."""
        self.membership.regroup(timeout_s=self.config.dist.timeout_s, max_world_size=self.config.dist.world_size)
        group = self._form_group()
        follow_rank(group.rank(), output_dir)
        return dataclasses.replace(self._joined, process_group=group)

    def _form_group(self) -> ProcessGroup:
        while True:
            try:
                return self.membership.new_process_group(
                    resolve_backend(self.config), timeout_s=self.config.dist.timeout_s
                )
            except CommError:  # a member of the new generation was lost meanwhile: agree again
                self.membership.regroup(
                    timeout_s=self.config.dist.timeout_s, max_world_size=self.config.dist.world_size
                )

    def change_membership(self, loop: Regrouping, cause: BaseException, step_started: float) -> MembershipChange:
        """A survivor's side of a change (steps 1-4 of the module docstring): copy ``loop``'s state
        in memory, agree on the new generation, have the loop bind to its group, go on from the
        agreed state. The seconds lost count from ``step_started`` (the step in flight) after a
        failure, or from now when newcomers are admitted."""
        started = step_started if isinstance(cause, CommError) else time.monotonic()
        mine = self.with_membership(loop.checkpointer.state_dict(gather_rng=False))  # before any rebinding
        reason = str(cause).splitlines()[0][:200] if str(cause) else type(cause).__name__
        return self.go_on_from_agreed_state(loop, mine, started, reason, regroup=True)

    def go_on_from_agreed_state(
        self, loop: Regrouping, mine: dict[str, Any] | None, started: float, reason: str, regroup: bool
    ) -> MembershipChange:
        """Regroup (unless this member was just admitted, its group bound by the loop's set-up),
        have ``loop`` bind to the new group, load the agreed state. A member lost during the
        change itself (a ``CommError`` in the new group's collectives) ends that generation too:
        the members agree on the next one, as often as it takes. ``mine`` is a copy, so a
        rebinding cut short leaves it as it was; on a newcomer (None) the agreed state overwrites
        what it built."""
        while True:
            try:
                if regroup:
                    loop.bind_to_group(self.regroup(loop.output_dir))  # Fenced: left out, this member exits
                return self._take_state(loop, mine, started, reason)
            except CommError as exc:
                log.warning(
                    "elastic: generation %d broke up during the change (%s); agreeing on the next",
                    self.generation.number,
                    str(exc).splitlines()[0][:200],
                )
                regroup = True

    def _take_state(
        self, loop: Regrouping, mine: dict[str, Any] | None, started: float, reason: str
    ) -> MembershipChange:
        """Every member of a new generation: load the state the members agreed on (collective),
        record the change (in the history that came with the state)."""
        state, source = self.agree_on_state(loop.process_group, mine)
        loop.checkpointer.load_state_dict(state, f"<rank {source}'s memory>", allow_world_size_change=True)
        loop.metrics.start_window()  # a window of the old group's steps would be summed unevenly
        change = self.record(state, loop.state.step, reason, round(time.monotonic() - started, 3))
        if loop.is_main:
            log.warning("%s", change.describe())
        return change

    def admission_vote(self, is_main: bool) -> float:
        """Rank 0's vote to admit newcomers at this step boundary (1.0: some wait and the job is
        below ``dist.world_size``), asked of the store at most every ``_ASK_EVERY_S``; 0.0 on the
        other ranks."""
        now = time.monotonic()
        full = self.generation.world_size >= self.config.dist.world_size  # the others wait as hot spares
        if not is_main or full or now - self._asked_at < _ASK_EVERY_S:
            return 0.0
        self._asked_at = now
        return float(self.membership.newcomers_waiting())

    @staticmethod
    def agree_on_state(group: ProcessGroup, mine: dict[str, Any] | None) -> tuple[dict[str, Any], int]:
        """The state every member goes on from, and the rank that sent it (collective): the state
        of the member with the most steps done, the lowest rank among them. ``mine``: this
        member's in-memory state, ``None`` for a newcomer.

        Raises:
            TrainingStateLost: no member holds a state (every member that had one is gone).
            CommError: a member was lost during the hand-over.
        """
        steps = all_gather_object(group, -1 if mine is None else int(mine["step"]))
        most = max(steps)
        if most < 0:
            raise TrainingStateLost(
                "elastic job: every member that held the training state is gone, so there is nothing to go on "
                "from. Resume from the run's last checkpoint: python -m ddptrain ... trainer.resume=latest"
            )
        source = steps.index(most)
        return broadcast_object(group, mine if group.rank() == source else None, source), source

    def with_membership(self, state: dict[str, Any]) -> dict[str, Any]:
        """A copy of ``state`` (a survivor's, before a change) with the job's history: the members
        of the generation that ended and the changes so far, so that every member records the same.

        A copy: a state dict holds the live tensors, and rebinding to the new group overwrites the
        weights with rank 0's (DDP's construction), while the member with the most steps, whose
        state everyone loads, may be another rank.
        """
        members, changes = list(self.generation.members), [dataclasses.asdict(c) for c in self.changes]
        return copy.deepcopy({**state, "elastic": {"members": members, "changes": changes}})

    def record(self, state: dict[str, Any], step: int, reason: str, seconds_lost: float) -> MembershipChange:
        """Take the history that came with the agreed ``state`` (:meth:`with_membership`) and add
        the change to the current generation."""
        history = state["elastic"]
        before, generation = history["members"], self.generation
        change = MembershipChange(
            generation=generation.number,
            step=step,
            world_size_before=len(before),
            world_size=generation.world_size,
            left=tuple(m for m in before if m not in generation.members),
            joined=tuple(m for m in generation.members if m not in before),
            reason=reason,
            seconds_lost=seconds_lost,
        )
        self.changes = [
            MembershipChange(**{**c, "left": tuple(c["left"]), "joined": tuple(c["joined"])})
            for c in history["changes"]
        ]
        self.changes.append(change)
        return change

    def close(self) -> None:
        self.membership.close()
