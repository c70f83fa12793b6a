"""The deploy bundle: every YAML parses, the pieces fit together, and the PrometheusRule is the
rule files (one source)."""

from __future__ import annotations

import runpy
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent.parent
DEPLOY = ROOT / "deploy"
YAML_FILES = sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")])


def documents() -> dict[str, dict[str, Any]]:
    """Kubernetes objects by kind."""
    out = {}
    for path in (DEPLOY / "kubernetes").glob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            out[doc["kind"]] = doc
    return out


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_yaml_parses(path: Path) -> None:
    assert list(yaml.safe_load_all(path.read_text()))


def test_prometheus_rule_is_generated_from_the_rule_files() -> None:
    script = runpy.run_path(str(ROOT / "scripts" / "prometheusrule.py"))
    assert (DEPLOY / "kubernetes" / "prometheusrule.yaml").read_text() == script["render"](), (
        "run scripts/prometheusrule.py"
    )
    rule_files = [
        g
        for p in sorted((DEPLOY / "prometheus").glob("kvlens-*.yaml"))
        for g in yaml.safe_load(p.read_text())["groups"]
    ]
    assert documents()["PrometheusRule"]["spec"]["groups"] == rule_files


def containers() -> dict[str, dict[str, Any]]:
    pod = documents()["Deployment"]["spec"]["template"]["spec"]
    return {c["name"]: c for c in pod["containers"]}


def test_sidecar_is_restricted_and_probed() -> None:
    sidecar = containers()["kvlens"]
    context = sidecar["securityContext"]
    assert context["runAsNonRoot"] is True and context["runAsUser"] == 65532
    assert context["allowPrivilegeEscalation"] is False
    assert context["readOnlyRootFilesystem"] is True
    assert context["capabilities"]["drop"] == ["ALL"]
    assert context["seccompProfile"]["type"] == "RuntimeDefault"
    assert sidecar["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert sidecar["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert {"name": "metrics", "containerPort": 9433} in sidecar["ports"]


def test_plugin_posts_to_the_sidecar_and_the_sidecar_scrapes_vllm() -> None:
    vllm, sidecar = containers()["vllm"], containers()["kvlens"]
    env = {e["name"]: e for e in vllm["env"]}
    assert env["KVLENS_PLUGIN_URL"]["value"] == "http://127.0.0.1:9433/v1/records"
    sidecar_env = {e["name"]: e for e in sidecar["env"]}
    secret = env["KVLENS_PLUGIN_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert sidecar_env["KVLENS_INGEST_TOKEN"]["valueFrom"]["secretKeyRef"] == secret
    assert sidecar["args"] == ["--scrape", "http://127.0.0.1:8000/metrics"]


def test_service_monitor_and_network_policy_select_the_pod() -> None:
    docs = documents()
    pod_labels = docs["Deployment"]["spec"]["template"]["metadata"]["labels"]
    service = docs["Service"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert {"name": "metrics", "port": 9433, "targetPort": "metrics"} in service["spec"]["ports"]
    monitor = docs["ServiceMonitor"]["spec"]
    assert monitor["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["endpoints"][0]["port"] == "metrics"
    policy = docs["NetworkPolicy"]["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert any({"port": 9433, "protocol": "TCP"} in rule["ports"] for rule in policy["ingress"])
    listed = yaml.safe_load((DEPLOY / "kubernetes" / "kustomization.yaml").read_text())["resources"]
    assert all((DEPLOY / "kubernetes" / name).is_file() for name in listed)


def test_compose_profiles_and_mounts() -> None:
    compose = yaml.safe_load((DEPLOY / "compose" / "compose.yaml").read_text())
    services = compose["services"]
    assert {"prometheus", "grafana", "kvlens-demo", "vllm", "kvlens"} <= set(services)
    assert services["kvlens-demo"]["profiles"] == ["demo"]
    assert services["vllm"]["profiles"] == ["vllm"] and services["kvlens"]["profiles"] == ["vllm"]
    assert services["vllm"]["environment"]["KVLENS_PLUGIN_URL"] == "http://kvlens:9433/v1/records"
    named = set(compose.get("volumes", {}))
    for service in services.values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            assert source in named or (DEPLOY / "compose" / source).resolve().exists(), volume
    prometheus = yaml.safe_load((DEPLOY / "compose" / "prometheus.yml").read_text())
    for rule_file in prometheus["rule_files"]:
        assert (DEPLOY / "prometheus" / Path(rule_file).name).is_file()
