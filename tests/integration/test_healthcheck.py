"""The image's HEALTHCHECK follows the port and TLS the sidecar was started with."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import trustme

from tests.hostile.test_defaults import write_pair
from tests.live import free_port, start_kvlens


def healthcheck(**env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KVLENS_")}
    return subprocess.run(
        [sys.executable, "-m", "kvlens.healthcheck"], env={**environ, **env}, capture_output=True, text=True
    )


def test_it_follows_the_port_and_tls(tmp_path: Path) -> None:
    chain, key = write_pair(trustme.CA(), tmp_path)
    tls = {"KVLENS_TLS_CERT_FILE": str(chain), "KVLENS_TLS_KEY_FILE": str(key)}
    port = free_port()
    sidecar = start_kvlens("serve", env=tls, port=port, scheme="https")
    try:
        assert healthcheck(KVLENS_PORT=str(port), **tls).returncode == 0
        plain = healthcheck(KVLENS_PORT=str(port))  # HTTP to an HTTPS server: not healthy
        assert plain.returncode == 1
        assert f"http://127.0.0.1:{port}/healthz" in plain.stderr
    finally:
        sidecar.output()
    gone = healthcheck(KVLENS_PORT=str(port), **tls)
    assert gone.returncode == 1
    assert gone.stderr.startswith(f"kvlens healthcheck: https://127.0.0.1:{port}/healthz: ")
