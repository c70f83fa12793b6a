"""Shared by the dashboard tests: the panels' queries, with Grafana's variables substituted."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DASHBOARDS = sorted((ROOT / "dashboards").glob("*.json"))

# How Grafana would fill the variables for a 5-minute view with every variable on "All": `.*`,
# which also matches the labels a single Prometheus does not have (cluster, namespace).
SUBSTITUTIONS = {
    "$__rate_interval": "1m",
    "$__range_s": "300",
    "$__range": "5m",
    "$__interval": "15s",
    "$cluster": ".*",
    "$namespace": ".*",
    "$job": "kvlens",
    "$instance": ".*",
    "$model": ".*",
}


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())  # type: ignore[no-any-return]


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            yield panel


def concrete(expr: str, substitutions: dict[str, str] = SUBSTITUTIONS) -> str:
    for variable, value in substitutions.items():
        expr = expr.replace(variable, value)
    return expr


def queries(
    dashboard: dict[str, Any], substitutions: dict[str, str] = SUBSTITUTIONS
) -> Iterator[tuple[str, str, str]]:
    """(panel title, raw expression, expression with variables substituted)."""
    for panel in panels(dashboard):
        for target in panel["targets"]:
            yield panel["title"], target["expr"], concrete(target["expr"], substitutions)


def annotation_queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(annotation name, expression with variables substituted) of the Prometheus annotations."""
    for annotation in dashboard["annotations"]["list"]:
        if "expr" in annotation:
            yield annotation["name"], concrete(annotation["expr"])


def variable_queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str, str]]:
    """(variable, label, series selector) of each `label_values(selector, label)` variable,
    substituted: what Grafana asks Prometheus's /api/v1/label/<label>/values with match[]."""
    for variable in dashboard["templating"]["list"]:
        if variable["type"] != "query":
            continue
        found = re.fullmatch(r"label_values\((.+), (\w+)\)", variable["query"])
        assert found, variable["query"]
        yield variable["name"], found[2], concrete(found[1])
