"""``kvlens compare`` out of core: the arms in DuckDB (the ``scale`` extra), compared in SQL.

Each arm is read by :func:`kvlens.analysis.duckdb.inputs.load` (the same reader and validator as
``analyze``: JSON lines, gz, Parquet, directories) into a table of its valid records
numbered in input order, the arm's own records when the file holds several arms. The sameness
check (count, prompt lengths position by position, request ids) is three queries per arm, each
naming the first difference as the numpy engine does. The arms are then joined by position
into one table (``paired``: the baseline's length group and hit, the warm-up, each arm's
request id, tokens, model and latencies; spilled past the memory limit) and every answer
:class:`kvlens.analysis.compare.Paired` asks for is a query on it: exact integer sums for
reuse and modelled work, exact order statistics for the warm-up's median
(:func:`kvlens.analysis.duckdb.order_statistics.at_ranks`), and, for the paired bootstrap, one group's
values of one metric of two arms at a time, in request order. Python therefore holds at most
two columns of the largest group (16 bytes a request; a group is at most
:data:`kvlens.analysis.compare.MAX_GROUP_REQUESTS`) beside the bootstrap's chunk, and the report
is built by :func:`kvlens.analysis.compare.build`, the numpy engine's code, so the two agree
field by field (tests/unit/test_compare_engines.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvlens import definitions, reduce_sql, sqltext, stats
from kvlens.accounting import Accounting
from kvlens.analysis import compare, per_request
from kvlens.analysis.duckdb import inputs, order_statistics
from kvlens.analysis.duckdb.engine import Engine, engine_errors
from kvlens.analysis.report import Cell, Key, totals_of
from kvlens.definitions import Totals, prompt_length_labels
from kvlens.errors import ArmsDiffer, NoRecordsOfArm
from kvlens.limits import DEFAULT_MEMORY_LIMIT

COLUMNS = (*inputs.ANALYSIS_COLUMNS, "request_id", "arm")
_PER_ARM = ("model", "prompt_tokens", "cached_tokens", *compare.METRICS)


def compare_files(
    arms: Sequence[tuple[str, str]],
    settings: Accounting,
    *,
    format_name: str | None = None,
    model: str | None = None,
    warmup: int = 0,
    warmup_until: float | None = None,
    seed: int = 0,
    memory_limit: str | None = None,
    percentiles: tuple[float, ...] = stats.DEFAULT_PERCENTILES,
) -> dict[str, Any]:
    """The comparison of ``arms`` (name, records path; the first is the baseline): the report
    :func:`kvlens.analysis.compare.compare` makes of the same records."""
    engine = Engine(memory_limit=memory_limit or DEFAULT_MEMORY_LIMIT)
    try:
        with engine_errors(engine.memory_limit, engine.spill_directory):
            for index, (name, path) in enumerate(arms):
                _load_arm(engine, index, name, path, format_name, model)
            names = [name for name, _ in arms]
            check_same_sequence(engine, names)
            paired = InDuckDB(engine, settings, len(arms), warmup, warmup_until)
            labels = prompt_length_labels(settings.prompt_length_edges)
            return compare.build(paired, names, [path for _, path in arms], labels, seed, percentiles)
    finally:
        engine.close()


def _load_arm(
    engine: Engine, index: int, name: str, path: str, format_name: str | None, model: str | None
) -> None:
    """Table ``arm_<index>``: the valid records of ``path`` (of arm ``name`` only when some
    record names an arm), ``pos`` numbering them from 0 in input order."""
    con = engine.connection
    loaded = inputs.load(engine, [path], columns=COLUMNS, format_name=format_name, model=model)
    ((named,),) = con.execute("SELECT count(arm) FROM records").fetchall()
    columns = ", ".join(COLUMNS)
    if named or (loaded.parquet and loaded.read.skipped_total):
        # gaps in `row` (other arms' records, rejected Parquet rows): number the records anew
        con.execute(
            f"CREATE OR REPLACE TEMP TABLE arm_{index} AS SELECT row_number() OVER (ORDER BY src, row) - 1 "
            f"AS pos, {columns} FROM records {'WHERE arm = $name' if named else ''}",
            {"name": name} if named else {},
        )
    else:
        # `row` counts each file's valid records from 0: a file's offset is the records before
        # it (a join with a table of one row a file, where a window would sort the records)
        counts = con.execute("SELECT src, count(*) FROM records GROUP BY src ORDER BY src").fetchall()
        offsets = np.cumsum([0, *(int(count) for _, count in counts)])[:-1]
        table = {"s": np.array([src for src, _ in counts], dtype=np.int64), "o": offsets.astype(np.int64)}
        con.register("offsets", table)
        try:
            con.execute(
                f"CREATE OR REPLACE TEMP TABLE arm_{index} AS SELECT offsets.o + row AS pos, {columns} "
                "FROM records JOIN offsets ON records.src = offsets.s"
            )
        finally:
            con.unregister("offsets")
    if named:
        ((kept,),) = con.execute(f"SELECT count(*) FROM arm_{index}").fetchall()
        if not kept:
            raise NoRecordsOfArm(compare.no_records_of(path, name))


def check_same_sequence(engine: Engine, names: list[str]) -> None:
    """:func:`kvlens.analysis.compare.check_same_sequence` of the arms' tables."""
    con = engine.connection
    ((base_count,),) = con.execute("SELECT count(*) FROM arm_0").fetchall()
    for index, name in enumerate(names[1:], start=1):
        ((count,),) = con.execute(f"SELECT count(*) FROM arm_{index}").fetchall()
        if count != base_count:
            raise ArmsDiffer(compare.count_differs(name, int(count), names[0], int(base_count)))
        joined = f"FROM arm_0 a JOIN arm_{index} b ON a.pos = b.pos"
        first = con.execute(
            f"SELECT a.pos, b.prompt_tokens, a.prompt_tokens {joined} "
            "WHERE a.prompt_tokens <> b.prompt_tokens ORDER BY a.pos LIMIT 1"
        ).fetchall()
        if first:
            ((position, prompt, base_prompt),) = first
            raise ArmsDiffer(
                compare.prompt_differs(name, names[0], int(position), int(prompt), int(base_prompt))
            )
        first = con.execute(
            f"SELECT b.request_id, a.request_id {joined} WHERE a.request_id <> b.request_id "
            "ORDER BY a.pos LIMIT 1"  # <> is NULL, not true, where either is NULL
        ).fetchall()
        if first:
            ((request_id, base_id),) = first
            raise ArmsDiffer(compare.id_differs(name, names[0], request_id, base_id))


class InDuckDB:
    """:class:`kvlens.analysis.compare.Paired` of the arms' tables, joined by position into
    ``paired`` (the arms' own tables are dropped)."""

    def __init__(
        self, engine: Engine, settings: Accounting, arms: int, warmup: int, warmup_until: float | None
    ) -> None:
        self.engine, self.arms, self.cost_for = engine, arms, settings.cost_model_for
        con = engine.connection
        edges, default = settings.prompt_length_edges, settings.default_model
        keep = ("pos", "arrival_time", "request_id")
        sources = [
            f"({reduce_sql.reduced_sql(f'arm_{i}', edges, default, keep)}) AS a{i}" for i in range(arms)
        ]
        warm = [f"a0.pos < {int(warmup)}"]
        if warmup_until is not None:
            until = f"CAST({sqltext.number(float(warmup_until))} AS DOUBLE)"
            warm += [f"COALESCE(a{i}.arrival_time < {until}, FALSE)" for i in range(arms)]
        columns = [f"a{i}.{name} AS {name}_{i}" for i in range(arms) for name in _PER_ARM]
        columns += [f"a{i}.request_id AS request_id_{i}" for i in range(arms)]
        joins = " ".join(f"JOIN {source} ON a{i}.pos = a0.pos" for i, source in enumerate(sources[1:], 1))
        con.execute(
            "CREATE OR REPLACE TEMP TABLE paired AS SELECT a0.pos AS pos, a0.length_group AS g, "
            f"a0.hit AS hit, ({' OR '.join(warm)}) AS warm, {', '.join(columns)} FROM {sources[0]} {joins}"
        )
        for i in range(arms):
            con.execute(f"DROP TABLE arm_{i}")

    def _rows(self, sql: str, parameters: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        rows: list[tuple[Any, ...]] = self.engine.connection.execute(sql, list(parameters)).fetchall()
        return rows

    def requests(self) -> int:
        ((count,),) = self._rows("SELECT count(*) FROM paired")
        return int(count)

    def groups(self) -> list[tuple[int, bool, int]]:
        rows = self._rows(
            "SELECT g, hit, count(*) FROM paired WHERE NOT warm GROUP BY g, hit ORDER BY g, hit DESC"
        )
        return [(int(g), bool(hit), int(count)) for g, hit, count in rows]

    def values(
        self, length: int, hit: bool, arm: int, metric: str
    ) -> tuple[compare.FloatArray, compare.FloatArray]:
        before, after = f"{metric}_0", f"{metric}_{arm}"
        got = self.engine.connection.execute(
            f"SELECT {before} AS b, {after} AS a FROM paired WHERE NOT warm AND g = ? AND hit = ? "
            f"AND {before} IS NOT NULL AND {after} IS NOT NULL ORDER BY pos",
            [length, hit],
        ).fetchnumpy()
        return np.asarray(got["b"], dtype=np.float64), np.asarray(got["a"], dtype=np.float64)

    def _totals(self, arm: int, where: str, parameters: Sequence[Any] = ()) -> Totals:
        """The arm's totals over the rows of ``where``, from exact sums per model and hit."""
        n, h = f"prompt_tokens_{arm}", f"cached_tokens_{arm}"
        sums = ", ".join(
            reduce_sql.exact_sum(term, in_duckdb=True) for term in (n, h, f"{n} * {n}", f"{h} * {h}")
        )
        cells: dict[Key, Cell] = {}
        for name, hit, count, tokens, cached, squares, cached_squares in self._rows(
            f"SELECT model_{arm}, {h} > 0, count(*), {sums} FROM paired WHERE {where} GROUP BY ALL",
            parameters,
        ):
            tokens, cached = int(tokens), int(cached)
            pairs, cached_pairs = (
                reduce_sql.pairs(tokens, int(squares)),
                reduce_sql.pairs(cached, int(cached_squares)),
            )
            cells[(str(name), 0, bool(hit))] = Cell(int(count), tokens, cached, pairs, cached_pairs)
        return totals_of(cells, self.cost_for)

    def reuse(self, length: int, hit: bool) -> list[Totals]:
        where = "NOT warm AND g = ? AND hit = ?"
        return [self._totals(arm, where, [length, hit]) for arm in range(self.arms)]

    def warmup(self) -> list[tuple[Totals, float | None]]:
        parts = [("ttft_seconds", arm, False) for arm in range(self.arms)]
        series = " UNION ALL ".join(
            f"SELECT CAST({order_statistics.part_key(part)} AS BIGINT) AS k, ttft_seconds_{part[1]} AS v "
            f"FROM paired WHERE warm AND ttft_seconds_{part[1]} IS NOT NULL"
            for part in parts
        )
        keys = {order_statistics.part_key(part): part for part in parts}
        bounds = {
            keys[int(k)]: (int(count), float(low), float(high))
            for k, count, low, high in self._rows(
                f"SELECT k, count(v), min(v), max(v) FROM ({series}) GROUP BY k"
            )
        }
        wanted = {
            part: sorted(set(definitions.quantile_ranks(count, 0.5)[:2]))
            for part, (count, _, _) in bounds.items()
        }
        read = order_statistics.Series(
            sql=lambda where: f"SELECT k AS g, v AS v0 FROM ({series}) AS s", keys=(0,), grouped=(True,)
        )
        found = order_statistics.at_ranks(self.engine, read, wanted, bounds)
        return [
            (
                self._totals(part[1], "warm"),
                compare.median_of(
                    bounds[part][0] if part in bounds else 0,
                    lambda ranks, part=part: [found[(part, rank)] for rank in ranks],  # type: ignore[misc]
                ),
            )
            for part in parts
        ]

    def timed(self, arm: int) -> per_request.Timed:
        """Five columns of the arm's timed requests in Python (about 60 bytes a request with
        its id): the pairing by request_id matches them in memory."""
        got = self.engine.connection.execute(
            f"SELECT request_id_{arm} AS i, g, prompt_tokens_{arm} AS n, cached_tokens_{arm} AS h, "
            f"ttft_seconds_{arm} AS t FROM paired WHERE NOT warm ORDER BY pos"
        ).fetchnumpy()
        ids = got["i"]
        return per_request.Timed(
            [None if value is None or value is np.ma.masked else str(value) for value in ids.tolist()],
            np.asarray(got["g"], dtype=np.intp),
            np.asarray(got["n"], dtype=np.int64),
            np.asarray(got["h"], dtype=np.int64),
            np.ma.filled(np.ma.asarray(got["t"], dtype=np.float64), np.nan),
        )

    def not_benefiting(self, arm: int) -> tuple[int, int, int, list[dict[str, Any]]]:
        before, after, cached = "ttft_seconds_0", f"ttft_seconds_{arm}", f"cached_tokens_{arm}"
        comparable = f"NOT warm AND {before} IS NOT NULL AND {after} IS NOT NULL"
        ((worse, count, reused_nothing),) = self._rows(
            f"SELECT count(*) FILTER (WHERE {after} >= {before}), count(*), "
            f"count(*) FILTER (WHERE {after} >= {before} AND {cached} = 0) FROM paired WHERE {comparable}"
        )
        examples = [
            compare.example(int(pos), request_id, int(n), int(h), float(b), float(a))
            for pos, request_id, n, h, b, a in self._rows(
                f"SELECT pos, request_id_{arm}, prompt_tokens_{arm}, {cached}, {before}, {after} FROM paired "
                f"WHERE {comparable} AND {after} >= {before} ORDER BY pos LIMIT 10"
            )
        ]
        return int(worse or 0), int(count), int(reused_nothing or 0), examples
