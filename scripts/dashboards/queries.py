"""The dashboards' queries: kvlens.exporter.promql's idioms bound to the dashboards' variables and
windows, on the metric table's names (kvlens.exporter.metrics). No Grafana SDK here.

Selection: every query matches `cluster`, `namespace`, `job` and `instance` with `=~` on the
dashboard's variables (SEL); MODEL adds the model variable for per-model series.
"""

from __future__ import annotations

from kvlens.exporter import promql
from kvlens.exporter.metrics import MetricSpec
from kvlens.exporter.promql import causes, selector

SEL = promql.variables(promql.SIDECAR)
MODEL = promql.variables(promql.LEVELS["instance_model"])
RATE = promql.RATE_INTERVAL  # a time series: per second over the rate interval
RANGE = promql.RANGE  # a stat, a table: over the selected range
SIDECAR = promql.labels(promql.SIDECAR)
LOST = causes(promql.LOST)  # reuse lost to routing or capacity
LOST_OR_NEW = causes(promql.RECOMPUTED)
REUSE = (selector(promql.CACHED_TOKENS, MODEL), selector(promql.PROMPT_TOKENS, MODEL))


def series_of(spec: MetricSpec, matchers: str = SEL) -> str:
    """``metric{selection}``: the metric table's exposed name on the dashboard's variables."""
    return selector(spec.exposed_name, matchers)


def summed(spec: MetricSpec, *by: str, matchers: str = SEL, window: str = RATE) -> str:
    """``sum by (...) (rate(metric{selection}[$__rate_interval]))``."""
    return promql.summed(series_of(spec, matchers), window, by)


def ratio(numerator: str, denominator: str, window: str = RATE, by: str = "") -> str:
    """A ratio of sums over the window (never a mean of ratios)."""
    return promql.ratio(numerator, denominator, window, (by,) if by else ())


def hit_ratio(window: str = RATE, by: str = "") -> str:
    """The request hit ratio; 0 (not absent) where requests arrived and none hit."""
    return promql.hit_ratio(window, (by,) if by else (), MODEL)


def saved(window: str = RATE, by: str = "") -> str:
    """The compute-saved ratio: per model (unit-free), or fleet-wide with a `unit` label."""
    return promql.compute_saved(window, (by,) if by else (), MODEL)


def quantile(
    q: float,
    histogram: MetricSpec,
    selection: str = MODEL,
    window: str = RATE,
    by: tuple[str, ...] = ("prompt_len", "cache"),
) -> str:
    """A latency quantile per model (and by prompt length and hit status)."""
    return promql.quantile(q, histogram, selection, window, by)


def gauge(spec: MetricSpec, by: str, aggregate: str = "sum", matchers: str = SEL) -> str:
    """``sum by (...) (gauge{selection})``: a gauge across the series of each group."""
    return f"{aggregate} by ({by}) ({series_of(spec, matchers)})"
