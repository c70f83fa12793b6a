"""The report of ``kvlens analyze``: a plain dict with a stable, documented schema
(``SCHEMA``; README "kvlens analyze"), built from a record batch with the same definitions as
the live exporter. Renderers (terminal, Markdown, HTML) only format it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvlens import definitions
from kvlens.definitions import CostModel, Totals, prompt_length_bucket, prompt_length_labels
from kvlens.records import RecordBatch

SCHEMA = "kvlens.analyze/v1"
QUANTILES = (50, 95, 99)
SLOWEST_SHARE = 0.05


@dataclass(frozen=True)
class Derived:
    """Per-record columns every part of the analysis shares."""

    batch: RecordBatch
    model: npt.NDArray[np.object_]
    length_group: npt.NDArray[np.intp]
    length_labels: list[str]
    hit: npt.NDArray[np.bool_]
    prompt_work: npt.NDArray[np.float64]
    reused_work: npt.NDArray[np.float64]

    @classmethod
    def of(
        cls, batch: RecordBatch, edges: list[int], cost_for: Callable[[str], CostModel], default_model: str
    ) -> Derived:
        names = np.array([*batch.model_names, default_model], dtype=object)
        model = names[batch.model_codes]  # code -1 picks the default
        prompt_work, reused_work = definitions.modelled_work(
            batch.prompt_tokens, batch.cached_tokens, model, cost_for
        )
        return cls(
            batch=batch,
            model=model,
            length_group=prompt_length_bucket(batch.prompt_tokens, edges),
            length_labels=prompt_length_labels(edges),
            hit=batch.cached_tokens > 0,
            prompt_work=prompt_work,
            reused_work=reused_work,
        )

    def totals(self, rows: npt.NDArray[np.bool_] | slice = slice(None)) -> Totals:
        n, h = self.batch.prompt_tokens[rows], self.batch.cached_tokens[rows]
        return Totals(
            requests=int(n.size),
            hit_requests=int(np.count_nonzero(h > 0)),
            prompt_tokens=int(n.sum()),
            cached_tokens=int(h.sum()),
            prompt_work_units=float(self.prompt_work[rows].sum()),
            reused_work_units=float(self.reused_work[rows].sum()),
        )


def ratios(totals: Totals) -> dict[str, Any]:
    return {
        "requests": totals.requests,
        "hit_requests": totals.hit_requests,
        "prompt_tokens": totals.prompt_tokens,
        "cached_tokens": totals.cached_tokens,
        "prompt_work_units": totals.prompt_work_units,
        "reused_work_units": totals.reused_work_units,
        "request_hit_ratio": totals.request_hit_ratio,
        "token_reuse_ratio": totals.token_reuse_ratio,
        "compute_saved_ratio": totals.compute_saved_ratio,
    }


def percentiles(values: npt.NDArray[np.float64]) -> dict[str, Any]:
    """Exact percentiles (linear between order statistics) of the present values."""
    present = values[~np.isnan(values)]
    if not present.size:
        return {"count": 0, **{f"p{q}": None for q in QUANTILES}}
    found = np.percentile(present, QUANTILES)
    return {"count": int(present.size), **{f"p{q}": float(v) for q, v in zip(QUANTILES, found, strict=True)}}


def build(derived: Derived) -> dict[str, Any]:
    batch = derived.batch
    overall = derived.totals()
    return {
        "schema": SCHEMA,
        "overall": ratios(overall),
        "models": {
            name: ratios(derived.totals(derived.model == name)) for name in sorted(set(derived.model))
        },
        "groups": _groups(derived, overall),
        "ttft_decomposition": _decomposition(batch),
        "slowest": _slowest(derived),
    }


def _groups(derived: Derived, overall: Totals) -> list[dict[str, Any]]:
    batch = derived.batch
    out = []
    for length, label in enumerate(derived.length_labels):
        for cache, hit in (("hit", True), ("miss", False)):
            rows = (derived.length_group == length) & (derived.hit == hit)
            if not rows.any():
                continue
            totals = derived.totals(rows)
            out.append(
                {
                    "prompt_len": label,
                    "cache": cache,
                    "requests": totals.requests,
                    "share_of_requests": definitions.safe_ratio(totals.requests, overall.requests),
                    "share_of_tokens": definitions.safe_ratio(totals.prompt_tokens, overall.prompt_tokens),
                    "share_of_work": definitions.safe_ratio(
                        totals.prompt_work_units, overall.prompt_work_units
                    ),
                    "token_reuse_ratio": totals.token_reuse_ratio,
                    "ttft_seconds": percentiles(batch.ttft_seconds[rows]),
                    "queue_seconds": percentiles(batch.queue_seconds[rows]),
                    "prefill_seconds": percentiles(batch.prefill_seconds[rows]),
                }
            )
    return out


def _decomposition(batch: RecordBatch) -> dict[str, Any]:
    parts = definitions.ttft_components(batch.ttft_seconds, batch.queue_seconds, batch.prefill_seconds)
    complete = ~(
        np.isnan(batch.ttft_seconds) | np.isnan(batch.queue_seconds) | np.isnan(batch.prefill_seconds)
    )
    sums = {name: float(getattr(parts, name)[complete].sum()) for name in ("queue", "prefill", "other")}
    total = sum(sums.values())
    return {
        "requests": int(complete.sum()),
        "overlapped_requests": int(parts.overlapped[complete].sum()),
        **{f"{name}_share": definitions.safe_ratio(value, total) for name, value in sums.items()},
    }


def _slowest(derived: Derived) -> dict[str, Any]:
    """Where the slowest 5 % of requests (by TTFT) sit, by group."""
    ttft = derived.batch.ttft_seconds
    present = ~np.isnan(ttft)
    if not present.any():
        return {"share": SLOWEST_SHARE, "threshold_seconds": None, "requests": 0, "groups": []}
    threshold = float(np.quantile(ttft[present], 1 - SLOWEST_SHARE))
    slow = present & (ttft >= threshold)
    groups: list[dict[str, Any]] = []
    for length, label in enumerate(derived.length_labels):
        for cache, hit in (("hit", True), ("miss", False)):
            count = int((slow & (derived.length_group == length) & (derived.hit == hit)).sum())
            if count:
                groups.append(
                    {"prompt_len": label, "cache": cache, "requests": count, "share": count / int(slow.sum())}
                )
    groups.sort(key=lambda group: -group["requests"])
    return {
        "share": SLOWEST_SHARE,
        "threshold_seconds": threshold,
        "requests": int(slow.sum()),
        "groups": groups,
    }
