"""The per-request diagnoses (``GET /v1/requests/{id}/diagnosis``) against a sender of
``prefix_hashes`` built to cost: a record of 100,000 blocks is classified in pure Python, and
neither the endpoint (on the event loop) nor ``/metrics`` may wait for it."""

from __future__ import annotations

import threading
from typing import Any
from urllib.parse import quote

import httpx
import orjson
import pytest

from kvlens.exporter.diagnoses import RequestDiagnoses
from kvlens.records import RecordBatch
from kvlens.sources.push import read_records
from tests.hostile.conftest import Serve

pytestmark = pytest.mark.timeout(60)


def batch(*records: dict[str, Any]) -> RecordBatch:
    validated = read_records(orjson.dumps(list(records)), 50_000, keep_prefix_hashes=True)
    assert validated.batch is not None
    return validated.batch


def record(request_id: str, ids: list[int | str], **fields: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "prompt_tokens": 16 * len(ids),
        "cached_tokens": 0,
        "block_size": 16,
        "request_id": request_id,
        "prefix_hashes": ids,
        **fields,
    }


def test_readers_do_not_wait_for_a_record_being_classified() -> None:
    """Before: the kept diagnoses' lock was held while a record's blocks were classified (0.2 s
    for 100,000 int ids, 0.44 s for strings): the endpoint, called on the event loop, held every
    other request (``/metrics``, health probes) that long, and a scrape's miss counts waited."""
    diagnoses = RequestDiagnoses(10, 1_000, 16)
    diagnoses.add(batch(record("kept", [1, 2])))
    classifying, release = threading.Event(), threading.Event()
    classify = diagnoses.classifier.diagnose

    def held(*args: Any, **kwargs: Any) -> Any:
        classifying.set()
        release.wait(30)
        return classify(*args, **kwargs)

    diagnoses.classifier.diagnose = held  # type: ignore[method-assign]
    worker = threading.Thread(target=diagnoses.add, args=(batch(record("slow", [3, 4])),))
    worker.start()
    try:
        assert classifying.wait(10)
        answers: dict[str, Any] = {}
        reader = threading.Thread(
            target=lambda: answers.update(kept=diagnoses.get("kept"), counts=diagnoses.counts())
        )
        reader.start()
        reader.join(5)
        assert not reader.is_alive(), "a reader waited for the classification"
        assert answers["kept"].cause == "new"
        assert answers["counts"]["new"] == 1
    finally:
        release.set()
        worker.join(10)
    got = diagnoses.get("slow")
    assert got is not None and got.tokens[0] == 32


def path_of(request_id: str) -> str:
    return quote(request_id, safe="").replace(".", "%2E")


ODD_IDS = [
    "a/b",
    "/lead",
    "trail/",
    "..",
    "../..",
    "x y",
    "50%",
    "?q=1",
    "#h",
    "é✓😀",
    "a\\b",
    "%2F",
    "x" * 256,
]


def test_every_kept_request_id_is_answered_however_it_is_spelled(serve: Serve) -> None:
    """Before: the route's ``{request_id}`` matched no ``/``, so a request id with one (a
    gateway's ``tenant/123``, percent-encoded by the client as ``tenant%2F123``, decoded by the
    server before routing) was kept but never answered: 404. Every id is read whole now; one past
    the record's 256 characters was never kept: 404. An id of dots (``..``) is a dot segment to
    every URL client unless its dots are sent as ``%2E``, as here."""
    kvlens = serve()
    records = [
        {
            "request_id": request_id,
            "prompt_tokens": 32,
            "cached_tokens": 0,
            "block_size": 16,
            "prefix_hashes": [i, -i],
        }
        for i, request_id in enumerate(ODD_IDS, 1)
    ]
    assert httpx.post(f"{kvlens.url}/v1/records", json=records).json()["accepted"] == len(ODD_IDS)
    for request_id in ODD_IDS:
        answer = httpx.get(f"{kvlens.url}/v1/requests/{path_of(request_id)}/diagnosis")
        assert (answer.status_code, answer.json().get("request_id")) == (200, request_id)
    for never in ("x" * 257, "x" * 60_000, "nope", "a/b/"):
        answer = httpx.get(f"{kvlens.url}/v1/requests/{path_of(never)}/diagnosis")
        assert answer.status_code in (404, 414, 431), answer.status_code
