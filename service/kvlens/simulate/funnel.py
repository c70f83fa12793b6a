"""The loss funnel of a simulated fleet, in the live sidecar's units: the replicas' caches publish
their KV events into a :class:`~kvlens.fleet.index.FleetIndex` (keyed by the trace's block ids,
``hashes_alike``), which classifies every block a replica computed as the live index does, then

    prompt -> computed before (reused + held elsewhere + evicted here + evicted elsewhere)
           -> reachable on some replica (reused + held elsewhere)
           -> held by the chosen one (reused + held here)
           -> reused

in tokens and in modelled work by the fleet's prefill cost model (the one of compute saved),
each lost block at its position. So ``kvlens simulate``'s what-if stands beside the live
``kvlens_kv_recomputed_*`` families and their recording rules (``kvlens:kv_funnel_*``) on the
same scale. Needs the index's compiled loops (the ``kv-events`` extra): without them no funnel.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from kvlens.definitions import UNITS, CostModel
from kvlens.fleet.causes import EVICTED_ELSEWHERE, EVICTED_HERE, HELD_ELSEWHERE, HELD_HERE
from kvlens.fleet.index import FleetIndex
from kvlens.simulate.cache import CacheEvents
from kvlens.simulate.modelled import IndexSink
from kvlens.simulate.run import Outcome

STAGES: Final = ("prompt", "computed_before", "reachable_on_some_replica", "held_by_chosen", "reused")


def events_into(index: FleetIndex, block_size: int) -> Callable[[int], CacheEvents]:
    """Replica ``i``'s cache events, into ``index`` as replica ``r{i}`` (the block ids are the
    keys: tokens are never read)."""
    sinks: dict[int, CacheEvents] = {}

    def sink(i: int) -> CacheEvents:
        if i not in sinks:
            sinks[i] = IndexSink(index, f"r{i}", block_size)
        return sinks[i]

    return sink


def funnel(outcome: Outcome, index: FleetIndex, cost: CostModel) -> dict[str, Any]:
    """The stages in tokens and in ``cost.unit``, and the lost causes beside them."""
    snapshot = index.snapshot()
    tokens: dict[str, int] = {}
    work: dict[str, float] = {}
    for (_, cause), count in snapshot.recomputed_tokens.items():
        tokens[cause] = tokens.get(cause, 0) + count
    for (_, cause), amount in snapshot.recomputed_work(cost).items():
        work[cause] = work.get(cause, 0.0) + amount
    totals = outcome.totals
    unit = UNITS.index(cost.unit)
    reused = (totals.cached_tokens, totals.reused_work[unit])
    stages = {}
    for stage, causes in (
        ("prompt", None),
        ("computed_before", (HELD_ELSEWHERE, EVICTED_HERE, EVICTED_ELSEWHERE)),
        ("reachable_on_some_replica", (HELD_ELSEWHERE,)),
        ("held_by_chosen", (HELD_HERE,)),
        ("reused", ()),
    ):
        if causes is None:
            stages[stage] = {"tokens": totals.prompt_tokens, "work": totals.prompt_work[unit]}
        else:
            stages[stage] = {
                "tokens": reused[0] + sum(tokens.get(c, 0) for c in causes),
                "work": reused[1] + sum(work.get(c, 0.0) for c in causes),
            }
    unknown = sum(snapshot.depth_unknown_tokens.values())
    return {
        "unit": cost.unit,
        "stages": stages,
        "recomputed_tokens": tokens,  # by cause, as kvlens_kv_recomputed_tokens_total
        "recomputed_work": work,  # by cause, as kvlens_kv_recomputed_work_total
        "depth_unknown_tokens": unknown,
    }
