"""Recording and alert rules: promtool checks and unit tests, and every alert's metadata."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

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


def test_every_alert_has_severity_summary_description_and_a_runbook_section() -> None:
    runbook = (ROOT / "RUNBOOK.md").read_text()
    anchors = {
        re.sub(r"[^a-z0-9-]", "", title.lower().replace(" ", "-"))
        for title in re.findall(r"^## (.+)$", runbook, re.M)
    }
    alerts = [rule for rule in all_rules() if "alert" in rule]
    assert alerts
    for rule in alerts:
        labels, annotations = rule["labels"], rule["annotations"]
        assert isinstance(labels, dict) and isinstance(annotations, dict)
        assert labels["severity"] in ("info", "warning", "critical"), rule["alert"]
        assert annotations["summary"] and annotations["description"], rule["alert"]
        anchor = str(annotations["runbook_url"]).rsplit("#", 1)[1]
        assert anchor == str(rule["alert"]).lower() and anchor in anchors, rule["alert"]


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
