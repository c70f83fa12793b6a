"""Defect 11: the shipped defaults are the safe ones, and the safe options exist.

Requirement (reliability.md 5.13, 5.14): ingest reachable beyond loopback without a token is said
loudly and exported; optional TLS (reloaded on change) and authentication on /metrics; manifests
that fit the "restricted" Pod Security Standard; nothing loaded from a public CDN.
"""

from __future__ import annotations

import os
import ssl
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import trustme
import yaml

from tests.hostile.conftest import Serve
from tests.live import start_kvlens

pytestmark = pytest.mark.integration
ROOT = Path(__file__).parent.parent.parent


def test_ingest_open_beyond_loopback_without_a_token_is_said_and_exported(serve: Serve) -> None:
    open_sidecar = start_kvlens("serve", "--host", "0.0.0.0")
    try:
        assert open_sidecar.value("kvlens_ingest_open") == 1
    finally:
        output = open_sidecar.output()
    assert "WARNING" in output and "KVLENS_INGEST_TOKEN" in output
    closed = serve("--host", "0.0.0.0", KVLENS_INGEST_TOKEN="s3cret")
    assert closed.value("kvlens_ingest_open") == 0
    assert serve().value("kvlens_ingest_open") == 0  # loopback only


def write_pair(ca: trustme.CA, directory: Path) -> tuple[Path, Path]:
    cert = ca.issue_cert("127.0.0.1", "localhost")
    chain, key = directory / "tls.crt", directory / "tls.key"
    for path, blob in ((chain, cert.cert_chain_pems[0].bytes()), (key, cert.private_key_pem.bytes())):
        staged = path.with_suffix(".new")
        staged.write_bytes(blob)
        os.replace(staged, path)  # as a Kubernetes secret volume updates: all at once
    return chain, key


def verified_by(ca: trustme.CA, url: str) -> bool:
    context = ssl.create_default_context()
    ca.configure_trust(context)
    try:
        return httpx.get(url, verify=context, timeout=5).status_code == 200
    except httpx.ConnectError:
        return False


def test_tls_is_served_and_a_renewed_certificate_is_picked_up(tmp_path: Path) -> None:
    first, second = trustme.CA(), trustme.CA()
    chain, key = write_pair(first, tmp_path)
    env = {
        "KVLENS_TLS_CERT_FILE": str(chain),
        "KVLENS_TLS_KEY_FILE": str(key),
        "KVLENS_TLS_RELOAD_SECONDS": "0.2",
    }
    sidecar = start_kvlens("serve", env=env, scheme="https")
    try:
        assert verified_by(first, f"{sidecar.url}/healthz")
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{sidecar.port}/healthz", timeout=5)
        write_pair(second, tmp_path)
        deadline = time.monotonic() + 10
        while not verified_by(second, f"{sidecar.url}/healthz") and time.monotonic() < deadline:
            time.sleep(0.1)  # the sidecar checks the files on its own interval
        assert verified_by(second, f"{sidecar.url}/healthz")
        assert not verified_by(first, f"{sidecar.url}/healthz")
    finally:
        sidecar.output()


def test_metrics_can_require_a_bearer_token_or_basic_auth(serve: Serve) -> None:
    sidecar = serve(
        KVLENS_METRICS_TOKEN="scrape-token", KVLENS_METRICS_USERNAME="prom", KVLENS_METRICS_PASSWORD="pw"
    )
    url = f"{sidecar.url}/metrics"
    refused = httpx.get(url)
    assert refused.status_code == 401 and "scrape-token" not in refused.text
    assert refused.headers["www-authenticate"].startswith(("Bearer", "Basic"))
    assert httpx.get(url, auth=("prom", "wrong")).status_code == 401
    assert httpx.get(url, headers={"authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(url, headers={"authorization": "Bearer scrape-token"}).status_code == 200
    assert httpx.get(url, auth=("prom", "pw")).status_code == 200
    assert httpx.get(f"{sidecar.url}/healthz").status_code == 200  # probes stay open


def test_no_page_loads_scripts_from_a_public_cdn(serve: Serve) -> None:
    sidecar = serve()
    for path in ("/", "/docs", "/redoc", "/openapi.json"):
        answer = httpx.get(sidecar.url + path)
        assert "cdn" not in answer.text.lower(), path
    assert httpx.get(f"{sidecar.url}/docs").status_code == 404  # opt-in: KVLENS_DOCS=true
    documented = serve(KVLENS_DOCS="true")
    assert httpx.get(f"{documented.url}/docs").status_code == 200


RESTRICTED_VOLUMES = {
    "configMap", "csi", "downwardAPI", "emptyDir",
    "ephemeral", "persistentVolumeClaim", "projected", "secret",
}  # fmt: skip


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    """The Pod Security Standards "restricted" profile (baseline included), field by field."""
    found = []
    pod_context = pod.get("securityContext", {})
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(flag):
            found.append(flag)
    for volume in pod.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            found.append(f"volume {volume['name']}: {sorted(kinds)}")
    for container in [*pod.get("initContainers", []), *pod["containers"]]:
        name = container["name"]
        context = container.get("securityContext", {})

        def setting(key: str, context: dict[str, Any] = context) -> Any:
            return context.get(key, pod_context.get(key))

        if context.get("privileged"):
            found.append(f"{name}: privileged")
        if context.get("allowPrivilegeEscalation") is not False:
            found.append(f"{name}: allowPrivilegeEscalation must be false")
        if setting("runAsNonRoot") is not True:
            found.append(f"{name}: runAsNonRoot must be true")
        if setting("runAsUser") == 0:
            found.append(f"{name}: runAsUser 0")
        seccomp = (setting("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            found.append(f"{name}: seccompProfile must be RuntimeDefault or Localhost")
        capabilities = context.get("capabilities", {})
        if "ALL" not in capabilities.get("drop", []):
            found.append(f"{name}: capabilities must drop ALL")
        if set(capabilities.get("add", [])) - {"NET_BIND_SERVICE"}:
            found.append(f"{name}: adds capabilities")
        if any("hostPort" in port for port in container.get("ports", [])):
            found.append(f"{name}: hostPort")
    return found


def test_every_kubernetes_pod_fits_the_restricted_pod_security_standard() -> None:
    pods = [
        doc["spec"]["template"]["spec"]
        for path in (ROOT / "deploy" / "kubernetes").glob("*.yaml")
        for doc in yaml.safe_load_all(path.read_text())
        if doc and doc.get("kind") in ("Deployment", "StatefulSet", "DaemonSet")
    ]
    assert pods
    for pod in pods:
        assert restricted_violations(pod) == []
    assert restricted_violations({"containers": [{"name": "bare"}]})  # the checker does find things


def test_compose_never_publishes_an_open_ingest_port() -> None:
    compose = yaml.safe_load((ROOT / "deploy" / "compose" / "compose.yaml").read_text())
    for name, service in compose["services"].items():
        published = [str(port) for port in service.get("ports", [])]
        if not any(port.endswith(":9433") for port in published):
            continue
        environment = service.get("environment", {})
        loopback = all(port.startswith("127.0.0.1:") for port in published if port.endswith(":9433"))
        assert loopback or "KVLENS_INGEST_TOKEN" in environment, name
