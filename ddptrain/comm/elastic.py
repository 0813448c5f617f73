"""Elastic membership: ranks that leave and join between steps, agreed through a store.

A job's membership is a sequence of *generations*. A generation is an ordered list of member ids;
a member's rank is its place in the list, and the generation's process group is built over the
store under ``gen/<n>/pg``. A generation ends when a member is lost (its process ends, a
collective fails or times out) or when newcomers wait to be admitted. The members then agree on
the next one, through the store alone:

1. each member still running says it has arrived (``gen/<n>/arrived/<id>``);
2. the first to arrive coordinates. It waits until every member of the last generation has
   either arrived or is known dead, admits the newcomers that registered meanwhile, and writes
   the new list (``gen/<n>``): the members that arrived in their old order, then the newcomers.
   Rank 0 is so the lowest surviving rank, and its duties move with the number;
3. everyone reads the list and builds the new group (:meth:`ElasticMembership.new_process_group`).

A member is known dead when it is fenced (``fenced/<id>``) or has said it left (``left/<id>``, on
:meth:`ElasticMembership.close`); when its process is gone, a zombie or
stopped (read from ``/proc`` where the coordinator shares its host and pid namespace; a stopped
one is killed, so that it cannot come back with stale state); or when its heartbeat
(``hb/<id>``, which a thread of each member rewrites every ``heartbeat_s``) has not changed for
``dead_after_s``. A member still alive that has not arrived after ``timeout_s`` is left out and
fenced too. A member left out of a generation raises :class:`Fenced`; it must exit, and a
launcher may start it again as a newcomer. A coordinator that dies before writing the list
(``gen/<n>/coordinated_by`` names it; it is known dead as any member is) is replaced: the others
stop waiting for ``gen/<n>`` and agree on ``n + 1``.

The store must outlive every member, rank 0 included: serve it with ``python -m ddptrain.store``.
What this module does not do is the training state: after a new generation, the caller makes the
members agree (which step, which weights), for instance with a broadcast from rank 0.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
import uuid
from dataclasses import dataclass

from .forensics import process_state
from .store import Store
from .types import CommError, CommTimeoutError

__all__ = ["ElasticMembership", "Generation", "Fenced", "JobFinished"]

_POLL_S = 0.005  # how often a waiting member looks at the store (a round trip costs ~0.1 ms on loopback)


class Fenced(CommError):
    """This member was left out of the job's membership (declared dead, or too late): it must exit."""


class JobFinished(CommError):
    """The job finished (:meth:`ElasticMembership.finish`) before this member was admitted: nothing is left to do."""


@dataclass(frozen=True)
class Generation:
    """One agreed membership: ``members[r]`` is rank ``r``. ``registered`` counts the members ever
    registered when it was decided; a registration beyond it is a newcomer waiting to be admitted."""

    number: int
    members: tuple[str, ...]
    registered: int

    @property
    def world_size(self) -> int:
        return len(self.members)

    def rank_of(self, member: str) -> int:
        return self.members.index(member)


def _this_host() -> str:
    """Who can read whose ``/proc``: the host name and this process's pid namespace."""
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        namespace = 0
    return f"{socket.gethostname()}/{namespace}"


class ElasticMembership:
    """This process's membership in an elastic job (see the module docstring).

    Args:
        store: the job's store, which outlives every member (``python -m ddptrain.store``).
        member_id: this member's unique id (default: host, pid and a random suffix).
        dead_after_s: a member whose heartbeat has not changed for this long is dead (members on
            another host; on this one, ``/proc`` tells at once).
        heartbeat_s: how often this member's heartbeat is rewritten.
        store_host: the store's host (default loopback): each generation's gloo group talks on the
            interface that routes to it, which members on other hosts can reach.
    """

    def __init__(
        self,
        store: Store,
        member_id: str | None = None,
        *,
        dead_after_s: float = 5.0,
        heartbeat_s: float = 0.1,
        store_host: str = "127.0.0.1",
    ):
        if dead_after_s <= 2 * heartbeat_s:
            raise ValueError(f"dead_after_s={dead_after_s} must exceed two heartbeats ({heartbeat_s} s each)")
        self.store = store.prefixed("elastic")
        self.id = member_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.dead_after_s = dead_after_s
        self.heartbeat_s = heartbeat_s
        self.store_host = store_host
        self.generation: Generation | None = None
        self._group = None  # the current generation's process group (new_process_group)
        self._host = _this_host()
        self._beats = 0
        self._closed = threading.Event()
        self._beat()  # before registering: a coordinator that sees the registration finds the heartbeat
        self._heart = threading.Thread(target=self._heartbeat, name="ddptrain-elastic-heartbeat", daemon=True)
        self._heart.start()
        index = self.store.add("members/count", 1)
        self.store.set(f"members/{index}", self.id)

    @classmethod
    def from_environment(cls, address: str | None = None, **options) -> ElasticMembership:
        """The membership of a worker of an elastic job: the store at ``address`` (``HOST:PORT``;
        default ``DDPTRAIN_ELASTIC_STORE``, which the local launcher sets), the id
        ``DDPTRAIN_ELASTIC_ID`` (default: a fresh one); ``options`` as for the constructor."""
        from .. import envvars
        from .store import connect

        address = address or envvars.get_str("DDPTRAIN_ELASTIC_STORE")
        if not address:
            raise CommError(
                "DDPTRAIN_ELASTIC_STORE is not set: an elastic worker needs its job's store as HOST:PORT "
                "(python -m ddptrain.store prints it; the elastic local launcher sets it)"
            )
        options.setdefault("store_host", address.rpartition(":")[0])
        return cls(connect(address), envvars.get_str("DDPTRAIN_ELASTIC_ID") or None, **options)

    # -- joining and regrouping ---------------------------------------------------------------
    def join(self, world_size: int, timeout_s: float) -> Generation:
        """Wait for a generation that includes this member. The first ``world_size`` members to
        register form generation 0 together; a later one (a restarted or added process) waits until
        the members regroup to admit it (they see it with :meth:`newcomers_waiting`).

        Raises:
            CommTimeoutError: no generation took this member in within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        if self.store.add("gen/0/coordinator", 1) == 1:
            self._form_first(world_size, deadline)
        number = 0
        while True:
            latest = int(self.store.get("latest", self._left(deadline, "join", world_size)))
            for n in range(number, latest + 1):
                # A number may have no record: its regroup was abandoned (the coordinator died) and
                # the members agreed on the next number instead.
                if not self.store.check([f"gen/{n}"]):
                    continue
                generation = self._read(n)
                if self.id in generation.members:
                    self.generation = generation
                    return generation
            number = max(number, latest + 1)
            self._wait_for_later_generation(number, deadline)

    def newcomers_waiting(self) -> bool:
        """Whether processes registered that the current generation did not admit (one store round
        trip: call it at step boundaries, on one rank, and share the answer). Some may be dead
        already: a regroup then admits none of them."""
        return self.store.add("members/count", 0) > self._current().registered

    def regroup(self, timeout_s: float, max_world_size: int | None = None) -> Generation:
        """Agree with the other members on the next generation: after a lost member (every member
        still running calls this), or to admit newcomers (every member calls this at the same
        step boundary). ``timeout_s``: how long a live member that has not arrived is waited for.
        ``max_world_size``: admit newcomers, in the order they registered, only up to this size;
        the others keep waiting (hot spares, taken in when a member is lost).

        Raises:
            Fenced: this member was left out (it arrived too late, or was declared dead).
        """
        from . import api

        if api.is_initialized():
            # Closing this member's connections first: a member still blocked in a collective with
            # this one fails at once, instead of after its timeout, and comes to regroup too.
            api.destroy_process_group()
        number = self._current().number + 1
        while True:
            self.store.set(f"gen/{number}/arrived/{self.id}", "1")
            if self.store.add(f"gen/{number}/coordinator", 1) == 1:
                self.store.set(f"gen/{number}/coordinated_by", self.id)
                self._coordinate(number, timeout_s, max_world_size)
            generation = self._await_decision(number, time.monotonic() + timeout_s + self.dead_after_s + 5.0)
            if generation is None:
                number += 1  # the coordinator died before deciding: the next number elects another
                continue
            if self.id not in generation.members:
                raise Fenced(
                    f"member {self.id} was left out of generation {number} (declared dead or too late to "
                    f"arrive); the job goes on with {generation.world_size} member(s). Exit; a launcher "
                    "may start this process again as a newcomer."
                )
            self.generation = generation
            return generation

    def new_process_group(self, backend: str = "gloo", timeout_s: float = 30.0):
        """Make the current generation's group the default process group (destroying the old one).

        Raises:
            CommTimeoutError: a member of the generation did not arrive (lost meanwhile: regroup).
        """
        from . import api

        generation = self._current()
        if api.is_initialized():
            api.destroy_process_group()
        self._wait_for_the_others(generation, time.monotonic() + timeout_s)
        group = api.init_process_group(
            backend,
            master_addr=self.store_host,
            store=self.store.prefixed(f"gen/{generation.number}/pg"),
            rank=generation.rank_of(self.id),
            world_size=generation.world_size,
            timeout=timeout_s,
        )
        group.abortable = True  # the heartbeat aborts it once the others start agreeing on the next one
        self._group = group
        return group

    def _wait_for_the_others(self, generation: Generation, deadline: float) -> None:
        """Wait until every member of ``generation`` is about to form its group. A member lost
        meanwhile (another host's launcher restarting all its workers, say) ends the wait at
        once, as a :class:`CommError`, instead of the group's rendezvous timing out."""
        key = f"gen/{generation.number}/forming"
        self.store.set(f"{key}/{self.id}", "1")
        seen: dict[str, tuple[bytes, float]] = {}
        while missing := [m for m in generation.members if not self.store.check([f"{key}/{m}"])]:
            lost = [m for m in missing if self._is_dead(m, seen)]
            if lost:
                raise CommError(
                    f"elastic job: member(s) {', '.join(lost)} of generation {generation.number} were lost "
                    "before its group formed; the others agree on the next"
                )
            if time.monotonic() > deadline:
                raise CommTimeoutError(
                    f"elastic job: member(s) {', '.join(missing)} of generation {generation.number} did not "
                    "come to form its group in time"
                )
            time.sleep(_POLL_S)

    def finish(self) -> None:
        """Say the job is over (one member, at the end): a member still waiting in :meth:`join` to
        be admitted raises :class:`JobFinished` instead of waiting for a generation that never comes."""
        self.store.set("finished", "1")

    def close(self) -> None:
        """Stop the heartbeat and say this member has left (the others then count it dead), and
        wait for its thread: a thread still inside a store call when the interpreter exits can
        abort the process (SIGABRT) after its work is done."""
        self._closed.set()
        if self._heart is not threading.current_thread():
            self._heart.join(timeout=5 * self.heartbeat_s + 1.0)
        try:  # said, so that the others need not wait dead_after_s to know (another host's view)
            self.store.set(f"left/{self.id}", "1")
        except Exception:  # noqa: BLE001 - the store is gone: the job has ended, nobody waits
            pass

    # -- the coordinator ----------------------------------------------------------------------
    def _form_first(self, world_size: int, deadline: float) -> None:
        while (count := self.store.add("members/count", 0)) < world_size:
            if time.monotonic() > deadline:
                raise CommTimeoutError(
                    f"elastic job: {count} of {world_size} members registered in time; start every member "
                    "with the same store address, or raise the timeout"
                )
            time.sleep(_POLL_S)
        members = [self.store.get(f"members/{i}").decode() for i in range(1, world_size + 1)]
        self._write(Generation(0, tuple(members), world_size))

    def _coordinate(self, number: int, timeout_s: float, max_world_size: int | None) -> None:
        previous = self._current()
        deadline = time.monotonic() + timeout_s
        seen: dict[str, tuple[bytes, float]] = {}  # heartbeat value and when it was first seen so
        arrived: list[str] = []
        dead: set[str] = set()
        while True:
            arrived = [m for m in previous.members if self.store.check([f"gen/{number}/arrived/{m}"])]
            dead = {m for m in previous.members if m not in arrived and self._is_dead(m, seen)}
            if len(arrived) + len(dead) == previous.world_size or time.monotonic() > deadline:
                break
            time.sleep(_POLL_S)
        for member in previous.members:
            if member not in arrived:
                self._fence(member)
        registered = self.store.add("members/count", 0)
        room = len(arrived) + registered if max_world_size is None else max_world_size
        admitted: list[str] = []
        for index in range(previous.registered + 1, registered + 1):
            newcomer = self.store.get(f"members/{index}").decode()
            if self._is_dead(newcomer, {}):
                continue
            if len(arrived) + len(admitted) >= room:
                registered = index - 1  # this one and those after it wait for a later generation
                break
            admitted.append(newcomer)
        self._write(Generation(number, tuple(arrived + admitted), registered))

    def _is_dead(self, member: str, seen: dict[str, tuple[bytes, float]]) -> bool:
        if self.store.check([f"fenced/{member}"]) or self.store.check([f"left/{member}"]):
            return True
        beat = self._heartbeat_of(member)
        if beat is None:
            return True
        value, local_pid = beat
        if local_pid is not None:
            return process_state(local_pid) in (None, "Z", "T", "t")
        first = seen.setdefault(member, (value, time.monotonic()))
        if first[0] != value:
            seen[member] = (value, time.monotonic())
            return False
        return time.monotonic() - first[1] > self.dead_after_s

    def _fence(self, member: str) -> None:
        """Mark ``member`` dead for good; kill it where this process can (a stopped process)."""
        self.store.set(f"fenced/{member}", "1")
        beat = self._heartbeat_of(member)
        if beat is not None and beat[1] is not None and process_state(beat[1]) in ("T", "t"):
            try:
                os.kill(beat[1], signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _heartbeat_of(self, member: str) -> tuple[bytes, int | None] | None:
        """``member``'s heartbeat record, and its pid where this process can see it in ``/proc``
        (same host and pid namespace); None if it never wrote one."""
        if not self.store.check([f"hb/{member}"]):
            return None
        value = self.store.get(f"hb/{member}")
        host, pid, _ = value.decode().rsplit(" ", 2)
        return value, int(pid) if host == self._host else None

    # -- the store's records --------------------------------------------------------------------
    def _write(self, generation: Generation) -> None:
        record = {"members": list(generation.members), "registered": generation.registered}
        self.store.set(f"gen/{generation.number}", json.dumps(record))
        self.store.set("latest", str(generation.number))

    def _await_decision(self, number: int, deadline: float) -> Generation | None:
        """Generation ``number`` once its coordinator has written it; None if the coordinator is
        known dead before that (or nothing is written by ``deadline``)."""
        seen: dict[str, tuple[bytes, float]] = {}
        while not self.store.check([f"gen/{number}"]):
            if self.store.check([f"gen/{number}/coordinated_by"]):
                coordinator = self.store.get(f"gen/{number}/coordinated_by").decode()
                if coordinator != self.id and self._is_dead(coordinator, seen):
                    return None
            if self._closed.is_set() or time.monotonic() > deadline:
                return None
            time.sleep(_POLL_S)
        return self._read(number)

    def _read(self, number: int) -> Generation:
        record = json.loads(self.store.get(f"gen/{number}"))
        return Generation(number, tuple(record["members"]), record["registered"])

    def _wait_for_later_generation(self, number: int, deadline: float) -> None:
        """Wait until a generation numbered ``number`` or later is written."""
        while int(self.store.get("latest")) < number:
            if self._closed.is_set() or time.monotonic() > deadline:
                raise CommTimeoutError(f"elastic job: member {self.id} waited in vain for a generation that admits it")
            if self.store.check(["finished"]):
                raise JobFinished(f"elastic job: it finished before member {self.id} was admitted")
            time.sleep(_POLL_S)

    def _left(self, deadline: float, what: str, world_size: int) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise CommTimeoutError(f"elastic job: member {self.id} could not {what} a job of {world_size}")
        return left

    def _current(self) -> Generation:
        if self.generation is None:
            raise CommError("this member has not joined the job yet: call join() first")
        return self.generation

    # -- the heartbeat ------------------------------------------------------------------------
    def _beat(self) -> None:
        self._beats += 1
        self.store.set(f"hb/{self.id}", f"{self._host} {os.getpid()} {self._beats}")

    def _heartbeat(self) -> None:
        """Rewrite the heartbeat; exit the process once fenced (it must not act on stale state)."""
        while not self._closed.wait(self.heartbeat_s):
            try:
                self._beat()
                if self.store.check([f"fenced/{self.id}"]):
                    os._exit(1)  # declared dead while stopped or cut off: the job has gone on without us
                self._abort_if_regrouping()
            except Exception:  # noqa: BLE001 - the store is gone: the job has ended
                return

    def _abort_if_regrouping(self) -> None:
        """A member that has started agreeing on the next generation has left the current group:
        a collective this member waits on in it can never finish. End the wait now (the caller
        then regroups too) instead of after the group's timeout."""
        group, generation = self._group, self.generation
        if group is None or generation is None or group.abort_reason is not None:
            return
        if self.store.check([f"gen/{generation.number + 1}/coordinator"]):
            group.abort(f"the members are agreeing on generation {generation.number + 1}; regroup")
