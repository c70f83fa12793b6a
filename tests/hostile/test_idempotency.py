"""Defect 5: a retried batch counts once, and a batch is never lost to the de-duplication.

Requirement (reliability.md 5.10): ids compared whole; a retry of a batch still in flight gets a
retryable status; only committed batches are remembered, in bounded memory (< 5 MiB for 10k ids),
the oldest forgotten past the window; records de-duplicated by request_id within a bounded window
when the sender asks.
"""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor

import httpx
import orjson
import pytest

from tests.article import article_records
from tests.hostile.conftest import Serve

pytestmark = pytest.mark.integration
BATCH = "kvlens-batch-id"
ARTICLE = orjson.dumps(article_records())


def test_batch_ids_sharing_a_long_prefix_are_different_batches(serve: Serve) -> None:
    sidecar = serve()
    prefix = "p" * 64
    for suffix in ("-first", "-second"):
        answer = httpx.post(f"{sidecar.url}/v1/records", content=ARTICLE, headers={BATCH: prefix + suffix})
        assert answer.json()["accepted"] == 100
    assert sidecar.value("kvlens_requests_total") == 200


def test_a_retry_while_the_first_attempt_is_still_arriving_counts_once(serve: Serve) -> None:
    # A batch id is held from the moment its body has arrived (never while it arrives, which a
    # slow sender would stretch): the retry is counted, and the first attempt, once its body
    # arrives, is answered as a duplicate.
    sidecar = serve()
    first = socket.create_connection(("127.0.0.1", sidecar.port), timeout=10)
    padded = ARTICLE + b" " * 20_000
    first.sendall(
        b"POST /v1/records HTTP/1.1\r\nHost: kvlens\r\nkvlens-batch-id: b-1\r\n"
        + f"Content-Length: {len(padded)}\r\n\r\n".encode()
        + padded[:17_000]
    )
    try:
        assert sidecar.wait_for("kvlens_ingest_in_flight", 1) == 1
        retry = httpx.post(f"{sidecar.url}/v1/records", content=ARTICLE, headers={BATCH: "b-1"})
        assert retry.status_code == 200 and retry.json()["accepted"] == 100
        first.sendall(padded[17_000:])
        answer = read_response(first)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:40]
        assert b"kvlens-duplicate: 1" in answer and b'"duplicate":true' in answer
    finally:
        first.close()
    assert sidecar.value("kvlens_requests_total") == 100
    replay = httpx.post(f"{sidecar.url}/v1/records", content=ARTICLE, headers={BATCH: "b-1"})
    assert replay.status_code == 200 and replay.headers["kvlens-duplicate"] == "1"
    assert sidecar.value("kvlens_requests_total") == 100


def test_a_batch_that_failed_with_400_is_not_remembered(serve: Serve) -> None:
    sidecar = serve()
    bad = httpx.post(f"{sidecar.url}/v1/records", content=b"[not json", headers={BATCH: "b-2"})
    assert bad.status_code == 400
    assert (
        httpx.post(f"{sidecar.url}/v1/records", content=b"[not json", headers={BATCH: "b-2"}).status_code
        == 400
    )
    good = httpx.post(f"{sidecar.url}/v1/records", content=ARTICLE, headers={BATCH: "b-2"})
    assert good.status_code == 200 and good.json()["accepted"] == 100
    assert sidecar.value("kvlens_requests_total") == 100


def test_remembered_batches_past_the_window_hold_no_answers_and_the_oldest_count_again(
    serve: Serve,
) -> None:
    # The window's own cost (about 230 bytes an id, 2.2 MiB for the default 10,000) is measured
    # exactly in tests/unit/test_ingest.py. Here the real process, with a window of 500 that
    # 1,300 batches cross twice over: what it keeps per batch is the ledger's entry, never the
    # answer (each batch has 100 rejected records, so its answer lists 100 reasons, about 15 KB:
    # 1,000 kept would be +15 MiB), and a batch pushed out of the window counts again.
    sidecar = serve(KVLENS_BATCH_ID_WINDOW="500")
    bad = orjson.dumps([{"prompt_tokens": "many", "cached_tokens": 0}] * 100)

    def send(ids: range) -> None:
        with httpx.Client() as client:
            for i in ids:
                answer = client.post(f"{sidecar.url}/v1/records", content=bad, headers={BATCH: f"{i:040d}"})
                assert answer.json()["rejected_count"] == 100

    send(range(300))  # warm-up: allocator arenas, caches
    memory = sidecar.memory()
    before = memory.rss_mib()
    with ThreadPoolExecutor(4) as pool:  # commits interleave: the last of each range is recent
        list(pool.map(send, [range(start, start + 250) for start in range(300, 1300, 250)]))
    assert memory.rss_mib() - before < 5
    assert sidecar.value("kvlens_records_rejected_total") == 130_000
    duplicate = httpx.post(f"{sidecar.url}/v1/records", content=bad, headers={BATCH: f"{1299:040d}"})
    assert duplicate.headers["kvlens-duplicate"] == "1"
    assert duplicate.json()["rejected_count"] == 100
    assert sidecar.value("kvlens_records_rejected_total") == 130_000
    forgotten = httpx.post(f"{sidecar.url}/v1/records", content=bad, headers={BATCH: f"{0:040d}"})
    assert forgotten.status_code == 200 and "kvlens-duplicate" not in forgotten.headers
    assert sidecar.value("kvlens_records_rejected_total") == 130_100


def test_request_ids_are_deduplicated_when_the_sender_asks(serve: Serve) -> None:
    sidecar = serve()
    dedupe = {"kvlens-dedupe": "request-id"}
    for _ in range(3):
        assert httpx.post(f"{sidecar.url}/v1/records", content=ARTICLE, headers=dedupe).status_code == 200
    assert sidecar.value("kvlens_requests_total") == 100
    assert sidecar.value("kvlens_records_rejected_total", reason="duplicate") == 200
    # vLLM's n>1 children share their parent's request_id; they differ in what they measured
    children = [
        {"request_id": "chatcmpl-n3", "prompt_tokens": 500, "cached_tokens": 0 if i == 0 else 496,
         "output_tokens": 20 + i, "e2e_seconds": 0.5 + i / 100}
        for i in range(3)
    ]  # fmt: skip
    for _ in range(2):
        httpx.post(f"{sidecar.url}/v1/records", content=orjson.dumps(children), headers=dedupe)
    assert sidecar.value("kvlens_requests_total") == 103
    # without the header, nothing is de-duplicated
    httpx.post(f"{sidecar.url}/v1/records", content=ARTICLE)
    assert sidecar.value("kvlens_requests_total") == 203


def read_response(sock: socket.socket) -> bytes:
    """A whole HTTP/1.1 response (its head and Content-Length bytes of body): one recv may end
    after the head."""
    answer = b""
    while b"\r\n\r\n" not in answer:
        chunk = sock.recv(65536)
        if not chunk:
            return answer
        answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    length = next(
        (
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        ),
        0,
    )
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body
