"""The report's percentiles (QUANTILES, exact, linear between order statistics) are owned by
kvlens.stats, below the analysis and the simulator that both show them."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np

from kvlens import stats

PACKAGE = Path(__file__).resolve().parents[2] / "service" / "kvlens"


def test_stats_owns_the_report_percentiles() -> None:
    assert stats.QUANTILES == (50, 95, 99)
    values = np.array([4.0, np.nan, 1.0, 3.0, 2.0])
    assert stats.percentiles(values) == {
        "count": 4,
        "p50": 2.5,
        "p95": 3.8499999999999996,
        "p99": 3.9699999999999998,
    }
    assert stats.percentiles(np.array([np.nan])) == {"count": 0, "p50": None, "p95": None, "p99": None}


MOVED = {"percentiles", "percentiles_of", "QUANTILES"}


def test_no_module_takes_them_from_the_report() -> None:
    borrowed = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "kvlens.analysis.report":
                taken = {alias.name for alias in node.names} & MOVED
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                taken = {node.attr} & MOVED if node.value.id == "report" else set()
            else:
                continue
            borrowed += [f"{path.relative_to(PACKAGE)}: {name}" for name in sorted(taken)]
    assert borrowed == []


def test_a_requests_inter_token_latency_is_computed_once() -> None:
    """The record's client_itl_p50/p99 (the replay client's, an imported benchmark's) come from
    stats.itl_percentiles, not from a quantile call of each source's own."""
    assert stats.itl_percentiles([0.03, 0.01, 0.02]) == {
        "client_itl_p50_seconds": 0.02,
        "client_itl_p99_seconds": 0.0298,
    }
    assert stats.itl_percentiles([]) == {}
    spelled = [
        f"{path.relative_to(PACKAGE)}:{number}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "stats.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "(0.5, 0.99)" in line
    ]
    assert spelled == []
