"""Policies x capacities on one trace, with the reuse gap split three ways.

For each capacity (blocks per replica) and each policy the fleet replays the trace. Beside them:

- **reachable**: one unbounded cache that sees every request (no routing, no eviction): the
  token reuse the workload allows at all. What it misses is the **workload**'s (prompts that
  share nothing, a template that puts variable text first);
- **pooled**: one cache with the fleet's whole capacity (replicas x capacity) that sees every
  request: what a perfect router would get. ``reachable - pooled`` is lost to **capacity**;
- **delivered** (each policy): ``pooled - delivered`` is lost to **routing** (it can come out
  negative: an LRU cache split by a good router may keep a little more than one pooled LRU).

Each policy's run also gives the live sidecar's funnel (:mod:`kvlens.simulate.funnel`: its
replicas' KV events through the fleet index), in tokens and in modelled work.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvlens.fleet.index import FleetIndex, compiled_loops_available
from kvlens.simulate.funnel import events_into, funnel
from kvlens.simulate.policies import DEFAULT_GUARD, Guard
from kvlens.simulate.replica import DEFAULT_SERVICE, ServiceModel
from kvlens.simulate.run import Fleet, Outcome, simulate, walk
from kvlens.simulate.trace import Trace, TraceRequest

IN_MEMORY_BYTES = 64 * 1024 * 1024  # a smaller trace file is read once; a larger one per run


@dataclass(frozen=True)
class Plan:
    trace: Trace
    replicas: int
    capacities: Sequence[int | None]  # blocks per replica; None: unbounded
    policies: Sequence[str]
    service: ServiceModel = DEFAULT_SERVICE
    guard: Guard | None = DEFAULT_GUARD

    @property
    def runs(self) -> int:
        return len(self.capacities) * (len(self.policies) + 1) + 1


def sweep(
    plan: Plan,
    *,
    records: Callable[[list[dict[str, Any]]], None] | None = None,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Every run of the plan, summarised (the ``--json`` of ``kvlens simulate``)."""
    requests = _requests(plan.trace)
    block_size = plan.trace.block_size
    reachable = walk(requests(), None, block_size, "reachable", plan.service)
    _advance(progress, reachable)
    capacities = []
    for capacity in plan.capacities:
        pooled_capacity = None if capacity is None else capacity * plan.replicas
        pooled = walk(requests(), pooled_capacity, block_size, "pooled", plan.service)
        _advance(progress, pooled)
        fleet = Fleet(plan.replicas, capacity, block_size, plan.service, plan.guard)
        delivered = []
        for name in plan.policies:
            arm = name if len(plan.capacities) == 1 else f"{name}@{_capacity_label(capacity)}"
            index = FleetIndex(hashes_alike=True) if compiled_loops_available() else None
            events = None if index is None else events_into(index, block_size)
            outcome = simulate(
                requests(), fleet, name, records=records, arm=arm, progress=progress, events=events
            )
            summary = _with_gaps(outcome, reachable, pooled)
            summary["funnel"] = None if index is None else funnel(outcome, index, plan.service.prefill)
            delivered.append(summary)
        capacities.append({"capacity_blocks": capacity, "pooled": pooled.summary(), "policies": delivered})
    service = plan.service
    return {
        "schema": "kvlens.simulate/v1",
        "trace": {
            "path": plan.trace.path,
            "format": plan.trace.format,
            "block_size": block_size,
            "time_scale": plan.trace.time_scale,
            "requests": reachable.totals.requests,
            "prompt_tokens": reachable.totals.prompt_tokens,
        },
        "fleet": {
            "replicas": plan.replicas,
            "max_running": service.max_running,
            "chunked_prefill": service.chunked_prefill,
            "prefill_cost_model": vars(service.prefill),
            "guard": None if plan.guard is None else vars(plan.guard),
        },
        "reachable": reachable.summary(),
        "capacities": capacities,
    }


def _with_gaps(outcome: Outcome, reachable: Outcome, pooled: Outcome) -> dict[str, Any]:
    summary = outcome.summary()
    reach, pool = reachable.totals.token_reuse_ratio, pooled.totals.token_reuse_ratio
    delivered = outcome.totals.token_reuse_ratio
    if reach is not None and pool is not None and delivered is not None:
        summary["token_reuse_gap"] = {
            "workload": 1.0 - reach,
            "capacity": reach - pool,
            "routing": pool - delivered,
        }
    return summary


def _capacity_label(capacity: int | None) -> str:
    return "unbounded" if capacity is None else str(capacity)


def _advance(progress: Callable[[int], None] | None, outcome: Outcome) -> None:
    if progress is not None:
        progress(outcome.totals.requests)


def _requests(trace: Trace) -> Callable[[], Iterable[TraceRequest]]:
    """Each run's requests: a small trace read once and kept, a large one streamed every time."""
    path = Path(trace.path)
    if path.stat().st_size > IN_MEMORY_BYTES:
        return trace.requests
    kept = list(trace.requests())
    return lambda: kept
