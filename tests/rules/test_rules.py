"""Recording and alert rules: promtool checks and unit tests, and every alert's metadata."""

from __future__ import annotations

import re
import runpy
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.dashboards import load, queries

ROOT = Path(__file__).resolve().parent.parent.parent
RULE_FILES = sorted((ROOT / "deploy" / "prometheus").glob("kvlens-*.yaml"))
pytestmark = pytest.mark.integration


def test_promtool_check_rules(promtool: str) -> None:
    checked = subprocess.run(
        [promtool, "check", "rules", *map(str, RULE_FILES)], capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_promtool_unit_tests(promtool: str) -> None:
    tested = subprocess.run(
        [promtool, "test", "rules", str(ROOT / "tests" / "rules" / "kvlens-rules.test.yaml")],
        capture_output=True,
        text=True,
    )
    assert tested.returncode == 0, tested.stdout + tested.stderr


def all_rules() -> list[dict[str, object]]:
    return [
        rule
        for path in RULE_FILES
        for group in yaml.safe_load(path.read_text())["groups"]
        for rule in group["rules"]
    ]


def prometheusrule() -> dict[str, Any]:
    return runpy.run_path(str(ROOT / "scripts" / "prometheusrule.py"))


def test_every_alert_has_severity_summary_description_and_a_runbook_section() -> None:
    runbook = (ROOT / "RUNBOOK.md").read_text()
    anchors = {
        re.sub(r"[^a-z0-9-]", "", title.lower().replace(" ", "-"))
        for title in re.findall(r"^## (.+)$", runbook, re.M)
    }
    alerts = [rule for rule in all_rules() if "alert" in rule]
    assert len(alerts) == 21
    for rule in alerts:
        labels, annotations = rule["labels"], rule["annotations"]
        assert isinstance(labels, dict) and isinstance(annotations, dict)
        assert labels["severity"] in ("info", "warning", "critical"), rule["alert"]
        assert annotations["summary"] and annotations["description"], rule["alert"]
        name = str(rule["alert"])
        assert (
            annotations["runbook_url"]
            == f"https://github.com/kvlens/kvlens/blob/main/RUNBOOK.md#{name.lower()}"
        )
        assert name.lower() in anchors, f"RUNBOOK.md has no section {name}"


def test_alert_rules_and_prometheusrule_are_generated_by_the_script() -> None:
    script = prometheusrule()
    assert (ROOT / "deploy" / "prometheus" / "kvlens-alerts.yaml").read_text() == script["render_alerts"](), (
        "run scripts/prometheusrule.py"
    )
    assert (ROOT / "deploy" / "kubernetes" / "prometheusrule.yaml").read_text() == script["render"](), (
        "run scripts/prometheusrule.py"
    )


def test_runbook_url_pattern_is_a_setting(tmp_path: Path) -> None:
    script = prometheusrule()
    script["main"](
        ["--runbook-url-pattern", "https://wiki.example.com/kvlens/{alert}", "--out", str(tmp_path)]
    )
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "kvlens-alerts.yaml",
        "kvlens-rules.yaml",
        "prometheusrule.yaml",
    ]
    for name in ("kvlens-alerts.yaml", "prometheusrule.yaml"):
        document = yaml.safe_load((tmp_path / name).read_text())
        groups = document["groups"] if "groups" in document else document["spec"]["groups"]
        urls = {
            rule["alert"]: rule["annotations"]["runbook_url"]
            for group in groups
            for rule in group["rules"]
            if "alert" in rule
        }
        assert len(urls) == 21
        assert all(url == f"https://wiki.example.com/kvlens/{alert}" for alert, url in urls.items()), urls
    # The checkout's own files are untouched by --out.
    test_alert_rules_and_prometheusrule_are_generated_by_the_script()
    with pytest.raises(SystemExit):
        script["main"](["--runbook-url-pattern", "https://wiki.example.com/kvlens", "--out", str(tmp_path)])


def test_every_recording_rule_is_used_by_an_alert_or_a_dashboard() -> None:
    """Directly, or through another recording rule that is."""
    rules = {str(rule["record"]): str(rule["expr"]) for rule in all_rules() if "record" in rule}

    def uses(text: str, name: str) -> bool:
        return re.search(rf"(?<![a-z_:]){re.escape(name)}(?![a-z0-9_:])", text) is not None

    users = "\n".join(
        [str(rule["expr"]) for rule in all_rules() if "alert" in rule]
        + [path.read_text() for path in sorted((ROOT / "dashboards").glob("*.json"))]
    )
    used = {name for name in rules if uses(users, name)}
    while grown := {name for name in rules if name not in used and any(uses(rules[u], name) for u in used)}:
        used |= grown
    unused = sorted(set(rules) - used)
    assert not unused, f"used by no alert and no dashboard: {unused}"


def test_recording_rules_keep_the_labels_that_route_and_select() -> None:
    """Every aggregation keeps cluster, namespace and job; instance-level ones keep instance too."""
    for rule in all_rules():
        if "record" not in rule:
            continue
        groupings = re.findall(r"by \(([^)]*)\)", str(rule["expr"]))
        assert groupings, rule["record"]
        for grouping in groupings:
            labels = {label.strip() for label in grouping.split(",")}
            assert (
                {"cluster", "namespace"}
                if str(rule["record"]).startswith("namespace:")
                else {"cluster", "namespace", "job"}
            ) <= labels, (rule["record"], grouping)
            if str(rule["record"]).startswith("instance"):
                assert "instance" in labels, (rule["record"], grouping)


def test_every_alert_and_recording_rule_is_unit_tested() -> None:
    tests = (ROOT / "tests" / "rules" / "kvlens-rules.test.yaml").read_text()
    for rule in all_rules():
        name = str(rule.get("alert") or rule.get("record"))
        if "alert" in rule:
            firing = re.search(rf"alertname: {name}\n\s+exp_alerts:\n\s+- exp_labels", tests)
            quiet = re.search(rf"alertname: {name}\n\s+exp_alerts: \[\]", tests)
            assert firing and quiet, f"{name} needs a firing and a quiet case"
        else:
            assert f"expr: {name}\n" in tests, f"{name} needs an expression test"


def test_recording_rule_names_follow_level_metric_operation() -> None:
    for rule in all_rules():
        if "record" in rule:
            assert re.fullmatch(r"[a-z_]*:kvlens_[a-z_]+:[a-z0-9_]+", str(rule["record"])), rule["record"]


def fleet_rejecting_test(pods: int, broken: int) -> dict[str, object]:
    """A promtool test: ``pods`` sidecars receive 100 records a minute; pod ``broken`` rejects all."""
    series = []
    for pod in range(pods):
        labels = (
            f'namespace="llm",job="kvlens",instance="10.0.{pod // 250}.{pod % 250}:9433",source="vllm_plugin"'
        )
        series.append({"series": f"kvlens_records_received_total{{{labels}}}", "values": "0+100x30"})
        rejected = "0+100x30" if pod == broken else "0x30"
        series.append(
            {"series": f'kvlens_records_rejected_total{{{labels},reason="out_of_range"}}', "values": rejected}
        )
    return {"interval": "1m", "input_series": series}


def test_records_rejected_fires_for_one_sidecar_in_200(promtool: str, tmp_path: Path) -> None:
    """Fleet-wide the broken sidecar is 0.5 % of the records (under the 1 % threshold); per
    instance it is 100 %, and the alert names it with its namespace and job for routing."""
    alerts = ROOT / "deploy" / "prometheus" / "kvlens-alerts.yaml"
    rules = ROOT / "deploy" / "prometheus" / "kvlens-rules.yaml"
    runbook = yaml.safe_load(alerts.read_text())["groups"][0]["rules"]
    url = next(r["annotations"]["runbook_url"] for r in runbook if r["alert"] == "KVLensRecordsRejected")
    group = fleet_rejecting_test(200, broken=7)
    group["alert_rule_test"] = [
        {
            "eval_time": "25m",
            "alertname": "KVLensRecordsRejected",
            "exp_alerts": [
                {
                    "exp_labels": {
                        "severity": "warning",
                        "namespace": "llm",
                        "job": "kvlens",
                        "instance": "10.0.0.7:9433",
                        "source": "vllm_plugin",
                        "reason": "out_of_range",
                    },
                    "exp_annotations": {
                        "summary": "kvlens rejects out_of_range records from vllm_plugin (10.0.0.7:9433)",
                        "description": "100% of the records from vllm_plugin on 10.0.0.7:9433 are rejected "
                        "as out_of_range; they are counted nowhere else.",
                        "runbook_url": url,
                    },
                }
            ],
        }
    ]
    test = tmp_path / "fleet.test.yaml"
    test.write_text(
        yaml.safe_dump(
            {"rule_files": [str(rules), str(alerts)], "evaluation_interval": "1m", "tests": [group]}
        )
    )
    tested = subprocess.run([promtool, "test", "rules", str(test)], capture_output=True, text=True)
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_dashboard_compute_saved_is_one_ratio_per_unit_never_added(promtool: str, tmp_path: Path) -> None:
    """The overview's own compute-saved queries (stat and per-model column), as Grafana sends them,
    on three models counting in three units: one exact ratio per unit (and per model), never a
    sum of FLOPs and seconds."""
    overview = load(ROOT / "dashboards" / "kvlens-overview.json")
    exprs = {title: expr for title, raw, expr in queries(overview) if "kvlens_reused_flops_total" in raw}
    assert set(exprs) == {
        "Compute saved (modelled)",
        "Per model",
        "Request hit vs token reuse vs compute saved, by model",
    }
    sidecar = 'job="kvlens",instance="k:9433",prompt_len="0-511",cache="hit"'
    series = [
        (f'kvlens_prompt_work_units_total{{{sidecar},model="u"}}', "0+100x20"),
        (f'kvlens_reused_work_units_total{{{sidecar},model="u"}}', "0+10x20"),
        (f'kvlens_prompt_flops_total{{{sidecar},model="f"}}', "0+4000000x20"),
        (f'kvlens_reused_flops_total{{{sidecar},model="f"}}', "0+1000000x20"),
        (f'kvlens_modelled_prefill_seconds_total{{{sidecar},model="s"}}', "0+30x20"),
        (f'kvlens_saved_prefill_seconds_total{{{sidecar},model="s"}}', "0+15x20"),
    ]
    per_unit = [
        {"labels": f'{{unit="{unit}"}}', "value": value}
        for unit, value in (("work_units", 0.1), ("flops", 0.25), ("seconds", 0.5))
    ]
    per_model = [
        {"labels": f'{{model="{model}"}}', "value": value}
        for model, value in (("u", 0.1), ("f", 0.25), ("s", 0.5))
    ]
    test = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": name, "values": values} for name, values in series],
                "promql_expr_test": [
                    {"expr": exprs["Compute saved (modelled)"], "eval_time": "10m", "exp_samples": per_unit},
                    {"expr": exprs["Per model"], "eval_time": "10m", "exp_samples": per_model},
                ],
            }
        ],
    }
    path = tmp_path / "compute_saved.test.yaml"
    path.write_text(yaml.safe_dump(test))
    tested = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True)
    assert tested.returncode == 0, tested.stdout + tested.stderr
