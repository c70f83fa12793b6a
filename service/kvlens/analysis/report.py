"""The report of ``kvlens analyze``: a plain dict with a stable, documented schema
(``SCHEMA``; README "kvlens analyze"), built from a record batch with the same definitions as
the live exporter. Renderers (terminal, Markdown, HTML) only format it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import astuple, dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvlens import definitions
from kvlens.definitions import CostModel, Totals, prompt_length_labels
from kvlens.records import RecordBatch
from kvlens.reduce import Reduced, codes_of, pack_hit, reduce, unpack_hit
from kvlens.stats import order_statistics, percentiles

SCHEMA = "kvlens.analyze/v1"
SLOWEST_SHARE = 0.05


@dataclass(frozen=True)
class Derived:
    """The batch beside its reduction (:func:`kvlens.reduce.reduce`, shared with the exporter)."""

    batch: RecordBatch
    reduced: Reduced
    length_labels: list[str]
    cost_for: Callable[[str], CostModel]

    @classmethod
    def of(
        cls, batch: RecordBatch, edges: list[int], cost_for: Callable[[str], CostModel], default_model: str
    ) -> Derived:
        reduced = reduce(batch, edges=edges, cost_for=cost_for, default_model=default_model)
        return cls(batch=batch, reduced=reduced, length_labels=prompt_length_labels(edges), cost_for=cost_for)

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


# ---------------------------------------------------------------------------------------------
# What an engine computes from the records (numpy here, SQL in kvlens.analysis.duckdb); the
# report is built from a Summary alone, so both engines share every step after the scan.

Key = tuple[str, int, bool]  # (model by raw name, prompt-length group, hit)
Group = tuple[int, bool]  # (prompt-length group, hit)
LATENCY_COLUMNS = ("ttft_seconds", "queue_seconds", "prefill_seconds")


@dataclass(frozen=True)
class Cell:
    """Exact integer sums of the records of one :data:`Key`: ``C(n)`` summed is
    ``a*sum(n) + b*sum(n*(n+1)/2)``, so integer sums fix the modelled work to the last bit."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prompt_pairs: int = 0  # sum of n*(n+1)/2
    cached_pairs: int = 0  # sum of h*(h+1)/2

    def __add__(self, other: Cell) -> Cell:
        return Cell(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))


@dataclass(frozen=True)
class Decomposition:
    """TTFT parts of the records with all three measured, summed in fixed point
    (:data:`kvlens.definitions.FIXED_POINT_SECONDS`)."""

    requests: int = 0
    overlapped: int = 0
    queue: int = 0
    prefill: int = 0
    other: int = 0


@dataclass(frozen=True)
class PrefillGroup:
    """A group's records with a prefill time: what the "prefill not faster" diagnosis compares."""

    requests: int
    prompt_tokens: int
    cached_tokens: int
    median_seconds: float
    median_per_computed_token: float  # prefill / max(n - h, 1)


@dataclass(frozen=True)
class Summary:
    cells: dict[Key, Cell]
    latency: dict[Group, dict[str, dict[str, Any]]]  # group -> column -> percentiles
    decomposition: Decomposition
    slowest_threshold: float | None
    slowest: dict[Group, int]  # records with TTFT at or above the threshold
    prefill: dict[Group, PrefillGroup]


def totals_of(cells: dict[Key, Cell], cost_for: Callable[[str], CostModel]) -> Totals:
    """The :class:`Totals` of ``cells``; work summed model by model (sorted by name) from the
    exact sums, each in its model's unit."""
    by_model: dict[str, Cell] = {}
    for key, cell in cells.items():
        by_model[key[0]] = by_model.get(key[0], Cell()) + cell
    prompt_work = [0.0] * len(definitions.UNITS)
    reused_work = [0.0] * len(definitions.UNITS)
    hits = sum(cell.requests for key, cell in cells.items() if key[2])
    for name in sorted(by_model):
        cell, cost = by_model[name], cost_for(name)
        unit = definitions.UNITS.index(cost.unit)
        prompt_work[unit] += cost.work_of_sums(cell.prompt_tokens, cell.prompt_pairs)
        reused_work[unit] += cost.work_of_sums(cell.cached_tokens, cell.cached_pairs)
    total = sum(by_model.values(), Cell())
    return Totals(
        requests=total.requests,
        hit_requests=hits,
        prompt_tokens=total.prompt_tokens,
        cached_tokens=total.cached_tokens,
        prompt_work=tuple(prompt_work),
        reused_work=tuple(reused_work),
    )


def cells_of(derived: Derived, rows: npt.NDArray[np.bool_] | None = None) -> dict[Key, Cell]:
    """The exact sums of the records in ``rows`` (all by default), per :data:`Key`."""
    reduced = derived.reduced
    groups = len(derived.length_labels)
    code = pack_hit(reduced.model_codes.astype(np.int64) * groups + reduced.length_group, reduced.hit)
    n, h = derived.batch.prompt_tokens, derived.batch.cached_tokens
    if rows is not None:
        code, n, h = code[rows], n[rows], h[rows]
    if code.size and int(code.max()) >= DENSE_CODES_PER_ROW * code.size:
        # codes spread thin (a name per record): numbered densely first, so that the sums' tables
        # are as long as the keys, not as the largest code
        keys, inverse = np.unique(code, return_inverse=True)
    else:
        keys, inverse = np.arange(int(code.max()) + 1 if code.size else 0), code
    counts = np.bincount(inverse, minlength=keys.size)
    present = np.flatnonzero(counts)
    sums = [
        counts[present].tolist(),
        *(
            _exact_sums(inverse, keys.size, column, present)
            for column in (n, h, n * (n + 1) // 2, h * (h + 1) // 2)
        ),
    ]
    cells = {}
    for i, value in enumerate(keys[present].tolist()):
        rest, hit = unpack_hit(value)
        model, group = divmod(rest, groups)
        cells[(reduced.model_names[model], group, hit)] = Cell(*(column[i] for column in sums))
    return cells


def summarize(derived: Derived) -> Summary:
    """The numpy engine: the :class:`Summary` of records held in memory."""
    batch, reduced = derived.batch, derived.reduced
    groups = len(derived.length_labels)
    n, h = batch.prompt_tokens, batch.cached_tokens
    cells = cells_of(derived)
    present = [(g, hit) for g in range(groups) for hit in (True, False)]
    # the records sorted by group once (a stable radix sort of small codes), each column taken in
    # that order once: a group's records are a slice, not a mask over every record a column
    code = pack_hit(reduced.length_group, reduced.hit).astype(np.int16 if groups < 2**14 else np.intp)
    order = np.argsort(code, kind="stable")
    bounds = np.concatenate(([0], np.cumsum(np.bincount(code, minlength=codes_of(groups))))).tolist()
    rows_of = {group: slice(bounds[pack_hit(*group)], bounds[pack_hit(*group) + 1]) for group in present}
    sorted_columns = {name: getattr(batch, name)[order] for name in LATENCY_COLUMNS}
    latency = {
        group: {name: percentiles(sorted_columns[name][rows]) for name in LATENCY_COLUMNS}
        for group, rows in rows_of.items()
        if rows.stop > rows.start
    }
    parts, complete = reduced.ttft, reduced.ttft_complete
    decomposition = Decomposition(
        int(complete.sum()),
        int(parts.overlapped[complete].sum()),
        *(
            _exact_sum(definitions.fixed_point_seconds(getattr(parts, name)[complete]))
            for name in ("queue", "prefill", "other")
        ),
    )
    ttft = batch.ttft_seconds
    threshold = None
    slowest: dict[Group, int] = {}
    present_ttft = ttft[~np.isnan(ttft)]
    if present_ttft.size:
        (threshold,) = definitions.quantiles(
            int(present_ttft.size), (1 - SLOWEST_SHARE,), lambda r: order_statistics(present_ttft, r)
        )
        slow = (~np.isnan(ttft) & (ttft >= threshold))[order]
        slowest = {group: int(np.count_nonzero(slow[rows])) for group, rows in rows_of.items()}
    prefill = {}
    sorted_n, sorted_h = n[order], h[order]
    for group, rows in rows_of.items():
        seconds = sorted_columns["prefill_seconds"][rows]
        chosen = ~np.isnan(seconds)
        if chosen.any():
            seconds, chosen_n, chosen_h = seconds[chosen], sorted_n[rows][chosen], sorted_h[rows][chosen]
            per_token = seconds / np.maximum(chosen_n - chosen_h, 1)
            prefill[group] = PrefillGroup(
                int(chosen.sum()),
                int(chosen_n.sum()),
                int(chosen_h.sum()),
                _median(seconds),
                _median(per_token),
            )
    return Summary(cells, latency, decomposition, threshold, slowest, prefill)


def _median(values: npt.NDArray[np.float64]) -> float:
    (median,) = definitions.quantiles(int(values.size), (0.5,), lambda r: order_statistics(values, r))
    return median


SAFE_ROWS = 2**16  # rows whose int64 sum cannot overflow: each n*(n+1)/2 < 2**46 (n <= 10M)


def _exact_sum(values: npt.NDArray[np.int64]) -> int:
    return (
        sum(int(v) for v in np.add.reduceat(values, np.arange(0, values.size, SAFE_ROWS)))
        if values.size
        else 0
    )


# Per-key sums without sorting: each value split in two parts of at most 26 bits, each part summed
# by np.bincount in float64, exact while a sum stays below 2**53. Values are below 2**46 (n*(n+1)/2
# with n <= MAX_TOKENS), so the high parts are below 2**20 and the low ones below 2**26: sums of
# at most BINCOUNT_ROWS rows of either are exact.
LOW_BITS = 26
BINCOUNT_ROWS = 2**26
DENSE_CODES_PER_ROW = 4  # codes above this many a row are numbered densely first (np.unique)


def _exact_sums(
    inverse: npt.NDArray[Any], keys: int, values: npt.NDArray[np.int64], present: npt.NDArray[np.intp]
) -> list[int]:
    """Per key in ``present`` (``inverse`` numbers each row's key below ``keys``), the exact
    (Python int) sum of ``values``, each in [0, 2**46)."""
    out = [0] * present.size
    low_mask = (1 << LOW_BITS) - 1
    for start in range(0, values.size, BINCOUNT_ROWS):
        part, where = values[start : start + BINCOUNT_ROWS], inverse[start : start + BINCOUNT_ROWS]
        low = np.bincount(where, part & low_mask, keys)[present].tolist()
        high = np.bincount(where, part >> LOW_BITS, keys)[present].tolist()
        for i, (low_sum, high_sum) in enumerate(zip(low, high, strict=True)):
            out[i] += (int(high_sum) << LOW_BITS) + int(low_sum)
    return out


def build(derived: Derived) -> dict[str, Any]:
    return build_from(summarize(derived), derived.cost_for, derived.length_labels)


def build_from(
    summary: Summary, cost_for: Callable[[str], CostModel], length_labels: list[str]
) -> dict[str, Any]:
    """The report of a :class:`Summary`, whichever engine computed it."""
    cells = summary.cells
    overall = totals_of(cells, cost_for)
    models = sorted({key[0] for key in cells})
    return {
        "schema": SCHEMA,
        "overall": ratios(overall),
        "models": {
            name: ratios(totals_of({k: c for k, c in cells.items() if k[0] == name}, cost_for))
            for name in models
        },
        "groups": _groups(summary, cost_for, length_labels, overall),
        "ttft_decomposition": _decomposition(summary.decomposition),
        "slowest": _slowest(summary, length_labels),
    }


def _groups(
    summary: Summary, cost_for: Callable[[str], CostModel], length_labels: list[str], overall: Totals
) -> list[dict[str, Any]]:
    out = []
    for length, label in enumerate(length_labels):
        for cache, hit in (("hit", True), ("miss", False)):
            cells = {k: c for k, c in summary.cells.items() if k[1:] == (length, hit)}
            totals = totals_of(cells, cost_for)
            if not totals.requests:
                continue
            out.append(
                {
                    "prompt_len": label,
                    "cache": cache,
                    "requests": totals.requests,
                    "share_of_requests": definitions.safe_ratio(totals.requests, overall.requests),
                    "share_of_tokens": definitions.safe_ratio(totals.prompt_tokens, overall.prompt_tokens),
                    "share_of_work": _share_of_work(totals, overall),
                    "token_reuse_ratio": totals.token_reuse_ratio,
                    **summary.latency[(length, hit)],
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


def _decomposition(parts: Decomposition) -> dict[str, Any]:
    total = parts.queue + parts.prefill + parts.other
    return {
        "requests": parts.requests,
        "overlapped_requests": parts.overlapped,
        **{
            f"{name}_share": definitions.safe_ratio(getattr(parts, name), total)
            for name in ("queue", "prefill", "other")
        },
    }


def _slowest(summary: Summary, length_labels: list[str]) -> dict[str, Any]:
    """Where the slowest 5 % of requests (by TTFT) sit, by group."""
    if summary.slowest_threshold is None:
        return {"share": SLOWEST_SHARE, "threshold_seconds": None, "requests": 0, "groups": []}
    slow = sum(summary.slowest.values())
    groups: list[dict[str, Any]] = []
    for length, label in enumerate(length_labels):
        for cache, hit in (("hit", True), ("miss", False)):
            count = summary.slowest.get((length, hit), 0)
            if count:
                groups.append({"prompt_len": label, "cache": cache, "requests": count, "share": count / slow})
    groups.sort(key=lambda group: -group["requests"])
    return {
        "share": SLOWEST_SHARE,
        "threshold_seconds": summary.slowest_threshold,
        "requests": slow,
        "groups": groups,
    }
