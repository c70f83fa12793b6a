"""Routing policies: which replica a request goes to when it arrives.

Every policy sees what a router can know at that moment: each replica's outstanding requests,
its expected wait, and (prefix-aware ones) how many of the request's leading blocks its cache
holds. Ties go to the tied replica at position ``arrival order mod ties``, so equal replicas
share requests in trace order and every run is reproducible.

- ``round_robin``: replica ``arrival order mod N``.
- ``least_queue``: fewest outstanding requests.
- ``prefix_affinity``: most cached leading blocks, then fewest outstanding; with the load guard
  of SGLang's and vLLM's cache-aware routers: when the busiest replica has more than
  ``balance_abs`` outstanding requests over the idlest and more than ``balance_rel`` times as
  many, the request goes to the least loaded instead (without the guard, a trace whose requests
  all share their first block sends everything to one replica).
- ``cost_aware``: least expected wait plus remaining prefill ``C(n) - C(h)`` there, the rule of
  the articles (a cached prefix is worth a queue only while the prefill it saves exceeds the
  extra wait, :func:`kvlens.definitions.cache_route_pays`). The expected wait of a replica is
  the rest of its current prefill and the prefills this policy expected of those waiting there
  (``Job.estimate``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

from kvlens.definitions import cache_route_pays
from kvlens.simulate.replica import Job, Replica

ROUND_ROBIN: Final = "round_robin"
LEAST_QUEUE: Final = "least_queue"
PREFIX_AFFINITY: Final = "prefix_affinity"
COST_AWARE: Final = "cost_aware"
POLICIES: Final = (ROUND_ROBIN, LEAST_QUEUE, PREFIX_AFFINITY, COST_AWARE)


@dataclass(frozen=True)
class Guard:
    """The cache-aware routers' load guard (their defaults: 64 and 1.5); None disables it."""

    balance_abs: int = 64
    balance_rel: float = 1.5

    def tripped(self, loads: Sequence[int]) -> bool:
        busiest, idlest = max(loads), min(loads)
        return busiest - idlest > self.balance_abs and busiest > self.balance_rel * idlest


DEFAULT_GUARD = Guard()
Choose = Callable[[Job, Sequence[Replica], float], int]


def _tie(candidates: list[int], job: Job) -> int:
    return candidates[job.order % len(candidates)] if len(candidates) > 1 else candidates[0]


def _least(scores: Sequence[float], job: Job, among: Sequence[int] | None = None) -> int:
    indices = range(len(scores)) if among is None else among
    best = min(scores[i] for i in indices)
    return _tie([i for i in indices if scores[i] == best], job)


def round_robin(job: Job, replicas: Sequence[Replica], now: float) -> int:
    return job.order % len(replicas)


def least_queue(job: Job, replicas: Sequence[Replica], now: float) -> int:
    return _least([r.outstanding for r in replicas], job)


def prefix_affinity(guard: Guard | None) -> Choose:
    def choose(job: Job, replicas: Sequence[Replica], now: float) -> int:
        loads = [r.outstanding for r in replicas]
        if guard is not None and guard.tripped(loads):
            return _least(loads, job)
        cached = [r.cache.cached_prefix(job.blocks, job.limit) for r in replicas]
        most = max(cached)
        return _least(loads, job, [i for i, c in enumerate(cached) if c == most])

    return choose


def cost_aware(job: Job, replicas: Sequence[Replica], now: float) -> int:
    """Walk the replicas (from ``arrival order mod N``, so ties rotate) and move to the next one
    whenever going there pays by the articles' rule: the prefill it saves beats the extra wait."""
    waits = [r.expected_wait(now) for r in replicas]
    prefills = [r.prefill_seconds(job, r.cache.cached_prefix(job.blocks, job.limit)) for r in replicas]
    count = len(replicas)
    best = job.order % count
    for step in range(1, count):
        other = (job.order + step) % count
        if cache_route_pays(
            prefill_saved_seconds=prefills[best] - prefills[other],
            extra_queue_seconds=waits[other] - waits[best],
        ):
            best = other
    job.estimate = prefills[best]  # the chosen replica's expected_wait counts it while it waits
    return best


def policy(name: str, guard: Guard | None = DEFAULT_GUARD) -> Choose:
    if name == ROUND_ROBIN:
        return round_robin
    if name == LEAST_QUEUE:
        return least_queue
    if name == PREFIX_AFFINITY:
        return prefix_affinity(guard)
    if name == COST_AWARE:
        return cost_aware
    raise ValueError(f"unknown policy {name!r}: one of {', '.join(POLICIES)}")
