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
from kvlens.definitions import CostModel, Totals, prompt_length_labels
from kvlens.records import RecordBatch
from kvlens.reduce import Reduced, reduce

SCHEMA = "kvlens.analyze/v1"
QUANTILES = (50, 95, 99)
SLOWEST_SHARE = 0.05


@dataclass(frozen=True)
class Derived:
    """The batch beside its reduction (:func:`kvlens.reduce.reduce`, shared with the exporter)."""

    batch: RecordBatch
    reduced: Reduced
    length_labels: list[str]

    @classmethod
    def of(
        cls, batch: RecordBatch, edges: list[int], cost_for: Callable[[str], CostModel], default_model: str
    ) -> Derived:
        reduced = reduce(batch, edges=edges, cost_for=cost_for, default_model=default_model)
        return cls(batch=batch, reduced=reduced, length_labels=prompt_length_labels(edges))

    @property
    def model(self) -> npt.NDArray[np.object_]:
        return self.reduced.model

    @property
    def length_group(self) -> npt.NDArray[np.intp]:
        return self.reduced.length_group

    @property
    def hit(self) -> npt.NDArray[np.bool_]:
        return self.reduced.hit

    def totals(self, rows: npt.NDArray[np.bool_] | slice = slice(None)) -> Totals:
        return self.reduced.totals(rows)


def ratios(totals: Totals) -> dict[str, Any]:
    """The sums and ratios of a set of records. Modelled work is never added across units:
    ``prompt_work_units`` / ``reused_work_units`` are the article-unit sums (their v1 meaning),
    ``work`` holds the sums and the compute-saved ratio of each unit used, and
    ``compute_saved_ratio`` is null when the records' models count work in several units."""
    work_units = definitions.UNITS.index(definitions.WORK_UNITS)
    return {
        "requests": totals.requests,
        "hit_requests": totals.hit_requests,
        "prompt_tokens": totals.prompt_tokens,
        "cached_tokens": totals.cached_tokens,
        "prompt_work_units": totals.prompt_work[work_units],
        "reused_work_units": totals.reused_work[work_units],
        "work_unit": totals.work_unit,
        "work": {
            unit: {
                "prompt": totals.prompt_work[index],
                "reused": totals.reused_work[index],
                "compute_saved_ratio": totals.compute_saved_ratio_in(unit),
            }
            for index, unit in enumerate(definitions.UNITS)
            if unit in totals.units
        },
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
    overall = derived.totals()
    return {
        "schema": SCHEMA,
        "overall": ratios(overall),
        "models": {
            name: ratios(derived.totals(derived.model == name)) for name in sorted(set(derived.model))
        },
        "groups": _groups(derived, overall),
        "ttft_decomposition": _decomposition(derived.reduced),
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
                    "share_of_work": _share_of_work(totals, overall),
                    "token_reuse_ratio": totals.token_reuse_ratio,
                    "ttft_seconds": percentiles(batch.ttft_seconds[rows]),
                    "queue_seconds": percentiles(batch.queue_seconds[rows]),
                    "prefill_seconds": percentiles(batch.prefill_seconds[rows]),
                }
            )
    return out


def _share_of_work(part: Totals, whole: Totals) -> float | None:
    """The part's share of the modelled work, when all of it is in one unit."""
    unit = whole.work_unit
    if unit is None:
        return None
    index = definitions.UNITS.index(unit)
    return definitions.safe_ratio(part.prompt_work[index], whole.prompt_work[index])


def _decomposition(reduced: Reduced) -> dict[str, Any]:
    parts, complete = reduced.ttft, reduced.ttft_complete
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
