"""Shared by the dashboard tests: the panels' queries, with Grafana's variables substituted."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DASHBOARDS = sorted((ROOT / "dashboards").glob("*.json"))

# How Grafana would fill the variables for a 5-minute view of job "kvlens", all models.
SUBSTITUTIONS = {
    "$__rate_interval": "1m",
    "$__range_s": "300",
    "$__range": "5m",
    "$__interval": "15s",
    "$job": "kvlens",
    "$model": ".*",
}


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())  # type: ignore[no-any-return]


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            yield panel


def queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str, str]]:
    """(panel title, raw expression, expression with variables substituted)."""
    for panel in panels(dashboard):
        for target in panel["targets"]:
            expr = target["expr"]
            concrete = expr
            for variable, value in SUBSTITUTIONS.items():
                concrete = concrete.replace(variable, value)
            yield panel["title"], expr, concrete
