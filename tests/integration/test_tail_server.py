"""`kvlens serve --tail`: SGLang's per-request export followed live, and across a restart."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.conftest import Running, start_kvlens

pytestmark = pytest.mark.integration


def sglang_line(i: int) -> bytes:
    meta = {
        "request_parameters": json.dumps({"rid": f"r{i}"}),
        "id": f"r{i}",
        "finish_reason": {"type": "stop"},
        "prompt_tokens": 128 if i % 10 else 8192,
        "cached_tokens": 16 if i % 10 else 0,
        "completion_tokens": 20,
        "e2e_latency": 0.5,
        "queue_time": 0.01,
        "first_token_latency": 0.05,
    }
    return json.dumps(meta).encode() + b"\n"


def counted(running: Running, name: str, **labels: str) -> float:
    text = httpx.get(f"{running.url}/metrics").text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and set(labels.items()) <= set(sample.labels.items())
    )


def wait_until(running: Running, name: str, expected: float, **labels: str) -> float:
    deadline = time.monotonic() + 20
    while (value := counted(running, name, **labels)) < expected and time.monotonic() < deadline:
        time.sleep(0.05)  # the sidecar polls the files on its own interval
    return value


def serve(tmp_path: Path) -> Running:
    glob = str(tmp_path / "logs" / "sglang-request-metrics-*.log")
    env = {"KVLENS_STATE_DIR": str(tmp_path / "state"), "KVLENS_TAIL_POLL_SECONDS": "0.05"}
    return start_kvlens("serve", "--tail", glob, "--format", "sglang", "--model", "qwen", env=env)


def test_tail_follows_sglang_export_across_rotation_and_restart(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    hour_one = logs / "sglang-request-metrics-20261129_10.log"
    hour_one.write_bytes(b"".join(sglang_line(i) for i in range(50)) + b"not json\n")
    running = serve(tmp_path)
    try:
        assert wait_until(running, "kvlens_requests_total", 50) == 50
        assert counted(running, "kvlens_requests_total", model="qwen", cache="hit") == 45
        assert counted(running, "kvlens_records_rejected_total", source="tail", reason="malformed_json") == 1
        hour_two = logs / "sglang-request-metrics-20261129_11.log"  # SGLang starts a file per hour
        hour_two.write_bytes(b"".join(sglang_line(i) for i in range(50, 60)))
        assert wait_until(running, "kvlens_requests_total", 60) == 60
    finally:
        running.output()

    with open(hour_two, "ab") as out:
        out.write(b"".join(sglang_line(i) for i in range(60, 65)))
    restarted = serve(tmp_path)
    try:
        assert wait_until(restarted, "kvlens_records_received_total", 5, source="tail") == 5
        time.sleep(0.3)  # a few more polls: nothing already counted may come back
        assert counted(restarted, "kvlens_requests_total") == 5
    finally:
        restarted.output()
