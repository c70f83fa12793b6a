"""``kvlens analyze --print-sql``: the reducer and the report's queries as portable SQL, for a
warehouse or a distributed engine (Spark SQL, Trino, DataFusion, DuckDB) over a table
``records`` with the record's columns; and ``kvlens analyze --from-aggregates``: their results
turned into the report.

The records are reduced by the view the duckdb engine scans (:mod:`kvlens.reduce_sql` builds
both) and summed by its spelling of an exact sum in any engine: ``DECIMAL(38,0)``, durations
summed in fixed point; order statistics by ``ROW_NUMBER()``, returned a few ranks either side
of each wanted one so that the report's quantile (numpy's type 7,
:func:`kvlens.definitions.quantile_ranks`) can be taken from them exactly whatever the engine's
decimal or float arithmetic. Cost models are a VALUES list.

Every result row starts with a ``query`` column naming its statement, so the results can be
saved as one file or several, as CSV with a header row or as JSON lines, in any order: the
reader sorts the rows out by that column.
"""

from __future__ import annotations

import csv
import decimal
import io
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvlens import definitions, reduce_sql, sqltext, stats
from kvlens.accounting import Accounting
from kvlens.analysis import report
from kvlens.errors import InputError

DEFAULT_COST = "*"  # the cost model of every name not in the list
# The statements' `query` names (`work` is for reading in the warehouse, not needed here).
QUERIES = ("cells", "decomposition", "order_statistics", "slowest", "prefill", "work")
SERIES = (*report.LATENCY_COLUMNS, "prefill_per_computed_token")
MARGIN = 2  # ranks returned either side of a wanted one


def _near(fraction: float, count: str, rank: str) -> str:
    """``rank`` within :data:`MARGIN` of the ``fraction`` quantile's lower rank of ``count``
    values (wide enough for any engine's rounding of ``(count - 1) * fraction``)."""
    low = f"FLOOR(({count} - 1) * {sqltext.number(fraction)})"
    return f"({rank} BETWEEN {low} - {MARGIN - 1} AND {low} + {MARGIN})"


def cells_sql(reduced: str) -> str:
    """Exact sums per (model, length group, hit)."""
    return f"""SELECT model, length_group, hit,
  COUNT(*) AS requests,
  {_exact("prompt_tokens")} AS prompt_tokens,
  {_exact("cached_tokens")} AS cached_tokens,
  {_exact("prompt_squares")} AS prompt_squares,
  {_exact("cached_squares")} AS cached_squares
FROM ({reduced}) AS reduced_rows GROUP BY model, length_group, hit"""


def decomposition_sql(reduced: str) -> str:
    return f"""SELECT COUNT(*) AS requests,
  SUM(CASE WHEN ttft_overlapped THEN 1 ELSE 0 END) AS overlapped,
  {_fixed("queue_seconds")} AS queue, {_fixed("prefill_seconds")} AS prefill, {_fixed("ttft_other")} AS other
FROM ({reduced}) AS reduced_rows WHERE ttft_complete"""


def _exact(column: str) -> str:
    return reduce_sql.exact_sum(column, in_duckdb=False)


def _fixed(column: str) -> str:
    return reduce_sql.fixed_sum(column, in_duckdb=False)


def cost_models_sql(
    names: Sequence[str], cost_for: Callable[[str], definitions.CostModel], text: Callable[[str], str]
) -> str:
    """The cost models of ``names`` as a VALUES list, text written by ``text``
    (:mod:`kvlens.sqltext`)."""
    rows = []
    for name in names:
        cost = cost_for(name)
        rows.append(f"({text(name)}, {sqltext.number(cost.a)}, {sqltext.number(cost.b)}, {text(cost.unit)})")
    return "(VALUES " + ", ".join(rows) + ") AS cost_models(model, a, b, unit)"


def _portable(what: str) -> Callable[[str], str]:
    return lambda value: sqltext.portable_text(value, what)


def script(settings: Accounting) -> str:
    """The statements, every literal written by :mod:`kvlens.sqltext` for any dialect:
    a name from the settings that no dialect-neutral literal can hold is refused
    (:class:`~kvlens.errors.SettingsError`), never printed."""
    text = _portable("the SQL's text")
    default_model = sqltext.portable_text(settings.default_model, "default_model")
    reduced = reduce_sql.reduced_sql(
        "records", settings.prompt_length_edges, settings.default_model, text=_portable("default_model")
    )
    names = sorted({*settings.cost_models, *settings.model_shapes})
    costs = cost_models_sql(
        [*names, DEFAULT_COST],
        lambda name: (
            settings.default_cost_model.to_cost_model()
            if name == DEFAULT_COST
            else settings.cost_model_for(name)
        ),
        _portable("model name (cost_models, model_shapes)"),
    )
    cells = cells_sql("SELECT * FROM reduced")
    fractions = sorted({q / 100 for q in stats.QUANTILES} | {0.5, 1 - report.SLOWEST_SHARE})
    near = " OR ".join(_near(fraction, "c", "r") for fraction in fractions)
    ranked = " UNION ALL ".join(
        f"SELECT {text(name)} AS series, length_group AS g, hit, {name} AS v "
        f"FROM reduced WHERE {name} IS NOT NULL"
        for name in SERIES
    )
    ranked += (
        f" UNION ALL SELECT {text('all_ttft')}, -1, FALSE, ttft_seconds FROM reduced "
        "WHERE ttft_seconds IS NOT NULL"
    )
    slowest_rank = _near(1 - report.SLOWEST_SHARE, "c", "r")
    return f"""-- kvlens analyze --print-sql: the reducer over a table `records` (one row a request, the
-- columns of the kvlens record, only records kvlens accepts: the bounds are not checked here).
-- Run each statement; save the results (CSV with a header row, or JSON lines; one file or
-- several) and turn them into the report with: kvlens analyze --from-aggregates FILE...
-- (the same --config). prompt_length_edges: {settings.prompt_length_edges}; default model:
-- {default_model}

CREATE VIEW reduced AS
{reduced};

-- 1. cells: exact sums per (model, length group, hit). C(n) summed = a*prompt_tokens +
--    b*(prompt_squares + prompt_tokens)/2 with the model's cost model (query 2).
SELECT 'cells' AS query, cells.* FROM ({cells}) cells;

-- 2. modelled work per unit (a model not in the list takes the {text(DEFAULT_COST)} row); not
--    needed by --from-aggregates, which computes it from the cells.
SELECT 'work' AS query, COALESCE(named.unit, fallback.unit) AS unit,
  SUM(COALESCE(named.a, fallback.a) * CAST(c.prompt_tokens AS DOUBLE)
      + COALESCE(named.b, fallback.b) * CAST((c.prompt_squares + c.prompt_tokens) / 2 AS DOUBLE))
    AS prompt_work,
  SUM(COALESCE(named.a, fallback.a) * CAST(c.cached_tokens AS DOUBLE)
      + COALESCE(named.b, fallback.b) * CAST((c.cached_squares + c.cached_tokens) / 2 AS DOUBLE))
    AS reused_work
FROM ({cells}) c
LEFT JOIN {costs.replace("cost_models", "named")} ON named.model = c.model
CROSS JOIN (SELECT * FROM {costs} WHERE cost_models.model = {text(DEFAULT_COST)}) fallback
GROUP BY COALESCE(named.unit, fallback.unit);

-- 3. TTFT decomposition, durations in units of 2^-40 s.
SELECT 'decomposition' AS query, d.* FROM ({decomposition_sql("SELECT * FROM reduced")}) d;

-- 4. order statistics near every wanted rank (c values in the part, r the 0-based rank).
SELECT 'order_statistics' AS query, series, g, hit, c, r, v FROM (
  SELECT series, g, hit, v,
    ROW_NUMBER() OVER (PARTITION BY series, g, hit ORDER BY v) - 1 AS r,
    COUNT(*) OVER (PARTITION BY series, g, hit) AS c
  FROM ({ranked}) s
) ranked
WHERE {near}
ORDER BY series, g, hit, r;

-- 5. the slowest {report.SLOWEST_SHARE:.0%}: per group, the requests with TTFT at or above each value
--    near the threshold's ranks (the report picks the one at the threshold).
SELECT 'slowest' AS query, reduced.length_group AS g, reduced.hit, t.v, COUNT(*) AS c
FROM reduced JOIN (
  SELECT DISTINCT v FROM (
    SELECT ttft_seconds AS v, ROW_NUMBER() OVER (ORDER BY ttft_seconds) - 1 AS r, COUNT(*) OVER () AS c
    FROM reduced WHERE ttft_seconds IS NOT NULL
  ) ranked_ttft WHERE {slowest_rank}
) t ON reduced.ttft_seconds >= t.v
GROUP BY reduced.length_group, reduced.hit, t.v;

-- 6. per group, the requests with a prefill time.
SELECT 'prefill' AS query, length_group AS g, hit, COUNT(*) AS requests,
  SUM(CAST(prompt_tokens AS DECIMAL(38,0))) AS prompt_tokens,
  SUM(CAST(cached_tokens AS DECIMAL(38,0))) AS cached_tokens
FROM reduced WHERE prefill_seconds IS NOT NULL GROUP BY length_group, hit;
"""


# ---------------------------------------------------------------------------------------------
# --from-aggregates


def read_aggregates(paths: Sequence[Path]) -> dict[str, list[tuple[str, dict[str, Any]]]]:
    """The result rows of ``paths`` by statement (the ``query`` column), each with where it was
    read (``file line N``). A file is JSON lines when its first character is ``{``, else CSV
    with a header row."""
    rows: dict[str, list[tuple[str, dict[str, Any]]]] = {name: [] for name in QUERIES}
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise InputError(f"{path}: cannot read the aggregates: {error}") from None
        if text.lstrip().startswith("{"):
            numbered = []
            for number, line in enumerate(text.splitlines(), start=1):
                if line.strip():
                    try:
                        value = json.loads(line)
                    except ValueError as error:
                        raise InputError(f"{path} line {number}: not JSON: {error}") from None
                    if not isinstance(value, dict):
                        raise InputError(f"{path} line {number}: a row must be a JSON object")
                    numbered.append((number, value))
        else:
            numbered = list(enumerate(csv.DictReader(io.StringIO(text)), start=2))
        for number, row in numbered:
            where = f"{path} line {number}"
            query = row.get("query")
            if query not in rows:
                raise InputError(
                    f"{where}: the `query` column is {query!r}, not one of {', '.join(QUERIES)} "
                    "(save the results of the statements kvlens analyze --print-sql prints)"
                )
            rows[query].append((where, row))
    for name in ("cells", "decomposition"):
        _needed(rows, name, paths)
    return rows


def _needed(rows: dict[str, list[Any]], name: str, paths: Sequence[Path]) -> None:
    if not rows[name]:
        raise InputError(
            f"no result rows of the statement `{name}` in {', '.join(map(str, paths))}: save every "
            "statement's result (cells is empty only when there are no records: nothing to report)"
        )


def _value(where: str, row: dict[str, Any], column: str) -> Any:
    if column not in row:
        raise InputError(f"{where}: no column {column!r}")
    value = row[column]
    return None if value == "" else value


def _integer(where: str, row: dict[str, Any], column: str) -> int:
    value = _value(where, row, column)
    if value is None:
        return 0  # an engine's SUM over no row
    try:
        number = decimal.Decimal(str(value))  # a DECIMAL(38,0) may come as "12", 12 or 12.0
    except decimal.InvalidOperation:
        number = decimal.Decimal("NaN")
    if isinstance(value, bool) or not number.is_finite() or number != number.to_integral_value():
        raise InputError(f"{where}: column {column!r} is {value!r}, not an integer")
    return int(number)


def _float(where: str, row: dict[str, Any], column: str) -> float:
    value = _value(where, row, column)
    try:
        return float(value)
    except (TypeError, ValueError):
        raise InputError(f"{where}: column {column!r} is {value!r}, not a number") from None


def _boolean(where: str, row: dict[str, Any], column: str) -> bool:
    value = _value(where, row, column)
    text = str(value).lower()
    if text in ("true", "t", "1"):
        return True
    if text in ("false", "f", "0"):
        return False
    raise InputError(f"{where}: column {column!r} is {value!r}, not true or false")


Part = tuple[str, int, bool]


def summary_from(
    rows: dict[str, list[tuple[str, dict[str, Any]]]], paths: Sequence[Path] = ()
) -> report.Summary:
    """The :class:`kvlens.analysis.report.Summary` of a warehouse's results (:func:`read_aggregates`
    of ``paths``). A statement whose rows must exist when another's do is checked: a file left
    out is an error, never a report with a section missing."""
    cells: dict[report.Key, report.Cell] = {}
    for where, row in rows["cells"]:
        n, h = _integer(where, row, "prompt_tokens"), _integer(where, row, "cached_tokens")
        n2, h2 = _integer(where, row, "prompt_squares"), _integer(where, row, "cached_squares")
        key = (
            str(_value(where, row, "model")),
            _integer(where, row, "length_group"),
            _boolean(where, row, "hit"),
        )
        cells[key] = report.Cell(_integer(where, row, "requests"), n, h, (n2 + n) // 2, (h2 + h) // 2)
    (where, row), *more = rows["decomposition"]
    if more:
        raise InputError(f"{more[0][0]}: the decomposition is one row; this is a second")
    decomposition = report.Decomposition(
        *(_integer(where, row, column) for column in ("requests", "overlapped", "queue", "prefill", "other"))
    )
    if decomposition.requests:  # requests with a TTFT: the order statistics cannot be empty
        _needed(rows, "order_statistics", paths)
    values: dict[Part, dict[int, float]] = {}
    counts: dict[Part, int] = {}
    for where, row in rows["order_statistics"]:
        part = (str(_value(where, row, "series")), _integer(where, row, "g"), _boolean(where, row, "hit"))
        values.setdefault(part, {})[_integer(where, row, "r")] = _float(where, row, "v")
        counts[part] = _integer(where, row, "c")

    def pick(part: Part) -> Any:
        def ranks(wanted: list[int]) -> list[float]:
            absent = [rank for rank in wanted if rank not in values[part]]
            if absent:
                raise InputError(
                    f"the order statistics of {part} lack rank(s) {absent}: run the printed SQL unchanged"
                )
            return [values[part][rank] for rank in wanted]

        return ranks

    groups = sorted({(key[1], key[2]) for key in cells})
    latency = {
        group: {
            name: stats.percentiles_of(counts.get((name, *group), 0), pick((name, *group)))
            for name in report.LATENCY_COLUMNS
        }
        for group in groups
    }
    threshold = None
    slowest: dict[report.Group, int] = {}
    everything = ("all_ttft", -1, False)
    if everything in counts:
        _needed(rows, "slowest", paths)
        (threshold,) = definitions.quantiles(
            counts[everything], (1 - report.SLOWEST_SHARE,), pick(everything)
        )
        # No TTFT lies strictly between two neighbouring order statistics, so the requests at or
        # above the threshold are those at or above the first value near it that is not below it.
        near = {_float(where, row, "v") for where, row in rows["slowest"]}
        at = min((value for value in near if value >= threshold), default=None)
        if at is None:
            raise InputError(f"the slowest rows hold no value at or above the threshold {threshold!r}")
        for where, row in rows["slowest"]:
            if _float(where, row, "v") == at:
                slowest[(_integer(where, row, "g"), _boolean(where, row, "hit"))] = _integer(where, row, "c")
    prefill: dict[report.Group, report.PrefillGroup] = {}
    if any(part[0] == "prefill_seconds" for part in counts):
        _needed(rows, "prefill", paths)
    for where, row in rows["prefill"]:
        group = (_integer(where, row, "g"), _boolean(where, row, "hit"))
        seconds_part: Part = ("prefill_seconds", *group)
        (median,) = definitions.quantiles(counts[seconds_part], (0.5,), pick(seconds_part))
        per_token_part: Part = ("prefill_per_computed_token", *group)
        (per_token,) = definitions.quantiles(counts[per_token_part], (0.5,), pick(per_token_part))
        prefill[group] = report.PrefillGroup(
            _integer(where, row, "requests"),
            _integer(where, row, "prompt_tokens"),
            _integer(where, row, "cached_tokens"),
            median,
            per_token,
        )
    return report.Summary(cells, latency, decomposition, threshold, slowest, dict(sorted(prefill.items())))
