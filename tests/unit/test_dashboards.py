"""Dashboards: generated (no drift), valid, variables, units, descriptions, known metrics."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest
import yaml

from kvlens.exporter import metrics
from tests.dashboards import DASHBOARDS, ROOT, load, panels, queries


def test_dashboard_json_is_generated_by_the_script() -> None:
    generated = runpy.run_path(str(ROOT / "scripts" / "dashboards.py"))["render"]()
    assert (ROOT / "dashboards" / "kvlens-overview.json").read_text() == generated, (
        "run scripts/dashboards.py"
    )


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_structure(path: Path) -> None:
    dashboard = load(path)
    assert re.fullmatch(r"[a-z0-9-]{1,40}", dashboard["uid"])
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert {"job", "model"} <= set(variables)
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in panels(dashboard):
        assert panel["description"], panel["title"]
        assert panel["fieldConfig"]["defaults"]["unit"], panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"


def known_metrics() -> set[str]:
    names = set()
    for spec in metrics.ALL:
        names.add(spec.exposed_name)
        if spec.kind == "histogram":
            names.update(f"{spec.name}_{suffix}" for suffix in ("bucket", "count", "sum"))
    for path in (ROOT / "deploy" / "prometheus").glob("kvlens-*.yaml"):
        for group in yaml.safe_load(path.read_text())["groups"]:
            names.update(rule["record"] for rule in group["rules"] if "record" in rule)
    return names


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_query_uses_exported_metrics_and_grafana_intervals(path: Path) -> None:
    known = known_metrics()
    for title, expr, _ in queries(load(path)):
        used = set(re.findall(r"\b(?:[a-z_]*:)?kvlens_[a-z0-9_]+(?::[a-z0-9_]+)?\b", expr))
        assert used and used <= known, (title, used - known)
        for window in re.findall(r"\[([^\]]+)\]", expr):
            assert window in ("$__rate_interval", "$__range"), (title, window)


def test_provisioning_files_parse() -> None:
    for path in (ROOT / "dashboards" / "provisioning").glob("*.yaml"):
        assert yaml.safe_load(path.read_text())["apiVersion"] == 1
