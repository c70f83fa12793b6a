"""``kvlens analyze``'s per-request misses: every record with ``prefix_hashes``, in arrival order,
through the live sidecar's classifier (:class:`kvlens.fleet.misses.MissClassifier`), then per
prompt-length group the records that missed by their first missed block's cause, the tokens and
modelled work recomputed per cause, and the requests that lost the most work (reuse some cache
had computed before).

From the records alone, without the engines' KV events: ``new`` (no record before had the block)
and ``evicted_here`` (a record before on the same replica had it: evicted, or a salt or LoRA the
ids do not show) are told; a block only records on other replicas had is ``seen_elsewhere``:
whether it was still held there (routing) or evicted there too (the fleet's capacity) needs the
events (``kvlens serve --kv-events`` with ``kv_events_hashes_alike``). Records without
``replica`` are one unnamed replica's.
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np

from kvlens.analysis.report import Derived
from kvlens.fleet.misses import HIT, LOST_CAUSES, MISS_CAUSES, Diagnosis, MissClassifier

WORST: Final = 5  # requests listed per length group
REMEMBER_BLOCKS: Final = 50_000_000  # offline: every block of a large file (about 200 bytes each)
DEFAULT_BLOCK: Final = 16  # vLLM's, for records without block_size
CAN_TELL: Final = (
    "From prefix_hashes alone: new (no earlier record had the block) and evicted_here (an earlier "
    "record on the same replica had it) are told; seen_elsewhere is held or evicted on another "
    "replica, which only the engines' KV events tell apart (kvlens serve --kv-events)."
)


def request_misses(derived: Derived, worst: int = WORST) -> dict[str, Any] | None:
    """The records' misses per length group (None: no record has ``prefix_hashes``)."""
    batch = derived.batch
    rows = batch.rows_holding("prefix_hashes")
    if not rows:
        return None
    arrival = batch.arrival_time[rows]
    order = [rows[i] for i in np.argsort(np.where(np.isnan(arrival), np.inf, arrival), kind="stable")]
    classifier = MissClassifier(REMEMBER_BLOCKS)
    groups: dict[str, dict[str, Any]] = {}
    listed: dict[str, list[tuple[float, Diagnosis]]] = {}
    # each column read once in walk order as Python values, each model's cost model looked up
    # once: a numpy scalar a field and the settings' lookup a record cost more than the walk
    sizes, prompts, cached, codes, length_groups = (
        column[order].tolist()
        for column in (
            batch.block_size,
            batch.prompt_tokens,
            batch.cached_tokens,
            derived.reduced.model_codes,
            derived.length_group,
        )
    )
    costs = {name: derived.cost_for(name) for name in set(derived.reduced.model_names)}
    for k, i in enumerate(order):
        model = derived.reduced.model_names[codes[k]]
        diagnosis = classifier.diagnose(
            batch.request_id[i],
            batch.replica[i] or "",
            batch.prefix_hashes[i] or [],
            prompts[k],
            cached[k],
            sizes[k] if sizes[k] > 0 else DEFAULT_BLOCK,
            model,
        )
        if diagnosis is None:
            continue
        cost = costs[model]
        label = derived.length_labels[length_groups[k]]
        if label not in groups:
            groups[label] = _empty_group()
        group = groups[label]
        group["records"] += 1
        group["first_miss"][diagnosis.cause] += 1
        for cause, work in diagnosis.work(cost).items():
            group["work"].setdefault(cost.unit, dict.fromkeys(MISS_CAUSES, 0.0))[cause] += work
        for cause, tokens in zip(MISS_CAUSES, diagnosis.tokens, strict=True):
            group["tokens"][cause] += tokens
        lost = diagnosis.lost_work(cost)
        if lost > 0:
            listed.setdefault(label, []).append((lost, diagnosis))
            listed[label] = sorted(listed[label], key=lambda pair: -pair[0])[:worst]
    for label, group in groups.items():
        group["worst"] = [
            {
                "request_id": d.request_id,
                "replica": d.replica,
                "first_missed_block": d.first_missed_block,
                "cause": d.cause,
                "lost_work": lost,
                "unit": derived.cost_for(str(d.model)).unit,
                "lost_tokens": sum(t for c, t in zip(MISS_CAUSES, d.tokens, strict=True) if c in LOST_CAUSES),
            }
            for lost, d in listed.get(label, [])
        ]
    ordered = {label: groups[label] for label in derived.length_labels if label in groups}
    return {"records": sum(g["records"] for g in groups.values()), "groups": ordered, "note": CAN_TELL}


def _empty_group() -> dict[str, Any]:
    return {
        "records": 0,
        "first_miss": dict.fromkeys((HIT, *MISS_CAUSES), 0),
        "tokens": dict.fromkeys(MISS_CAUSES, 0),
        "work": {},
    }
