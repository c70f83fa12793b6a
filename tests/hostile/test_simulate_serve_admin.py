"""``kvlens simulate serve``'s one route that changes state for everyone, ``/reset_prefix_cache``,
takes a bearer token as ``kvlens serve``'s ingest does (``admin_token``: ``KVLENS_ADMIN_TOKEN``
or the ``--config`` file, never a flag), and listening beyond loopback without it is said at
start. Before: anyone who reached the port could empty every replica's cache, silently."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.live import Running, start_kvlens

pytestmark = pytest.mark.integration
COMPLETION = {"model": "simulated", "prompt": "hello", "max_tokens": 2}


def resets(running: Running, token: str | None) -> int:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    return httpx.post(f"{running.url}/reset_prefix_cache", headers=headers, timeout=10).status_code


@pytest.mark.parametrize("given_by", ["environment", "config file"])
def test_reset_prefix_cache_requires_the_admin_token(tmp_path: Path, given_by: str) -> None:
    config = tmp_path / "kvlens.yaml"
    config.write_text("admin_token: s3cret-token\n")
    if given_by == "environment":
        running = start_kvlens(
            "simulate", "serve", env={"KVLENS_ADMIN_TOKEN": "s3cret-token"}, ready="/health"
        )
    else:
        running = start_kvlens("simulate", "serve", "--config", str(config), ready="/health")
    try:
        answer = httpx.post(f"{running.url}/reset_prefix_cache", timeout=10)
        assert answer.status_code == 401
        assert answer.headers["www-authenticate"] == "Bearer"
        assert "s3cret" not in answer.text
        assert resets(running, "wrong") == 401
        assert resets(running, "s3cret-token") == 200
        # the OpenAI routes stay open, as vLLM's without --api-key
        assert httpx.post(f"{running.url}/v1/completions", json=COMPLETION, timeout=10).status_code == 200
    finally:
        running.output()


def test_without_a_token_reset_is_open_on_loopback_and_said_beyond_it() -> None:
    running = start_kvlens("simulate", "serve", "--host", "0.0.0.0", ready="/health")
    try:
        assert resets(running, None) == 200
    finally:
        output = running.output()
    assert "WARNING" in output and "KVLENS_ADMIN_TOKEN" in output and "0.0.0.0" in output
    guarded = start_kvlens(
        "simulate", "serve", "--host", "0.0.0.0", env={"KVLENS_ADMIN_TOKEN": "s3cret"}, ready="/health"
    )
    assert "KVLENS_ADMIN_TOKEN" not in guarded.output()
    loopback = start_kvlens("simulate", "serve", ready="/health")
    assert "KVLENS_ADMIN_TOKEN" not in loopback.output()


def test_a_blank_admin_token_is_refused_at_start() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvlens.cli", "simulate", "serve", "--port", "1"],
        env={**os.environ, "KVLENS_ADMIN_TOKEN": "  "},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    assert "admin_token" in done.stderr and "blank" in done.stderr
