"""Predicted step times: the overlap of buckets with backward, and other world sizes and links.

The model of one synchronised backward: bucket ``i`` becomes ready when backward has produced
its share of the gradient bytes (buckets go in launch order, gradients arrive at an even rate
over ``backward_s``); its all-reduces start when it is ready and the previous one is done (one
stream, as the reducer's launches on one process group); each costs the ring's
``2(p-1)*alpha + 2(p-1)/p * n/B``. What runs past the end of backward is exposed.

A prediction keeps what the model does not explain (the measured exposed time minus the model's
exposed time at the measured world size) as a constant, so model and measurement agree at the
measured point by construction and only the change is predicted.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from .link import LinkModel


def ready_share(curve: Sequence[Sequence[float]], bytes_share: float) -> float:
    """The share of backward elapsed when ``bytes_share`` of the gradient bytes are ready, from a
    measured readiness curve (``(time share, bytes share)`` points); no curve: an even rate."""
    if not curve:
        return bytes_share
    for time_share, ready in curve:
        if ready >= bytes_share - 1e-12:
            return time_share
    return 1.0


def exposed_comm_s(
    bucket_sizes: Sequence[Sequence[int]],
    backward_s: float,
    link: LinkModel,
    world_size: int,
    curve: Sequence[Sequence[float]] = (),
) -> float:
    """Communication left after backward: buckets of all-reduces ``bucket_sizes`` (bytes, in launch
    order), each bucket ready when its bytes are (``curve``: when gradients were measured ready;
    layers that compute long but hold few bytes, like convolutions, make big early buckets)."""
    total = sum(sum(b) for b in bucket_sizes) or 1
    done_bytes, busy_until = 0, 0.0
    for sizes in bucket_sizes:
        done_bytes += sum(sizes)
        ready = backward_s * ready_share(curve, done_bytes / total)
        busy_until = max(busy_until, ready) + sum(link.allreduce_s(n, world_size) for n in sizes)
    return max(0.0, busy_until - backward_s)


def total_comm_s(bucket_sizes: Sequence[Sequence[int]], link: LinkModel, world_size: int) -> float:
    """All the all-reduces of one step back to back (no overlap)."""
    return sum(link.allreduce_s(n, world_size) for sizes in bucket_sizes for n in sizes)


def overlap_fraction(
    bucket_sizes, backward_s: float, exposed_s: float, link: LinkModel, world_size: int, curve=()
) -> float:
    """Where the measured exposed time lies between the overlap model (1) and no overlap (0).

    On a GPU the all-reduces run beside the kernels and the fraction is near 1; on CPU ranks
    compute and communication share the cores and it is near 0 (what is sent during backward
    slows backward down by as much)."""
    hidden = exposed_comm_s(bucket_sizes, backward_s, link, world_size, curve)
    serial = total_comm_s(bucket_sizes, link, world_size)
    if serial - hidden <= 1e-12:
        return 1.0
    return min(1.0, max(0.0, (serial - exposed_s) / (serial - hidden)))


def _scaled(link: LinkModel, time_factor: float) -> LinkModel:
    """``link`` with every all-reduce taking ``time_factor`` times as long."""
    return LinkModel(link.alpha_s * time_factor, link.bandwidth_Bps / time_factor)


MANY_COLLECTIVES = 8  # from this many all-reduces per step, excess time is charged per collective


@dataclass(frozen=True)
class StepModel:
    """A measured step, split into what scales with the ranks sharing cores and what is the link's.

    Attributes:
        step_s: the measured step.
        compute_s: data, forward, backward, optimizer and the rest: everything but communication
            and the wait for other ranks.
        backward_s: the part of ``compute_s`` that buckets can overlap with.
        exposed_s: the communication measured after backward (without waiting for stragglers).
        wait_s: the wait for the slowest rank, kept at other world sizes (a straggler stays one;
            ranks that share cores drift apart as much), scaled with the compute.
        ready_curve: when gradients became ready in backward (``measure.ready_curve``, median).
        stolen_s: communication time spent inside forward and backward (they ran that much
            slower than the probe's compute without communication): on CPU ranks the transport
            takes the cores compute needs, so nothing overlaps; the model is then serial and
            calibrated on ``exposed_s + stolen_s``.
        bucket_sizes: bytes of each all-reduce, per bucket in launch order.
        world_size, ranks_per_host, threads, cores: the measured job's shape.
        link: the link model, calibrated on this step by :meth:`calibrate`: what the measured
            exposed time has beyond the sweep's model is charged to each collective (from
            ``MANY_COLLECTIVES`` per step: Python and scheduling overhead per bucket on busy
            cores) or else to the bytes (a slower link than the sweep saw).
        overlap: :func:`overlap_fraction` of the measured step.
        per_collective_s: the calibrated cost of each all-reduce beyond the link model.
    """

    step_s: float
    compute_s: float
    backward_s: float
    exposed_s: float
    bucket_sizes: tuple[tuple[int, ...], ...]
    world_size: int
    ranks_per_host: int
    threads: int
    cores: int
    wait_s: float = 0.0
    stolen_s: float = 0.0
    ready_curve: tuple = ()
    link: LinkModel | None = None
    overlap: float = 1.0
    per_collective_s: float = 0.0

    def calibrate(self, link: LinkModel) -> StepModel:
        """This model with the overlap, link and per-collective cost the measurement shows: at the
        measured point it predicts the measured step."""
        if self.stolen_s > 0:
            f = 0.0
        else:
            f = overlap_fraction(
                self.bucket_sizes, self.backward_s, self.exposed_s, link, self.world_size, self.ready_curve
            )
        model = dataclasses.replace(self, link=link, overlap=f)
        measured = self.comm_s
        now = model.exposed_model_s(self.bucket_sizes, self.backward_s, link, self.world_size)
        excess = measured - now
        count = sum(len(b) for b in self.bucket_sizes)
        if abs(excess) < 1e-12 or self.world_size <= 1 or not count or now <= 0:
            return model
        if excess > 0 and count >= MANY_COLLECTIVES:
            return dataclasses.replace(model, per_collective_s=excess / count)

        # The exposed time is not linear in the link's speed where a bucket starts inside backward
        # (a faster link hides more of it), so the factor that reproduces the measurement is
        # searched for; the model grows with the factor, and a measurement it cannot reach (all
        # of it hidden at 1/1000 of the link's time) keeps the nearest end.
        def exposed_at(factor: float) -> float:
            return model.exposed_model_s(self.bucket_sizes, self.backward_s, _scaled(link, factor), self.world_size)

        low, high = math.log(1e-3), math.log(1e3)
        for _ in range(80):  # bisection in log space: 6e6 span / 2**80, far below float precision
            mid = (low + high) / 2
            low, high = (mid, high) if exposed_at(math.exp(mid)) < measured else (low, mid)
        return dataclasses.replace(model, link=_scaled(link, math.exp(high)))

    @property
    def comm_s(self) -> float:
        """The communication the measured step paid for: exposed after backward, and inside it."""
        return self.exposed_s + self.stolen_s

    def exposed_model_s(self, bucket_sizes, backward_s: float, link: LinkModel, world_size: int) -> float:
        """Modelled exposed communication: the overlap model where it overlaps, serial where not."""
        if world_size <= 1:
            return 0.0
        hidden = exposed_comm_s(bucket_sizes, backward_s, link, world_size, self.ready_curve)
        serial = total_comm_s(bucket_sizes, link, world_size)
        extra = self.per_collective_s * sum(len(b) for b in bucket_sizes)
        return self.overlap * hidden + (1 - self.overlap) * serial + extra

    def latency_and_bandwidth_s(self) -> tuple[float, float]:
        """This step's serial communication split: per-collective latency, and the bytes' time."""
        link, p = self.link, self.world_size
        count = sum(len(b) for b in self.bucket_sizes)
        latency = count * (2 * (p - 1) * link.alpha_s + self.per_collective_s)
        return latency, max(total_comm_s(self.bucket_sizes, link, p) - count * 2 * (p - 1) * link.alpha_s, 0.0)

    def cpu_factor(self, ranks_per_host: int) -> float:
        """How much slower compute gets with ``ranks_per_host`` ranks sharing a host's cores
        (relative to this run): threads beyond the cores take turns."""

        def load(ranks: int) -> float:
            return max(1.0, ranks * self.threads / max(self.cores, 1))

        return load(ranks_per_host) / load(self.ranks_per_host)

    def step_s_at(self, world_size: int, link: LinkModel | None = None, hosts: int = 0) -> float:
        """Predicted step at ``world_size`` ranks over ``link`` (default: the calibrated one) on
        ``hosts`` hosts (0: this run's ranks per host)."""
        per_host = math.ceil(world_size / hosts) if hosts else min(self.ranks_per_host, world_size)
        factor = self.cpu_factor(per_host)
        exposed = self.exposed_model_s(self.bucket_sizes, self.backward_s * factor, link or self.link, world_size)
        # Ranks that take turns on the cores take turns in their collectives too: a CPU transport
        # (gloo, MPI) copies and reduces on those cores, and each ring hop waits for a peer that
        # may not be running (2 -> 4 ranks on 2 cores: scaling the compute alone predicted 9.0 ms
        # against 12.7 measured).
        return (self.compute_s - self.stolen_s + self.wait_s + exposed) * factor

    def scaling(self, world_sizes: Sequence[int], link: LinkModel | None = None, hosts: int = 0) -> list[dict]:
        """``[{world_size, predicted_step_s, efficiency}]``; efficiency = one rank's step / this one
        (weak scaling: each rank keeps its batch)."""
        single = self.compute_s * self.cpu_factor(1)
        out = []
        for p in world_sizes:
            step = self.step_s_at(int(p), link, hosts)
            out.append({"world_size": int(p), "predicted_step_s": step, "efficiency": single / step if step else 1.0})
        return out

    def with_buckets(self, bucket_sizes: Sequence[Sequence[int]]) -> float:
        """Predicted step time with another bucket layout, on this job (stragglers' wait kept)."""
        now = self.exposed_model_s(self.bucket_sizes, self.backward_s, self.link, self.world_size)
        new = self.exposed_model_s(bucket_sizes, self.backward_s, self.link, self.world_size)
        return self.step_s + max(new - now, -self.comm_s)
