"""Defect 1: a few KiB of gzip, or a body of empty values, must not cost the sidecar its memory.

Requirement (reliability.md 5.1): memory per request bounded by a documented multiple of the body
limit; member count and decompression ratio capped; such bodies answered 413/400 within 1 s with
RSS growth under 50 MiB; nothing decompressed or parsed on the event loop.
"""

from __future__ import annotations

import gzip
import threading
import time

import httpx
import orjson
import pytest

from kvlens.sources.otlp import length_delimited
from tests.hostile.conftest import Serve

pytestmark = pytest.mark.integration

MIB = 1024 * 1024
ZEROS = gzip.compress(b"[" + b"0," * 4193793 + b"0]", 9)  # 8 KiB -> 8 MiB of zeros
EMPTY_OBJECTS = b"[" + b"{}," * (8 * MIB // 3 - 2) + b"{}]"  # 8 MiB, 2.8M records
EMPTY_MEMBERS = gzip.compress(b"") * 209_000  # 4 MiB of empty gzip members


# 4 MiB of empty spans: ExportTraceServiceRequest{resource_spans{scope_spans{spans: {} x 2M}}}
EMPTY_SPANS = length_delimited(1, length_delimited(2, b"\x12\x00" * (2 * MIB)))
EMPTY_JSON_SPANS = b'{"resourceSpans":[{"scopeSpans":[{"spans":[' + b"{}," * (8 * MIB // 3 - 20) + b"{}]}]}]}"

BOMBS = {
    "gzip of zeros": ("/v1/records", ZEROS, {"content-encoding": "gzip"}),
    "gzip of empty objects": ("/v1/records", gzip.compress(EMPTY_OBJECTS, 9), {"content-encoding": "gzip"}),
    "8 MiB of empty objects": ("/v1/records", EMPTY_OBJECTS, {}),
    "empty gzip members": ("/v1/records", EMPTY_MEMBERS, {"content-encoding": "gzip"}),
    "empty gzip members, OTLP": (
        "/v1/traces",
        EMPTY_MEMBERS,
        {"content-encoding": "gzip", "content-type": "application/x-protobuf"},
    ),
    "4 MiB of empty protobuf spans": ("/v1/traces", EMPTY_SPANS, {"content-type": "application/x-protobuf"}),
    "8 MiB of empty JSON spans": ("/v1/traces", EMPTY_JSON_SPANS, {"content-type": "application/json"}),
}


@pytest.mark.parametrize("name", BOMBS)
def test_a_bomb_is_refused_within_a_second_with_flat_memory(serve: Serve, name: str) -> None:
    sidecar = serve()
    path, body, headers = BOMBS[name]
    memory = sidecar.memory()
    memory.reset()
    started = time.monotonic()
    answer = httpx.post(sidecar.url + path, content=body, headers=headers, timeout=60)
    elapsed = time.monotonic() - started
    assert answer.status_code in (400, 413), answer.text
    # A hang check, not a benchmark (bench/ measures speed): a bomb inflated in full takes minutes.
    assert elapsed < 10.0
    assert memory.peak_growth_mib() < 50
    assert httpx.get(f"{sidecar.url}/healthz").status_code == 200


def test_three_bombs_at_once_keep_memory_flat(serve: Serve) -> None:
    sidecar = serve()
    memory = sidecar.memory()
    memory.reset()
    statuses: list[int] = []

    def bomb(body: bytes) -> None:
        answer = httpx.post(
            f"{sidecar.url}/v1/records", content=body, headers={"content-encoding": "gzip"}, timeout=60
        )
        statuses.append(answer.status_code)

    threads = [threading.Thread(target=bomb, args=(body,)) for body in (ZEROS, ZEROS, ZEROS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(statuses) == [413, 413, 413]
    assert memory.peak_growth_mib() < 50


@pytest.mark.parametrize("path", ["/v1/records", "/v1/traces"])
def test_decompression_never_stalls_the_event_loop(serve: Serve, path: str) -> None:
    """A body that is slow to inflate (here: many members) is handled off the event loop, so
    the liveness probe answers at once meanwhile."""
    sidecar = serve()
    done = threading.Event()
    slowest = 0.0

    def bombard() -> None:
        try:
            for _ in range(3):
                httpx.post(
                    sidecar.url + path,
                    content=EMPTY_MEMBERS,
                    headers={"content-encoding": "gzip", "content-type": "application/x-protobuf"},
                    timeout=60,
                )
        finally:
            done.set()

    worker = threading.Thread(target=bombard)
    worker.start()
    with httpx.Client() as client:
        while not done.is_set():
            started = time.monotonic()
            assert client.get(f"{sidecar.url}/healthz", timeout=30).status_code == 200
            slowest = max(slowest, time.monotonic() - started)
    worker.join()
    # A hang check: a loop blocked by inflation would stall /healthz for the whole bomb.
    assert slowest < 5.0


def test_a_full_body_of_valid_records_is_counted_within_the_documented_memory(serve: Serve) -> None:
    """The largest legitimate request: max_records_per_request records, all counted, with memory
    within the documented bound (4 x the body limit, for the body, its decoded text and records)."""
    sidecar = serve(KVLENS_MAX_RECORDS_PER_REQUEST="50000")
    record = {"prompt_tokens": 128, "cached_tokens": 16, "model": "m", "queue_seconds": 0.01}
    body = orjson.dumps([record] * 50_000)
    memory = sidecar.memory()
    memory.reset()
    answer = httpx.post(f"{sidecar.url}/v1/records", content=body, timeout=60)
    assert answer.json()["accepted"] == 50_000
    assert memory.peak_growth_mib() < 4 * 8
    over = orjson.dumps([record] * 50_001)
    refused = httpx.post(f"{sidecar.url}/v1/records", content=over, timeout=60)
    assert refused.status_code == 413
    assert sidecar.value("kvlens_requests_total") == 50_000
