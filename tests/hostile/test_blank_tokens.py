"""Issue 15, defect 5: a blank token must not turn authentication off.

``KVLENS_INGEST_TOKEN=""`` used to give open ingest with no warning and ``kvlens_ingest_open 0``
(the settings tested ``is None``, the app truthiness); ``KVLENS_METRICS_TOKEN=""`` let
``Authorization: Bearer`` with nothing after it scrape. A blank or whitespace value is a
configuration mistake: the sidecar refuses to start, with one line that names the setting.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.hostile.conftest import Serve
from tests.live import free_port

pytestmark = pytest.mark.integration


def start_and_exit(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``kvlens serve`` expecting it to refuse its settings (it would serve otherwise: then
    the timeout fails the test)."""
    return subprocess.run(
        [sys.executable, "-m", "kvlens.cli", "serve", "--host", "0.0.0.0", "--port", str(free_port()), *args],
        env={**os.environ, "KVLENS_LOG_LEVEL": "WARNING", **env},
        capture_output=True,
        text=True,
        timeout=60,  # a hang check: a sidecar that accepted the settings serves until killed
    )


@pytest.mark.parametrize("name", ["KVLENS_INGEST_TOKEN", "KVLENS_METRICS_TOKEN", "KVLENS_METRICS_PASSWORD"])
@pytest.mark.parametrize("value", ["", "   ", "\t\n"])
def test_a_blank_secret_is_refused_at_start(name: str, value: str) -> None:
    env = {name: value}
    if name == "KVLENS_METRICS_PASSWORD":
        env["KVLENS_METRICS_USERNAME"] = "prom"
    finished = start_and_exit(env)
    assert finished.returncode == 2, (finished.stdout, finished.stderr)
    lines = finished.stderr.splitlines()
    assert len(lines) == 1, finished.stderr
    setting = name.removeprefix("KVLENS_").lower()
    assert lines[0].startswith(f"kvlens: invalid setting {setting}: "), lines[0]
    assert "blank" in lines[0]
    assert "Traceback" not in finished.stderr


@pytest.mark.parametrize("setting", ["ingest_token", "metrics_token", "metrics_password"])
@pytest.mark.parametrize("null", ["", " ~", " null"])
def test_a_secret_key_without_a_value_in_the_config_file_is_refused_at_start(
    tmp_path: Path, setting: str, null: str
) -> None:
    # What a Helm or compose template that rendered nothing gives: the key is there, with YAML null.
    config = tmp_path / "kvlens.yaml"
    extra = "metrics_username: prom\n" if setting == "metrics_password" else ""
    config.write_text(f"{setting}:{null}\n{extra}")
    finished = start_and_exit({}, "--config", str(config))
    assert finished.returncode == 2, (finished.stdout, finished.stderr)
    assert finished.stderr.splitlines() == [
        f"kvlens: invalid setting {setting}: is empty: remove the key to turn this check off, or give a value"
    ]


def test_a_token_with_surrounding_whitespace_is_refused_at_start() -> None:
    # A token read from a file often keeps its newline; it could never match a bearer header.
    finished = start_and_exit({"KVLENS_INGEST_TOKEN": "s3cret\n"})
    assert finished.returncode == 2
    assert finished.stderr.splitlines() == [
        "kvlens: invalid setting ingest_token: must not start or end with whitespace (a newline "
        "from a file?): a bearer header can never carry it"
    ]


def test_an_empty_bearer_header_never_scrapes_or_pushes(serve: Serve) -> None:
    sidecar = serve("--host", "0.0.0.0", KVLENS_INGEST_TOKEN="s3cret", KVLENS_METRICS_TOKEN="scrape")
    empty = {"authorization": "Bearer"}  # what "Bearer " arrives as: h11 strips the space
    assert httpx.get(f"{sidecar.url}/metrics", headers=empty).status_code == 401
    pushed = httpx.post(
        f"{sidecar.url}/v1/records", headers=empty, json={"prompt_tokens": 1, "cached_tokens": 0}
    )
    assert pushed.status_code == 401
    scraped = httpx.get(f"{sidecar.url}/metrics", headers={"authorization": "Bearer scrape"})
    assert "kvlens_ingest_open 0.0" in scraped.text
