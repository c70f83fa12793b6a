"""The :class:`kvlens.analysis.report.Summary` of the records view, and calibration's points,
for the ``duckdb`` engine.

The per-record decisions of :func:`kvlens.reduce.reduce` are the view of
:func:`kvlens.reduce_sql.reduced_sql`, derived as each scan reads; :func:`summarize` computes the
summary (exact integer sums per model, length group and hit; exact order statistics; fixed-point
TTFT sums) in a few scans, and the report is built from it by the same code as the numpy path's,
so the two agree field by field (tests/unit/test_columnar.py draws random record sets to hold
them to it).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from kvlens import definitions, reduce_sql, stats
from kvlens.analysis import report
from kvlens.analysis.duckdb import order_statistics
from kvlens.analysis.duckdb.engine import Engine
from kvlens.analysis.duckdb.order_statistics import SERIES, Part, Series, Tail, part_key
from kvlens.analysis.duckdb.parquet import Unchecked
from kvlens.reduce import unpack_hit

KEPT = ("src", "row", "arrival_time")  # columns of the records the reduced view keeps as they are
RANKED = SERIES[:-1]  # the series read from a record (all_ttft is ttft_seconds over every group)


class Arrivals(NamedTuple):
    """The first and last arrival time of the records, and how many records have one."""

    first: float | None = None
    last: float | None = None
    records: int = 0

    def merged(self, other: Arrivals) -> Arrivals:
        """The range of both, counted together."""
        if not other.records:
            return self
        if not self.records:
            return other
        assert self.first is not None and self.last is not None
        assert other.first is not None and other.last is not None
        return Arrivals(
            min(self.first, other.first), max(self.last, other.last), self.records + other.records
        )


@dataclass(frozen=True)
class Summarized:
    """What :func:`summarize` found: the summary the report is built from, each model's count
    of records with a prefill time (:func:`calibration_inputs` batches by it), and the range of
    the arrival times (the report's time range)."""

    summary: report.Summary
    prefill_counts: dict[str, int]
    arrivals: Arrivals


@dataclass(frozen=True)
class Bounds:
    """A series' values in one row of :func:`totals_sql`: the order statistics' bounds and scale."""

    count: int
    low: float
    high: float
    total: float


@dataclass(frozen=True)
class GroupSums:
    """One row of :func:`totals_sql`, read by the names it selects: the sums of one (model,
    length group, hit)."""

    key: report.Key
    cell: report.Cell
    series: dict[str, Bounds]  # the series with a value in the group
    decomposition: report.Decomposition
    timed_prompt_tokens: int  # of the records with a prefill time
    timed_cached_tokens: int
    arrivals: Arrivals
    last_row: int


# the column of :func:`totals_sql` of each field of :class:`kvlens.analysis.report.Decomposition`
_DECOMPOSITION = {
    "requests": "complete_requests",
    "overlapped": "overlapped_requests",
    "queue": "queue_fixed",
    "prefill": "prefill_fixed",
    "other": "other_fixed",
}


def _int(value: Any) -> int:
    return 0 if value is None else int(value)


def _exact(term: str) -> str:
    return reduce_sql.exact_sum(term, in_duckdb=True)


def _fixed(seconds: str) -> str:
    return reduce_sql.fixed_sum(seconds, in_duckdb=True)


def _totals_columns(by: str | None) -> list[tuple[str, str]]:
    """(name, expression) of each column of :func:`totals_sql`, in order; the names are none of
    the reduced view's, so no expression reads a sum where it meant the column."""
    timed = "FILTER (WHERE prefill_seconds IS NOT NULL)"
    complete = "FILTER (WHERE ttft_complete)"
    columns = [(name, name) for name in ("model", "length_group", "hit")]
    columns += [("requests", "COUNT(*)")]
    columns += [
        (f"{name}_sum", _exact(name))
        for name in ("prompt_tokens", "cached_tokens", "prompt_squares", "cached_squares")
    ]
    for name in RANKED:
        columns += [
            (f"{name}_count", f"COUNT({name})"),
            (f"{name}_min", f"MIN({name})"),
            (f"{name}_max", f"MAX({name})"),
            (f"{name}_sum", f"SUM({name})"),
        ]
    columns += [
        ("complete_requests", f"COUNT(*) {complete}"),
        ("overlapped_requests", "COUNT(*) FILTER (WHERE ttft_overlapped)"),
        ("queue_fixed", f"{_fixed('queue_seconds')} {complete}"),
        ("prefill_fixed", f"{_fixed('prefill_seconds')} {complete}"),
        ("other_fixed", f"{_fixed('ttft_other')} {complete}"),
        ("timed_prompt_tokens", f"{_exact('prompt_tokens')} {timed}"),
        ("timed_cached_tokens", f"{_exact('cached_tokens')} {timed}"),
        ("first_arrival", "MIN(arrival_time)"),
        ("last_arrival", "MAX(arrival_time)"),
        ("arrivals", "COUNT(arrival_time)"),
        ("last_row", "MAX(row)"),
    ]
    return [*columns, (by, by)] if by else columns


def totals_sql(reduced: str, by: str | None = None) -> str:
    """Everything the summary sums, per (model, length group, hit), in one scan: the cells,
    each series' count, min, max and sum (the order statistics' bounds and scale), the TTFT
    decomposition, the prefill groups' sums, the arrival times' range and the last row number
    (:func:`kvlens.analysis.duckdb.order_statistics.row_chunks`); read by :func:`group_sums`.
    Per-model rows are added up in Python, exactly (integers; min and max of floats). ``by``:
    a column of ``reduced`` grouped by too, selected last."""
    selected = ",\n  ".join(
        expression if name == expression else f"{expression} AS {name}"
        for name, expression in _totals_columns(by)
    )
    return f"""SELECT {selected}
FROM ({reduced}) AS reduced_rows GROUP BY model, length_group, hit{f", {by}" if by else ""}"""


def group_sums(engine: Engine, reduced: str, checks: bool = False) -> tuple[list[GroupSums], bool]:
    """The rows of :func:`totals_sql`, each read by its columns' names. ``checks``: ``reduced``
    has each row's ``rejection`` (:meth:`kvlens.analysis.duckdb.parquet.Unchecked.source`), the
    rows are grouped by it too, and the rejected rows' groups (whose values are NULL) are left
    out; the second value says whether there were any."""
    by = "rejection" if checks else None
    names = [name for name, _ in _totals_columns(by)]
    found, rejected = [], False
    for values in engine.connection.execute(totals_sql(reduced, by)).fetchall():
        row = dict(zip(names, values, strict=True))
        if checks and row["rejection"] is not None:
            rejected = True  # counted by :meth:`kvlens.analysis.duckdb.parquet.Unchecked.settle`
            continue
        n, h = int(row["prompt_tokens_sum"]), int(row["cached_tokens_sum"])
        found.append(
            GroupSums(
                key=(str(row["model"]), int(row["length_group"]), bool(row["hit"])),
                cell=report.Cell(
                    int(row["requests"]),
                    n,
                    h,
                    reduce_sql.pairs(n, int(row["prompt_squares_sum"])),
                    reduce_sql.pairs(h, int(row["cached_squares_sum"])),
                ),
                series={
                    name: Bounds(
                        int(row[f"{name}_count"]),
                        float(row[f"{name}_min"]),
                        float(row[f"{name}_max"]),
                        float(row[f"{name}_sum"]),
                    )
                    for name in RANKED
                    if row[f"{name}_count"]
                },
                decomposition=report.Decomposition(
                    **{name: _int(row[column]) for name, column in _DECOMPOSITION.items()}
                ),
                timed_prompt_tokens=_int(row["timed_prompt_tokens"]),
                timed_cached_tokens=_int(row["timed_cached_tokens"]),
                arrivals=Arrivals(
                    None if row["first_arrival"] is None else float(row["first_arrival"]),
                    None if row["last_arrival"] is None else float(row["last_arrival"]),
                    int(row["arrivals"]),
                ),
                last_row=int(row["last_row"]),
            )
        )
    return found, rejected


def _series(chunks: tuple[str, ...], sample: tuple[str, ...] | None = None) -> Series:
    """Each latency value of the ``reduced`` view once per series it is ranked in (per group;
    TTFT also over all records): one read of a record serves every series."""
    group = reduce_sql.pack_hit_sql("length_group + 1", "hit")
    selected = ", ".join(f"{name} AS v{index}" for index, name in enumerate(RANKED))
    return Series(
        sql=lambda where: f"SELECT {group} AS g, {selected} FROM reduced WHERE {where}",
        # a grouped part's key is its series' key for group -1, no hit, plus the row's g
        keys=(*(part_key((name, -1, False)) for name in RANKED), part_key(("all_ttft", -1, False))),
        grouped=(*(True for _ in RANKED), False),
        chunks=chunks,
        columns=(*range(len(RANKED)), RANKED.index("ttft_seconds")),  # all records' TTFT: read once
        sample=sample,
    )


@dataclass
class _Totals:
    """The rows of :func:`totals_sql` added up over models: the report's cells and TTFT
    decomposition, each part's count, min and max (the ranks to find) and sum (the first
    pass's bin scale: :func:`kvlens.analysis.duckdb.order_statistics.at_ranks`), the prefill
    groups' sums, each model's timed records, the arrival times' range, the last row number."""

    cells: dict[report.Key, report.Cell] = field(default_factory=dict)
    bounds: dict[Part, tuple[int, float, float]] = field(default_factory=dict)
    sums: dict[Part, float] = field(default_factory=dict)
    decomposition: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_DECOMPOSITION, 0))
    prefill: dict[report.Group, tuple[int, int, int]] = field(default_factory=dict)  # requests, n, h
    timed_by_model: dict[str, int] = field(default_factory=dict)
    arrivals: Arrivals = field(default_factory=Arrivals)
    last_row: int = 0

    def add(self, row: GroupSums) -> None:
        model, g, hit = row.key
        self.cells[row.key] = row.cell
        for name, values in row.series.items():
            self._widen((name, g, hit), values)
            if name == "ttft_seconds":
                self._widen(("all_ttft", -1, False), values)
        for name in self.decomposition:
            self.decomposition[name] += getattr(row.decomposition, name)
        timed = row.series["prefill_seconds"].count if "prefill_seconds" in row.series else 0
        if timed:
            before = self.prefill.get((g, hit), (0, 0, 0))
            self.prefill[(g, hit)] = (
                before[0] + timed,
                before[1] + row.timed_prompt_tokens,
                before[2] + row.timed_cached_tokens,
            )
            self.timed_by_model[model] = self.timed_by_model.get(model, 0) + timed
        self.arrivals = self.arrivals.merged(row.arrivals)
        self.last_row = max(self.last_row, row.last_row)

    def _widen(self, part: Part, values: Bounds) -> None:
        self.sums[part] = self.sums.get(part, 0.0) + values.total
        count, low, high = values.count, values.low, values.high
        if part in self.bounds:
            known = self.bounds[part]
            count, low, high = known[0] + count, min(known[1], low), max(known[2], high)
        self.bounds[part] = (count, low, high)


def _order_statistics(engine: Engine, totals: _Totals) -> tuple[dict[tuple[Part, int], float], Tail]:
    """The values at the ranks the report reads of every part (the latency percentiles per
    group, the prefill medians, the slowest requests' threshold), and the :class:`Tail` that
    counts the slowest requests from the same read."""
    records = sum(cell.requests for cell in totals.cells.values())
    series = _series(
        order_statistics.row_chunks(records, totals.last_row),
        order_statistics.sample_rows(records, totals.last_row),
    )
    fractions = {name: tuple(q / 100 for q in stats.QUANTILES) for name in report.LATENCY_COLUMNS}
    fractions["prefill_per_computed_token"] = (0.5,)
    fractions["all_ttft"] = (1 - report.SLOWEST_SHARE,)
    wanted: dict[Part, list[int]] = {}
    for part, (count, _, _) in totals.bounds.items():
        ranks = [definitions.quantile_ranks(count, fraction) for fraction in fractions[part[0]]]
        wanted[part] = sorted({rank for low, high, _ in ranks for rank in (low, high)})
    means = {part: totals.sums[part] / totals.bounds[part][0] for part in totals.bounds}
    tail = Tail(("all_ttft", -1, False))  # the slowest requests: counted from the same read
    return order_statistics.at_ranks(engine, series, wanted, totals.bounds, means, tail), tail


def summarize(
    engine: Engine, source: str, edges: Sequence[int], default_model: str, unchecked: Unchecked | None = None
) -> Summarized:
    """The :class:`kvlens.analysis.report.Summary` of the records in ``source``: one scan for
    the sums and bounds (:func:`totals_sql`), the order statistics (a sample, then one read of
    the records in chunks, rarely more: :func:`kvlens.analysis.duckdb.order_statistics.at_ranks`),
    one scan for the slowest requests. Nothing is materialized: each scan reads ``source`` (a
    table of JSON-lines records, or the Parquet files where they lie) and derives the decisions
    as it reads. The view ``reduced`` it leaves is what :func:`calibration_inputs` reads.
    ``unchecked`` (:attr:`kvlens.analysis.duckdb.inputs.Loaded.unchecked`): the sums scan
    checks those Parquet rows too, grouped by rejection as well, and settles them (the
    rejected rows counted, the view of ``source`` checks no more)."""
    con = engine.connection
    reduced = reduce_sql.reduced_sql(source, edges, default_model, KEPT)
    con.execute(f"CREATE OR REPLACE TEMP VIEW reduced AS {reduced}")
    if unchecked is None:
        rows, rejected = group_sums(engine, "SELECT * FROM reduced")
    else:
        checked = reduce_sql.reduced_sql(
            f"({unchecked.source()}) AS records_checked", edges, default_model, (*KEPT, "rejection")
        )
        rows, rejected = group_sums(engine, checked, checks=True)
    totals = _Totals()
    for row in rows:
        totals.add(row)
    if unchecked is not None:
        unchecked.settle(engine, rejected)
    bounds = totals.bounds
    found, tail = _order_statistics(engine, totals)

    def quantiles_of(part: Part, fractions: tuple[float, ...]) -> list[float]:
        count = bounds[part][0]
        return definitions.quantiles(count, fractions, lambda ranks: [found[(part, rank)] for rank in ranks])

    def latency_of(part: Part) -> dict[str, Any]:
        count = bounds[part][0] if part in bounds else 0
        return stats.percentiles_of(count, lambda ranks: [found[(part, rank)] for rank in ranks])

    groups = {(key[1], key[2]) for key in totals.cells}
    latency = {
        group: {name: latency_of((name, *group)) for name in report.LATENCY_COLUMNS}
        for group in sorted(groups)
    }
    threshold, counted = None, None
    slowest: dict[report.Group, int] = {}
    if ("all_ttft", -1, False) in bounds:
        (threshold,) = quantiles_of(("all_ttft", -1, False), (1 - report.SLOWEST_SHARE,))
        counted = tail.at_least(threshold)
        if counted is not None:  # g = pack_hit(length group + 1, hit) (:func:`_series`)
            slowest = {_group_of(g): count for g, count in counted.items()}
    if threshold is not None and counted is None:
        slowest = {
            (int(g), bool(hit)): int(count)
            for g, hit, count in con.execute(
                "SELECT length_group, hit, COUNT(*) FROM reduced WHERE ttft_seconds >= ? GROUP BY ALL",
                [threshold],
            ).fetchall()
        }
    prefill_groups: dict[report.Group, report.PrefillGroup] = {}
    for group, (count, n, h) in sorted(totals.prefill.items()):
        (median,) = quantiles_of(("prefill_seconds", *group), (0.5,))
        (per_token,) = quantiles_of(("prefill_per_computed_token", *group), (0.5,))
        prefill_groups[group] = report.PrefillGroup(count, n, h, median, per_token)
    summary = report.Summary(
        totals.cells,
        latency,
        report.Decomposition(**totals.decomposition),
        threshold,
        slowest,
        prefill_groups,
    )
    return Summarized(summary, totals.timed_by_model, totals.arrivals)


# Points fetched into Python at once, about 64 bytes each while sorted (2M held 135 MB beside
# DuckDB's memory at 10M records; the peak RSS goal is 1 GiB): a model's points are fetched
# whole, so a batch holds at least one model's sample (analyze's: 200k).
CALIBRATION_BATCH = 1 << 19


def calibration_inputs(
    engine: Engine, prefill_counts: dict[str, int], limit: int
) -> Iterator[tuple[str, Any, Any, Any]]:
    """Per model (by name), ``n``, ``h`` and prefill seconds of its records with a prefill time,
    in input order; past ``limit`` records of a model, an even, deterministic sample of about
    ``limit`` of them (a fit needs the shape of the cloud, not every point). The models' points
    come in batches of about :data:`CALIBRATION_BATCH` (one batch: a single scan and fetch;
    more: one scan picks every model's points into a table, in DuckDB and spilled if need be,
    then each batch is read from it). Reads the view ``reduced`` :func:`summarize` left, with
    its :attr:`Summarized.prefill_counts`."""
    con = engine.connection
    counts = prefill_counts
    names = sorted(counts)
    batches: list[list[int]] = []
    size = 0
    for index, name in enumerate(names):
        expected = min(counts[name], limit)  # a sample is about limit: a batch may pass the size a little
        if not batches or size + expected > CALIBRATION_BATCH:
            batches.append([])
            size = 0
        batches[-1].append(index)
        size += expected
    rates = {
        "i": np.arange(len(names), dtype=np.int64),
        "m": np.array(names, dtype=object),
        "c": np.array(
            [counts[name] for name in names], dtype=np.uint64
        ),  # hash() is UBIGINT: no HUGEINT modulo
    }
    picked = (
        "SELECT rates.i, prompt_tokens, cached_tokens, prefill_seconds, src, row FROM reduced "
        "JOIN rates ON reduced.model = rates.m WHERE prefill_seconds IS NOT NULL "
        f"AND (rates.c <= {int(limit)} OR hash(src, row) % rates.c < {int(limit)})"
    )
    source = f"({picked})"
    if len(batches) > 1:
        with engine.registered({"rates": rates}):
            con.execute(f"CREATE OR REPLACE TEMP TABLE calibration_points AS {picked}")
        source = "calibration_points"
    try:
        for batch in batches:
            with engine.registered({"rates": rates}):
                rows = con.execute(
                    f"SELECT i, prompt_tokens, cached_tokens, prefill_seconds, src, row FROM {source} "
                    f"WHERE i BETWEEN {batch[0]} AND {batch[-1]}"
                ).fetchnumpy()
            # by model, then input order: numpy's sort of the fetched keys costs half DuckDB's ORDER BY
            order = np.lexsort((np.asarray(rows["row"]), np.asarray(rows["src"]), np.asarray(rows["i"])))
            models = np.asarray(rows["i"], dtype=np.int64)[order]
            n, h = (
                np.asarray(rows[name], dtype=np.int64)[order] for name in ("prompt_tokens", "cached_tokens")
            )
            seconds = np.asarray(rows["prefill_seconds"], dtype=np.float64)[order]
            edges = np.searchsorted(models, np.arange(batch[0], batch[-1] + 2))
            for index, low, high in zip(batch, edges[:-1], edges[1:], strict=True):
                yield names[index], n[low:high], h[low:high], seconds[low:high]
    finally:
        con.execute("DROP TABLE IF EXISTS calibration_points")


def _group_of(code: int) -> report.Group:
    """The (length group, hit) of a :func:`_series` row's ``g``."""
    shifted, hit = unpack_hit(code)
    return shifted - 1, hit
