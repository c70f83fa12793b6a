"""The counting step after the sums (the requests' diagnoses, the modelled caches, the tenants'
block storers) against a record that trips one of them: a failure there came after the batch
was counted, so the sender got a 500 and its retry counted the batch twice. A batch is either
refused before anything of it is counted, or counted once and answered 200."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
import uvicorn
from prometheus_client import CollectorRegistry

from kvlens.config import load_settings
from kvlens.exporter.app import create_app
from kvlens.fleet.misses import MissClassifier
from kvlens.records import schema
from kvlens.simulate.modelled import ModelledFleet
from kvlens.tenancy import BlockStorers
from tests.hostile.conftest import Serve
from tests.live import free_port, parse_samples, total

pytestmark = pytest.mark.timeout(60)


def records(first: int = 0) -> list[dict[str, Any]]:
    """Two records every consumer reads: a tenant, a replica, a request id, prefix_hashes."""
    return [
        {
            "model": "m",
            "prompt_tokens": 64,
            "cached_tokens": 16,
            "block_size": 16,
            "replica": "r0",
            "tenant": f"t{i % 2}",
            "request_id": f"q{i}",
            "prefix_hashes": [1, 2, f"id-{i}", i + 10],
        }
        for i in range(first, first + 2)
    ]


def test_a_prefix_id_of_a_lone_surrogate_is_refused_before_anything_is_counted(serve: Serve) -> None:
    """Before: the record passed validation, was counted, then its key (blake2b of the id's UTF-8)
    raised in the requests' diagnoses: a 500 after counting (the retry counted it again)."""
    sidecar = serve()
    bad = {"prompt_tokens": 32, "cached_tokens": 0, "prefix_hashes": ["ok", "\ud800"]}
    # json writes a lone surrogate as its \\uXXXX escape (orjson refuses to)
    body = b"[" + b",".join([*map(orjson.dumps, records()), json.dumps(bad).encode()]) + b"]"
    answer = httpx.post(f"http://127.0.0.1:{sidecar.port}/v1/records", content=body, timeout=20)
    assert answer.status_code == 200, answer.text
    assert answer.json()["accepted"] == 2
    assert [r["reason"] for r in answer.json()["rejected"]] == ["not_a_list"]
    samples = sidecar.samples()
    assert total(samples, "kvlens_requests_total") == 2
    assert total(samples, "kvlens_records_rejected_total", reason="not_a_list") == 1
    assert total(samples, "kvlens_ingest_consumer_errors_total") == 0


@pytest.fixture
def sidecar() -> Iterator[str]:
    """The app in this process (so a consumer can be made to fail) behind a real uvicorn."""
    settings = load_settings(modelled_capacity_blocks=100, tenant_remember_blocks=100)
    app = create_app(settings, CollectorRegistry())
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    ready = threading.Event()
    while not ready.wait(0.01):
        if server.started or not thread.is_alive():
            ready.set()
    assert server.started
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(20)


def boom(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("a consumer's bug")


CONSUMERS = {
    "diagnoses": (MissClassifier, "diagnose"),
    "modelled": (ModelledFleet, "record"),
    "tenant_storers": (BlockStorers, "add"),
}


@pytest.mark.parametrize("consumer", sorted(CONSUMERS))
def test_a_failing_consumer_leaves_the_batch_counted_once_and_answered_200(
    sidecar: str, consumer: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: the consumer's exception became a 500 after the sums had the batch; the sender's
    retry (same records, a new attempt) counted them twice."""
    owner, name = CONSUMERS[consumer]
    monkeypatch.setattr(owner, name, boom)
    caplog.set_level(logging.WARNING)
    with httpx.Client(timeout=20) as client:
        for first in (0, 2, 4):  # three batches, each failing in the consumer
            answer = client.post(f"{sidecar}/v1/records", content=orjson.dumps(records(first)))
            assert answer.status_code == 200, answer.text
            assert answer.json()["accepted"] == 2
        samples = parse_samples(client.get(f"{sidecar}/metrics").text)
    assert total(samples, "kvlens_requests_total") == 6
    assert total(samples, "kvlens_tenant_requests_total") == 6
    assert total(samples, "kvlens_ingest_consumer_errors_total", consumer=consumer) == 3
    assert total(samples, "kvlens_ingest_consumer_errors_total") == 3
    logged = [r for r in caplog.records if "a consumer's bug" in (r.exc_text or r.getMessage())]
    assert len(logged) == 1, [r.getMessage() for r in caplog.records]  # once per kind per interval


def test_string_prefix_ids_are_keyed_once_a_batch_for_all_its_readers(
    sidecar: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: the diagnoses, the modelled caches and the tenants' storers each hashed a string
    id again (blake2b): three keys an id, three times the CPU of a body of string ids."""
    keyed: list[int | str] = []
    key = schema.prefix_key

    def counted(prefix_id: int | str) -> int:
        keyed.append(prefix_id)
        return key(prefix_id)

    monkeypatch.setattr(schema, "prefix_key", counted)
    sent = records()
    answer = httpx.post(f"{sidecar}/v1/records", content=orjson.dumps(sent), timeout=20)
    assert answer.status_code == 200, answer.text
    # each record mixes ints and strings: every id of it goes through prefix_key, once
    assert sorted(map(repr, keyed)) == sorted(repr(i) for r in sent for i in r["prefix_hashes"])
