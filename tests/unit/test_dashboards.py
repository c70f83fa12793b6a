"""Dashboards: generated (no drift), valid, variables, units, descriptions, known metrics, and what
an operator needs (per-model latency, per-pod ratios, status colours, links, annotations)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvlens.exporter import metrics
from tests.dashboards import DASHBOARDS, ROOT, load, panels, queries


def test_dashboard_json_is_generated_by_the_script() -> None:
    pytest.importorskip("grafana_foundation_sdk", reason="the dashboard generator needs Python 3.11")
    from scripts.dashboards import DASHBOARDS as GENERATED
    from scripts.dashboards import render

    assert sorted(GENERATED) == [path.name for path in DASHBOARDS]
    for path in DASHBOARDS:
        assert path.read_text() == render(path.name), f"run python -m scripts.dashboards ({path.name})"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_structure(path: Path) -> None:
    dashboard = load(path)
    assert re.fullmatch(r"[a-z0-9-]{1,40}", dashboard["uid"])
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    # Multi-cluster (Thanos, Mimir) in mind: "All" is `.*`, which matches an absent label too.
    for name in ("cluster", "namespace"):
        assert variables[name]["includeAll"] and variables[name]["allValue"] == ".*", name
    # kvlens's jobs and instances, listed: `up{job=~"$job"}` must not count a vLLM target.
    for name in ("job", "instance"):
        assert variables[name]["includeAll"] and "allValue" not in variables[name], name
        assert variables[name]["query"].startswith("label_values(kvlens_build_info"), name
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert dashboard["graphTooltip"] == 1  # shared crosshair
    assert [(link["type"], link["tags"], link["includeVars"]) for link in dashboard["links"]] == [
        ("dashboards", ["kvlens"], True)
    ]
    assert "kvlens" in dashboard["tags"]
    restarts = [
        a for a in dashboard["annotations"]["list"] if "process_start_time_seconds" in a.get("expr", "")
    ]
    assert len(restarts) == 1
    for panel in panels(dashboard):
        assert panel["description"], panel["title"]
        assert panel["fieldConfig"]["defaults"].get("unit"), panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"


def test_both_dashboards_exist_and_link_by_tag() -> None:
    assert {load(path)["uid"] for path in DASHBOARDS} == {"kvlens-overview", "kvlens-sidecar"}


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


def used_metrics(expr: str) -> set[str]:
    return set(re.findall(r"\b(?:[a-z_]*:)?kvlens_[a-z0-9_]+(?::[a-z0-9_]+)?\b", expr))


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_query_uses_exported_metrics_and_grafana_intervals(path: Path) -> None:
    known = known_metrics()
    for title, expr, _ in queries(load(path)):
        used = used_metrics(expr) | ({"up"} if re.search(r"\bup\{", expr) else set())
        assert used and used - {"up"} <= known, (title, used - known)
        for window in re.findall(r"\[([^\]]+)\]", expr):
            assert window in ("$__rate_interval", "$__range"), (title, window)


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_selector_matches_cluster_namespace_job_and_instance(path: Path) -> None:
    """Every series selector narrows to the variables, so a cluster or pod chosen above applies
    to every panel (recording rules at namespace level have no instance to match)."""
    for title, expr, _ in queries(load(path)):
        for name, matchers in re.findall(r"\b([a-z_:]*(?:kvlens_[a-z0-9_:]+|up))\{([^}]*)\}", expr):
            wanted = (
                ["cluster", "namespace"]
                if name.startswith("namespace:")
                else ["cluster", "namespace", "job"] + ([] if name.startswith("namespace_") else ["instance"])
            )
            for label in wanted:
                assert f'{label}=~"${label}"' in matchers, (title, name, label)


def test_latency_quantiles_never_merge_models() -> None:
    """An 8B and a 70B model make no one quantile: every histogram_quantile of a per-model
    histogram sums its buckets by model."""
    per_model = {
        f"{spec.name}_bucket" for spec in metrics.ALL if spec.kind == "histogram" and "model" in spec.labels
    }
    checked = 0
    for path in DASHBOARDS:
        for title, expr, _ in queries(load(path)):
            for grouping, metric in re.findall(
                r"histogram_quantile\([0-9.]+, sum by \(([^)]*)\) \(\w+\((\w+)\{", expr
            ):
                if metric in per_model:
                    checked += 1
                    assert "model" in [label.strip() for label in grouping.split(",")], (title, expr)
    assert checked == 12  # TTFT in the table (4), TTFT, queue, prefill and e2e p50/p95 (8)


def field_unit(panel: dict[str, Any], column: str) -> str:
    unit: str = panel["fieldConfig"]["defaults"]["unit"]
    for override in panel["fieldConfig"]["overrides"]:
        if override["matcher"] == {"id": "byName", "options": column}:
            unit = next((p["value"] for p in override["properties"] if p["id"] == "unit"), unit)
    return unit


def all_panels() -> list[dict[str, Any]]:
    return [panel for path in DASHBOARDS for panel in panels(load(path))]


def test_tables_show_ratios_in_percent_and_every_transform_has_options() -> None:
    tables = [panel for panel in all_panels() if panel["type"] == "table"]
    assert len(tables) == 2
    for panel in tables:
        for transform in panel["transformations"]:
            assert isinstance(transform.get("options"), dict), (panel["title"], transform)
    per_model = next(panel for panel in tables if panel["title"] == "Per model")
    renamed = per_model["transformations"][1]["options"]["renameByName"]
    units = {column: field_unit(per_model, column) for column in renamed.values()}
    assert units == {
        "requests/s": "reqps",
        "request hit": "percentunit",
        "token reuse": "percentunit",
        "compute saved": "percentunit",
    }


def test_stats_are_instant_queries() -> None:
    stats = [panel for panel in all_panels() if panel["type"] == "stat"]
    assert len(stats) == 11
    for panel in stats:
        for target in panel["targets"]:
            assert target["instant"] is True and target["range"] is False, panel["title"]


def test_status_stats_show_a_failure_in_red() -> None:
    """Engine scrape up 0 (and a failing tail checkpoint, an open ingest, an isolation leak) shows
    red, not green."""
    wanted = {
        "Engine scrape": "0",
        "Tail checkpoints": "0",
        "Ingest without a token": "1",
        "Isolation probe verdicts": "0",
    }
    found = {panel["title"]: panel for panel in all_panels() if panel["title"] in wanted}
    assert set(found) == set(wanted)
    for title, failure in wanted.items():
        defaults = found[title]["fieldConfig"]["defaults"]
        options = defaults["mappings"][0]["options"]
        assert options[failure]["color"] == "red", title
        steps = defaults["thresholds"]["steps"]
        colour_at = [
            step["color"] for step in steps if step["value"] is None or step["value"] <= int(failure)
        ][-1]
        assert colour_at == "red", title


def test_time_series_have_legend_tables_and_no_mean_of_ratios() -> None:
    series = [panel for panel in all_panels() if panel["type"] == "timeseries"]
    assert series
    for panel in series:
        legend = panel["options"]["legend"]
        assert legend["displayMode"] == "table" and legend["showLegend"], panel["title"]
        assert "mean" not in legend["calcs"], panel["title"]


def test_per_pod_panels_and_the_series_nobody_could_see() -> None:
    exprs = "\n".join(expr for path in DASHBOARDS for _, expr, _ in queries(load(path)))
    for metric in (
        "instance_model:kvlens_token_reuse_ratio:ratio_rate5m",
        "instance_model:kvlens_request_hit_ratio:ratio_rate5m",
        "kvlens_request_reuse_ratio_bucket",
        "kvlens_e2e_seconds_bucket",
        "kvlens_tail_checkpoint_ok",
        "kvlens_collector_errors_total",
    ):
        assert metric in exprs, metric
    heatmaps = [panel for panel in all_panels() if panel["type"] == "heatmap"]
    assert [panel["targets"][0]["format"] for panel in heatmaps] == ["heatmap"]
    assert heatmaps[0]["options"]["calculate"] is False


def test_provisioning_files_parse() -> None:
    for path in (ROOT / "dashboards" / "provisioning").glob("*.yaml"):
        assert yaml.safe_load(path.read_text())["apiVersion"] == 1


def test_one_unit_per_axis() -> None:
    """A time series' axis has one unit, never `none` (the W4A16 speedup and the weights' share
    once shared an axis as `none`), and no series overrides it onto a second unit."""
    for panel in all_panels():
        if panel["type"] != "timeseries":
            continue
        assert panel["fieldConfig"]["defaults"]["unit"] != "none", panel["title"]
        for override in panel["fieldConfig"]["overrides"]:
            assert all(p["id"] != "unit" for p in override["properties"]), panel["title"]


def row_panels(dashboard: dict[str, Any], row: str) -> list[dict[str, Any]]:
    """The panels under the row titled ``row``, up to the next row."""
    found: list[dict[str, Any]] | None = None
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            if found is not None:
                break
            if panel["title"] == row:
                found = []
        elif found is not None:
            found.append(panel)
    assert found is not None, row
    return found


def test_modelled_causes_are_on_the_why_row_marked_and_apart() -> None:
    """The causes without KV events (records' prefix_hashes through modelled caches) sit on the
    "Why reuse is lost" row, every panel that reads them says modelled in its title and
    description, and no query mixes them with the observed family (a model is not a measure)."""
    overview = load(ROOT / "dashboards" / "kvlens-overview.json")
    row = row_panels(overview, "Why reuse is lost (KV events, or modelled)")
    modelled = {spec.exposed_name for spec in metrics.KV_MODELLED}
    shown: set[str] = set()
    for panel in row:
        exprs = [target["expr"] for target in panel["targets"]]
        used = set().union(*(used_metrics(expr) for expr in exprs))
        if used & modelled:
            assert "(modelled" in panel["title"], panel["title"]
            assert "modelled" in panel["description"].lower(), panel["title"]
            assert not any("kvlens_kv_recomputed_tokens_total" in expr for expr in exprs), panel["title"]
            shown |= used & modelled
        else:
            assert "modelled" not in panel["title"], panel["title"]
    assert shown == modelled
    # Nowhere else: the modelled family appears on this row only.
    elsewhere = [
        title
        for path in DASHBOARDS
        for title, expr, _ in queries(load(path))
        if used_metrics(expr) & modelled and title not in {panel["title"] for panel in row}
    ]
    assert elsewhere == []
