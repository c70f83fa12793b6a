"""The report's ``cross_tenant`` section: the passive isolation check offline, the rule of
:mod:`kvlens.tenancy` (the live sidecar's) over the records in arrival order.

Records are taken in ``arrival_time`` order (a stable sort; records without one last, in input
order), as :func:`kvlens.analysis.diagnosis.prefix_potential` takes them; the sidecar takes
them in the order they reach it, so a sender that sends in arrival order gets the same tokens.
Blocks remembered: ``tenant_remember_blocks`` when set (the sidecar's bound, for the same answer),
else every block of the input (the records are in memory already).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

from kvlens.records import RecordBatch
from kvlens.tenancy import BlockStorers, tenant_key

MAX_PAIRS: Final = 20  # pairs listed, most tokens first; the rest counted in pairs_left_out
MAX_EXAMPLES: Final = 5  # request ids per pair, the first in arrival order


@dataclass
class _Pair:
    tokens: int = 0
    requests: int = 0
    examples: list[str] = field(default_factory=list)


def cross_tenant(batch: RecordBatch, remember_blocks: int = 0) -> dict[str, Any] | None:
    """The section, or None when no record carries both a tenant and ``prefix_hashes`` (the
    report then has no such key: reports of records without tenants are unchanged)."""
    rows = batch.rows_holding("tenant", "prefix_hashes")
    if not rows:
        return None
    arrival = batch.arrival_time[rows]
    order = [rows[i] for i in np.argsort(np.where(np.isnan(arrival), np.inf, arrival), kind="stable")]
    capacity = remember_blocks or max(1, sum(len(batch.prefix_hashes[i] or ()) for i in rows))
    storers = BlockStorers(capacity)
    names = {tenant_key(name): name for name in {batch.tenant[i] for i in rows} if name}
    pairs: dict[tuple[str, str], _Pair] = {}
    for hit in storers.add(batch, order):
        getter = batch.tenant[hit.row] or ""
        pair = pairs.setdefault((names[hit.storer], getter), _Pair())
        pair.tokens += hit.tokens
        pair.requests += 1
        request_id = batch.request_id[hit.row]
        if request_id is not None and len(pair.examples) < MAX_EXAMPLES:
            pair.examples.append(request_id)
    ranked = sorted(pairs.items(), key=lambda item: (-item[1].tokens, item[0]))
    return {
        "records_checked": len(rows),
        "cross_tenant_cached_tokens": sum(pair.tokens for pair in pairs.values()),
        "remember_blocks": capacity,
        "forgotten_blocks": storers.forgotten,
        "pairs": [
            {
                "storer": storer,
                "getter": getter,
                "cached_tokens": pair.tokens,
                "requests": pair.requests,
                "example_request_ids": pair.examples,
            }
            for (storer, getter), pair in ranked[:MAX_PAIRS]
        ],
        "pairs_left_out": max(0, len(ranked) - MAX_PAIRS),
    }
