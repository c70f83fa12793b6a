"""Issue 15, defects 6 and 8: client input that still reached a 500, and refusals that named the
wrong limit, against a real ``kvlens serve``.

Each 500 logged a long traceback: JSON nested 100,000 levels (a pushed record's unknown field,
an OTLP JSON export) raised RecursionError in the decoder, a protobuf double cut short raised
struct.error, and an OpenMetrics ``Accept`` with a version that is not a number raised in
prometheus_client. Now: 400 (the Accept: the plain-text exposition), nothing echoed, no traceback.
"""

from __future__ import annotations

import httpx
import orjson
import pytest

from kvlens.sources.otlp import length_delimited
from tests.hostile.conftest import Serve
from tests.live import parse_samples, total

pytestmark = pytest.mark.integration
CANARY = "CANARY-5f1e"
DEEP = 100_000
RECORD = {"prompt_tokens": 8, "cached_tokens": 4}


def deep_record() -> bytes:
    """A valid record whose unknown field nests DEEP arrays (200 KB)."""
    return (
        b'{"prompt_tokens":8,"cached_tokens":4,"' + CANARY.encode() + b'":' + b"[" * DEEP + b"]" * DEEP + b"}"
    )


def otlp_json(value: bytes) -> bytes:
    attribute = b'{"key":"gen_ai.usage.input_tokens","value":' + value + b"}"
    return b'{"resourceSpans":[{"scopeSpans":[{"spans":[{"attributes":[' + attribute + b"]}]}]}]}"


def protobuf_export(*spans: bytes) -> bytes:
    scope_spans = length_delimited(1, length_delimited(1, b"vllm")) + b"".join(
        length_delimited(2, s) for s in spans
    )
    return length_delimited(1, length_delimited(2, scope_spans))


def attribute(key: str, any_value: bytes) -> bytes:
    return length_delimited(9, length_delimited(1, key.encode()) + length_delimited(2, any_value))


def refused(sidecar_output: str) -> None:
    assert "Traceback" not in sidecar_output, sidecar_output[-3000:]
    assert "ERROR" not in sidecar_output, sidecar_output[-3000:]
    assert CANARY not in sidecar_output


def test_deep_json_is_a_400_not_a_500(serve: Serve) -> None:
    sidecar = serve()
    url = sidecar.url
    bodies = {"one record": deep_record(), "NDJSON": deep_record() + b"\n" + deep_record()}
    for name, body in bodies.items():
        answer = httpx.post(f"{url}/v1/records", content=body, timeout=30)
        assert answer.status_code == 400, (name, answer.text[:300])
        assert CANARY not in answer.text
    # beside good records (or as an array element, as any element that does not decode), a deep
    # one is one malformed record; the others count
    good = orjson.dumps(RECORD)
    for body in (
        good + b"\n" + deep_record() + b"\n" + good,
        b"[" + good + b"," + deep_record() + b"," + good + b"]",
    ):
        answer = httpx.post(f"{url}/v1/records", content=body, timeout=30)
        assert answer.status_code == 200, answer.text[:300]
        assert answer.json()["accepted"] == 2
        assert [(r["index"], r["reason"]) for r in answer.json()["rejected"]] == [(1, "malformed_json")]

    nested_value = b'{"arrayValue":{"values":[' * DEEP + b"{}" + b"]}}" * DEEP
    for body in (otlp_json(nested_value), b'{"resourceSpans":' + b"[" * DEEP + b"]" * DEEP + b"}"):
        answer = httpx.post(
            f"{url}/v1/traces", content=body, headers={"content-type": "application/json"}, timeout=30
        )
        assert answer.status_code == 400, answer.text[:300]
    refused(sidecar.output())


def test_a_protobuf_double_cut_short_is_a_400(serve: Serve) -> None:
    sidecar = serve()
    counted = attribute("gen_ai.usage.cached_tokens", b"\x18\x04")  # int_value 4
    short_double = attribute("gen_ai.usage.input_tokens", b"\x21\x00\x00\x00")  # 3 of 8 bytes
    body = protobuf_export(counted + short_double)
    assert len(body) == 83
    answer = httpx.post(
        f"{sidecar.url}/v1/traces", content=body, headers={"content-type": "application/x-protobuf"}
    )
    assert answer.status_code == 400, answer.content
    refused(sidecar.output())


@pytest.mark.parametrize(
    "accept",
    [
        "application/openmetrics-text; version=abc",
        "application/openmetrics-text; version=1.x",
        "application/openmetrics-text; version=1.\x7f",
        "text/plain; version=1.x",
        f"application/openmetrics-text; version=1.0.0{CANARY}",
        f"application/openmetrics-text; version=9.{CANARY}",
        "application/openmetrics-text; version=99999999999.0.0",
    ],
)
def test_an_accept_header_that_does_not_parse_gets_plain_text(serve: Serve, accept: str) -> None:
    sidecar = serve()
    answer = httpx.get(f"{sidecar.url}/metrics", headers={"accept": accept})
    assert answer.status_code == 200, answer.text[:300]
    assert answer.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert total(parse_samples(answer.text), "kvlens_ingest_open") == 0
    assert CANARY not in str(answer.headers) and "9999" not in str(answer.headers)
    refused(sidecar.output())


def test_prometheus_still_gets_openmetrics(serve: Serve) -> None:
    sidecar = serve()
    prometheus = (
        "application/openmetrics-text;version=1.0.0;escaping=underscores;q=0.5,"
        "application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=1.0.0;escaping=underscores;q=0.3,"
        "text/plain;version=0.0.4;q=0.2,*/*;q=0.1"
    )
    answer = httpx.get(f"{sidecar.url}/metrics", headers={"accept": prometheus})
    assert answer.headers["content-type"].startswith("application/openmetrics-text; version=1.0.0")
    assert answer.text.endswith("# EOF\n")


def test_a_compact_protobuf_export_is_refused_only_past_the_span_limit(serve: Serve) -> None:
    sidecar = serve("--host", "127.0.0.1", KVLENS_MAX_RECORDS_PER_REQUEST="1000")
    named = length_delimited(5, b"x")  # a span with a name and nothing else: 6 bytes on the wire
    headers = {"content-type": "application/x-protobuf"}
    answer = httpx.post(f"{sidecar.url}/v1/traces", content=protobuf_export(*[named] * 1000), headers=headers)
    assert answer.status_code == 200, answer.content
    empty = protobuf_export(*[b""] * 1000)  # 2 bytes a span
    assert httpx.post(f"{sidecar.url}/v1/traces", content=empty, headers=headers).status_code == 200
    over = httpx.post(f"{sidecar.url}/v1/traces", content=protobuf_export(*[named] * 1001), headers=headers)
    assert over.status_code == 413
    assert b"more than 1000 spans" in over.content


def test_too_many_prefix_hashes_are_too_long_not_a_list(serve: Serve) -> None:
    sidecar = serve()
    record = {**RECORD, "prefix_hashes": list(range(1_000_000))}
    answer = httpx.post(f"{sidecar.url}/v1/records", content=orjson.dumps(record), timeout=30)
    assert answer.status_code == 200, answer.text[:300]
    assert answer.json()["rejected"] == [
        {
            "index": 0,
            "field": "prefix_hashes",
            "reason": "too_long",
            "message": "must be at most 100000 items",
        }
    ]
    assert sidecar.value("kvlens_records_rejected_total", reason="too_long") == 1


def test_blank_ndjson_lines_count_toward_the_record_limit(serve: Serve) -> None:
    sidecar = serve(KVLENS_MAX_RECORDS_PER_REQUEST="50000")
    for body in (b"\n" * 60_000, b" \r\n" * 60_000, orjson.dumps(RECORD) + b"\n" * 60_000):
        answer = httpx.post(f"{sidecar.url}/v1/records", content=body)
        assert answer.status_code == 413, answer.text[:300]
        assert answer.json() == {"error": "more than 50000 records in one request; send smaller batches"}
    # at the limit: 50,000 lines, blank ones included, are taken
    at_limit = (orjson.dumps(RECORD) + b"\n") + b"\n" * 49_998
    answer = httpx.post(f"{sidecar.url}/v1/records", content=at_limit)
    assert answer.status_code == 200, answer.text[:300]
    assert answer.json()["accepted"] == 1
