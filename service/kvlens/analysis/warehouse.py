"""``kvlens analyze --print-sql``: the reducer and the report's queries as portable SQL, for a
warehouse or a distributed engine (Spark SQL, Trino, DataFusion, DuckDB) over a table
``records`` with the record's columns.

The statements are the ones the duckdb engine runs (:mod:`kvlens.analysis.columnar` builds
both): exact sums as ``DECIMAL(38,0)``, durations summed in fixed point, and order statistics
by ``ROW_NUMBER()``, returned a few ranks either side of each wanted one so that the report's
quantile (numpy's type 7, :func:`kvlens.definitions.quantile_ranks`) can be taken from them
exactly whatever the engine's decimal or float arithmetic. Cost models are a VALUES list.
"""

from __future__ import annotations

from kvlens.analysis import columnar, report
from kvlens.config import Settings

DEFAULT_COST = "*"  # the cost model of every name not in the list


def script(settings: Settings) -> str:
    reduced = columnar.reduced_sql("records", settings.prompt_length_edges, settings.default_model)
    names = sorted({*settings.cost_models, *settings.model_shapes})
    costs = columnar.cost_models_sql(
        [*names, DEFAULT_COST],
        lambda name: (
            settings.default_cost_model.to_cost_model()
            if name == DEFAULT_COST
            else settings.cost_model_for(name)
        ),
    )
    cells = columnar.cells_sql("SELECT * FROM reduced")
    fractions = sorted({q / 100 for q in report.QUANTILES} | {0.5, 1 - report.SLOWEST_SHARE})
    near = " OR ".join(
        f"(r BETWEEN FLOOR((c - 1) * {fraction!r}) - 1 AND FLOOR((c - 1) * {fraction!r}) + 2)"
        for fraction in fractions
    )
    ranked = " UNION ALL ".join(
        f"SELECT '{name}' AS series, length_group AS g, hit, {name} AS v "
        f"FROM reduced WHERE {name} IS NOT NULL"
        for name in (*report.LATENCY_COLUMNS, "prefill_per_computed_token")
    )
    ranked += (
        " UNION ALL SELECT 'all_ttft', -1, FALSE, ttft_seconds FROM reduced WHERE ttft_seconds IS NOT NULL"
    )
    return f"""-- kvlens analyze --print-sql: the reducer over a table `records` (one row a request, the
-- columns of the kvlens record). Run each statement; save each result as CSV for the report.
-- prompt_length_edges: {settings.prompt_length_edges}; default model: {settings.default_model!r}

CREATE VIEW reduced AS
{reduced};

-- 1. cells: exact sums per (model, length group, hit). C(n) summed = a*prompt_tokens +
--    b*(prompt_squares + prompt_tokens)/2 with the model's cost model (query 2).
{cells};

-- 2. modelled work per unit (a model not in the list takes the '{DEFAULT_COST}' row).
SELECT COALESCE(named.unit, fallback.unit) AS unit,
  SUM(COALESCE(named.a, fallback.a) * CAST(c.prompt_tokens AS DOUBLE)
      + COALESCE(named.b, fallback.b) * CAST((c.prompt_squares + c.prompt_tokens) / 2 AS DOUBLE))
    AS prompt_work,
  SUM(COALESCE(named.a, fallback.a) * CAST(c.cached_tokens AS DOUBLE)
      + COALESCE(named.b, fallback.b) * CAST((c.cached_squares + c.cached_tokens) / 2 AS DOUBLE))
    AS reused_work
FROM ({cells}) c
LEFT JOIN {costs.replace("cost_models", "named")} ON named.model = c.model
CROSS JOIN (SELECT * FROM {costs} WHERE cost_models.model = '{DEFAULT_COST}') fallback
GROUP BY COALESCE(named.unit, fallback.unit);

-- 3. TTFT decomposition, durations in units of 2^-40 s.
{columnar.decomposition_sql("SELECT * FROM reduced")};

-- 4. order statistics near every wanted rank (c values in the part, r the 0-based rank).
SELECT series, g, hit, c, r, v FROM (
  SELECT series, g, hit, v,
    ROW_NUMBER() OVER (PARTITION BY series, g, hit ORDER BY v) - 1 AS r,
    COUNT(*) OVER (PARTITION BY series, g, hit) AS c
  FROM ({ranked}) s
) ranked
WHERE {near}
ORDER BY series, g, hit, r;
"""
