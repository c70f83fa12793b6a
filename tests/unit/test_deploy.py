"""The deploy bundle: every YAML parses, the pieces fit together, and the PrometheusRule is the
rule files (one source)."""

from __future__ import annotations

import json
import math
import runpy
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvlens import __version__
from kvlens.config import load_settings
from kvlens.fleet.settings import parse_dns_target

ROOT = Path(__file__).resolve().parent.parent.parent
DEPLOY = ROOT / "deploy"
YAML_FILES = sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")])
OVERLAY = DEPLOY / "kubernetes-kv-events"  # the base plus KV events and one fleet-level kvlens


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


def test_recording_rules_are_generated_from_kvlens_promql() -> None:
    """The recording rules are written by the code that writes the dashboards' queries
    (kvlens.exporter.promql): the file is its output, byte for byte, and parses to its table."""
    script = runpy.run_path(str(ROOT / "scripts" / "prometheusrule.py"))
    rules = DEPLOY / "prometheus" / "kvlens-rules.yaml"
    assert rules.read_text() == script["render_rules"](), "run scripts/prometheusrule.py"
    assert yaml.safe_load(rules.read_text())["groups"] == script["recording_rules"]()


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


# Deploy hygiene (checkov on deploy/; see deploy/POLICY.md). checkov is not a test dependency: it
# takes ~4 min and ~100 packages to install, so each check we fixed is asserted here field by field,
# and each check we skip must carry its reason in the manifest and be listed in POLICY.md.


def pod_spec() -> dict[str, Any]:
    spec: dict[str, Any] = documents()["Deployment"]["spec"]["template"]["spec"]
    return spec


def test_no_service_account_token_is_mounted() -> None:
    # Neither vLLM nor kvlens talks to the Kubernetes API (CKV_K8S_38).
    assert pod_spec()["automountServiceAccountToken"] is False


def test_sidecar_has_cpu_and_memory_limits_and_a_versioned_image() -> None:
    sidecar = containers()["kvlens"]
    assert sidecar["resources"]["limits"] == {"cpu": "1", "memory": "256Mi"}
    assert sidecar["resources"]["requests"] == {"cpu": "100m", "memory": "128Mi"}
    assert sidecar["image"] == f"kvlens:{__version__}"


def test_vllm_is_probed_on_health_after_a_startup_allowance() -> None:
    # CKV_K8S_8 and CKV_K8S_9: a model load takes minutes, so liveness and readiness wait for the
    # startup probe, which allows 15 minutes (a download of the weights included).
    vllm = containers()["vllm"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert vllm[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    startup = vllm["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] == 900


def test_vllm_image_has_a_healthcheck() -> None:
    # CKV_DOCKER_2, for compose (Kubernetes uses the probes above).
    dockerfile = (DEPLOY / "compose" / "vllm.Dockerfile").read_text()
    healthchecks = [line for line in dockerfile.splitlines() if line.startswith("HEALTHCHECK")]
    assert len(healthchecks) == 1
    assert "--start-period=900s" in healthchecks[0]
    assert "http://127.0.0.1:8000/health" in dockerfile


def skipped_checks() -> dict[str, str]:
    """checkov.io/skipN annotations of every Kubernetes object: check id -> reason."""
    out = {}
    for path in [*(DEPLOY / "kubernetes").glob("*.yaml"), *OVERLAY.glob("*.yaml")]:
        for doc in yaml.safe_load_all(path.read_text()):
            if not isinstance(doc, dict):  # a JSON patch
                continue
            for key, value in doc.get("metadata", {}).get("annotations", {}).items():
                if key.startswith("checkov.io/skip"):
                    check, _, reason = value.partition("=")
                    out[f"{doc['kind']} {check}"] = reason
    return out


def test_every_skipped_check_has_a_reason_and_is_in_the_policy() -> None:
    skipped = skipped_checks()
    assert set(skipped) == {
        "Deployment CKV_K8S_21",
        "Deployment CKV_K8S_43",
        "Deployment CKV_K8S_15",
        "Deployment CKV_K8S_35",
        "Deployment CKV_K8S_11",
        "Deployment CKV_K8S_13",
        "Deployment CKV_K8S_22",
        "Deployment CKV_K8S_40",
        "Service CKV_K8S_21",
        "Secret CKV_K8S_21",
    }
    policy = (DEPLOY / "POLICY.md").read_text()
    for key, reason in skipped.items():
        assert len(reason.split()) >= 5, key  # a sentence, not a placeholder
        assert key.split()[1] in policy, key


def overlay() -> dict[tuple[str, str], Any]:
    """The KV-events overlay's objects by (kind, name), and its patch as ("Patch", file)."""
    out: dict[tuple[str, str], Any] = {}
    for path in OVERLAY.glob("*.yaml"):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            key = ("Patch", path.name) if isinstance(doc, list) else (doc["kind"], doc["metadata"]["name"])
            out[key] = doc
    return out


def test_kv_events_overlay_wires_every_vllm_pod_to_one_fleet_kvlens(monkeypatch: pytest.MonkeyPatch) -> None:
    """The names and ports the pieces share agree: vLLM's publisher and replay ports, the headless
    Service's, the DNS target kvlens looks up (parsed by kvlens's own settings), the NetworkPolicy
    that lets only the fleet kvlens reach them; one kvlens, restricted, with the ingest token."""
    objects = overlay()
    vllm_labels = documents()["Deployment"]["spec"]["template"]["metadata"]["labels"]
    # vLLM: --kv-events-config with the publisher on 5557 and the replay endpoint on 5558
    patch = objects["Patch", "vllm-kv-events.yaml"]
    args = [op["value"] for op in patch if op["path"].endswith("/args/-")]
    assert args[0] == "--kv-events-config"
    config = json.loads(args[1])
    assert (config["enable_kv_cache_events"], config["publisher"]) == (True, "zmq")
    assert (config["endpoint"], config["replay_endpoint"]) == ("tcp://*:5557", "tcp://*:5558")
    ports = {
        op["value"]["name"]: op["value"]["containerPort"] for op in patch if op["path"].endswith("/ports/-")
    }
    assert ports == {"kv-events": 5557, "kv-replay": 5558}
    # the headless Service lists every vLLM pod, ready or not, on those ports
    service = objects["Service", "vllm-kv-events"]["spec"]
    assert (service["clusterIP"], service["publishNotReadyAddresses"]) == ("None", True)
    assert service["selector"].items() <= vllm_labels.items()
    assert {p["targetPort"]: p["port"] for p in service["ports"]} == ports
    # the fleet kvlens looks that name up (its settings parse it), one replica, restricted
    fleet = objects["Deployment", "kvlens-fleet"]
    assert fleet["spec"]["replicas"] == 1
    pod = fleet["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    for name, value in env.items():
        if "value" in value:
            monkeypatch.setenv(name, value["value"])
    settings = load_settings(None)
    assert [parse_dns_target(target) for target in settings.kv_events_dns] == [("vllm-kv-events", 5557, 5558)]
    sidecar_env = {e["name"]: e for e in containers()["kvlens"]["env"]}
    assert env["KVLENS_INGEST_TOKEN"] == sidecar_env["KVLENS_INGEST_TOKEN"]
    assert container["securityContext"] == containers()["kvlens"]["securityContext"]
    assert container["image"] == f"kvlens:{__version__}"
    assert pod["spec"]["automountServiceAccountToken"] is False
    assert (
        container["readinessProbe"]["httpGet"]["path"],
        container["livenessProbe"]["httpGet"]["path"],
    ) == (
        "/readyz",
        "/healthz",
    )
    assert set(container["resources"]["limits"]) == {"cpu", "memory"}
    # only the fleet kvlens reaches the events; Prometheus scrapes it through its Service
    policy = objects["NetworkPolicy", "vllm-kv-events"]["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= vllm_labels.items()
    (rule,) = policy["ingress"]
    assert rule["from"][0]["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert sorted(p["port"] for p in rule["ports"]) == [5557, 5558]
    scraped = objects["Service", "kvlens-fleet"]
    assert scraped["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    monitor = objects["ServiceMonitor", "kvlens-fleet"]["spec"]
    assert monitor["selector"]["matchLabels"].items() <= scraped["metadata"]["labels"].items()
    # the base ServiceMonitor does not pick up the headless Service (it has no metrics port)
    base_monitor = documents()["ServiceMonitor"]["spec"]["selector"]["matchLabels"]
    assert not base_monitor.items() <= objects["Service", "vllm-kv-events"]["metadata"]["labels"].items()
    listed = yaml.safe_load((OVERLAY / "kustomization.yaml").read_text())
    assert all((OVERLAY / name).exists() for name in listed["resources"])
    assert all((OVERLAY / p["path"]).is_file() for p in listed["patches"])


def test_kv_events_overlay_renders_with_kustomize() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the overlay's pieces are checked one by one above")
    rendered = subprocess.run(
        [kubectl, "kustomize", str(OVERLAY)], capture_output=True, text=True, check=True
    )
    docs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(rendered.stdout)}
    vllm = next(
        c for c in docs["Deployment", "vllm"]["spec"]["template"]["spec"]["containers"] if c["name"] == "vllm"
    )
    assert vllm["args"][-2] == "--kv-events-config"
    assert {"name": "kv-events", "containerPort": 5557} in vllm["ports"]
    assert ("Deployment", "kvlens-fleet") in docs and ("PrometheusRule", "kvlens") in docs


def test_the_fleet_kvlens_memory_limit_is_above_the_index_worst_case_at_the_default_caps() -> None:
    """The worst case (docs/kv-events.md; measured by ``bench/kv_events.py --worst-case``): the
    idle process with its compiled loops (201 MiB measured), both caps full at their most bytes an
    entry, and the largest table rebuilt (old and new held at once), with a fifth to spare."""
    from kvlens.fleet.kernels.table import FILL
    from kvlens.fleet.limits import HELD_ENTRY_BYTES, MAX_HELD_BLOCKS, REMEMBER_BLOCKS, REMEMBERED_ENTRY_BYTES

    fleet = overlay()["Deployment", "kvlens-fleet"]
    (container,) = fleet["spec"]["template"]["spec"]["containers"]
    limit = container["resources"]["limits"]["memory"]
    assert limit.endswith("Mi")
    rebuilt = math.ceil(max(MAX_HELD_BLOCKS, REMEMBER_BLOCKS) / FILL) * 16
    tables = MAX_HELD_BLOCKS * HELD_ENTRY_BYTES + REMEMBER_BLOCKS * REMEMBERED_ENTRY_BYTES + rebuilt
    worst = 201 * 2**20 + tables
    assert int(limit[:-2]) * 2**20 >= 1.2 * worst
