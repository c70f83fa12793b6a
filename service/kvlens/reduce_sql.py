"""The SQL twin of :func:`kvlens.reduce.reduce`: the same per-record decisions over a table or
query of records, for the ``duckdb`` engine (:mod:`kvlens.analysis.duckdb`) and the script
``kvlens analyze --print-sql`` prints (:mod:`kvlens.analysis.warehouse`); and the one spelling
of an exact sum of its integer columns.

``tests/unit/test_columnar.py`` and ``tests/unit/test_warehouse.py`` hold the two reducers to
the same report on random record sets.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvlens import definitions, sqltext
from kvlens.reduce import HIT_STRIDE

FIXED = float(definitions.FIXED_POINT_SECONDS)


def reduced_sql(
    source: str,
    edges: Sequence[int],
    default_model: str,
    keep: Sequence[str] = (),
    text: Callable[[str], str] = sqltext.duckdb_text,
) -> str:
    """The per-record decisions of :func:`kvlens.reduce.reduce` over ``source``: the model by
    raw name (``default_model`` when none), hit (``h > 0``), the prompt-length group (the edges
    at or below ``n``: numpy's ``searchsorted(..., side="right")``), the squares that ``C(n)``
    and ``C(h)`` sum from (:func:`pairs`), and the TTFT split with its completeness. ``text``
    writes the default model's literal (:mod:`kvlens.sqltext`: DuckDB's, or the printed
    script's)."""
    group = (
        " + ".join(
            f"CASE WHEN prompt_tokens >= {sqltext.number(int(edge))} THEN 1 ELSE 0 END" for edge in edges
        )
        or "0"
    )
    other = "ttft_seconds - queue_seconds - prefill_seconds"
    complete = "(queue_seconds IS NOT NULL AND prefill_seconds IS NOT NULL AND ttft_seconds IS NOT NULL)"
    return f"""SELECT
  COALESCE(model, {text(default_model)}) AS model,
  prompt_tokens,
  cached_tokens,
  cached_tokens > 0 AS hit,
  {group} AS length_group,
  prompt_tokens * prompt_tokens AS prompt_squares,
  cached_tokens * cached_tokens AS cached_squares,
  ttft_seconds,
  queue_seconds,
  prefill_seconds,
  prefill_seconds / CAST(GREATEST(prompt_tokens - cached_tokens, 1) AS DOUBLE) AS prefill_per_computed_token,
  {complete} AS ttft_complete,
  CASE WHEN {complete} THEN {other} < 0 ELSE FALSE END AS ttft_overlapped,
  CASE WHEN {complete} THEN GREATEST({other}, 0.0) END AS ttft_other{"".join(f", {name}" for name in keep)}
FROM {source}"""


def exact_sum(term: str, *, in_duckdb: bool) -> str:
    """The exact sum of an integer ``term``; each term fits in BIGINT (a square of
    :data:`kvlens.records.MAX_TOKENS` is at most 1e14, a day in :func:`fixed_sum`'s units under
    2^63), their sum may not (a billion 10M-token prompts). Any engine: summed as
    ``DECIMAL(38,0)``. DuckDB (``in_duckdb``) sums BIGINT into HUGEINT (128 bits) on its own,
    exactly, at half the CPU of the cast (measured: 0.26 against 0.49 CPU s for three sums over
    10M rows), so its scans sum the term as it is."""
    return f"SUM({term})" if in_duckdb else f"SUM(CAST({term} AS DECIMAL(38,0)))"


def fixed_sum(seconds: str, *, in_duckdb: bool) -> str:
    """A sum of durations in fixed point (:data:`FIXED` units a second), exact in any engine."""
    return exact_sum(f"CAST(FLOOR({seconds} * {sqltext.number(FIXED)}) AS BIGINT)", in_duckdb=in_duckdb)


def pairs(tokens: int, squares: int) -> int:
    """``sum(n * (n + 1) / 2)`` (what ``C(n)`` sums, :class:`kvlens.analysis.report.Cell`) from
    the exact sums of ``n`` and of :func:`reduced_sql`'s squares."""
    return (squares + tokens) // 2


def pack_hit_sql(prefix: str, hit: str) -> str:
    """:func:`kvlens.reduce.pack_hit` of two SQL expressions (``hit`` a boolean)."""
    return f"({prefix}) * {HIT_STRIDE} + CAST({hit} AS INTEGER)"
