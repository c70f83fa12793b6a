"""OTLP/HTTP traces: SGLang and vLLM span attributes, protobuf and JSON, partial success."""

from __future__ import annotations

import contextlib
import gzip
from collections.abc import Iterator
from typing import Any

import numpy as np
import orjson
import pytest
from fastapi.testclient import TestClient
from hypothesis import given
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from kvlens.config import load_settings
from kvlens.errors import PayloadUndecodable, UnsupportedMediaType
from kvlens.exporter.app import create_app
from kvlens.sources import otlp


def read_traces(body: bytes, content_type: str) -> otlp.TracesResult:
    return otlp.read_traces(body, otlp.media_type(content_type), 1000)


# The span vLLM 0.33 emits (reference/engines.md section 2): no cached-token attribute.
VLLM_SPAN = {
    "gen_ai.latency.time_to_first_token": 0.081,
    "gen_ai.latency.e2e": 0.512,
    "gen_ai.latency.time_in_queue": 0.004,
    "gen_ai.usage.prompt_tokens": 2048,
    "gen_ai.usage.completion_tokens": 64,
    "gen_ai.latency.time_in_model_prefill": 0.071,
    "gen_ai.latency.time_in_model_decode": 0.42,
    "gen_ai.request.id": "chatcmpl-abc",
}
# SGLang's span (section 7) carries gen_ai.usage.cached_tokens and the response model.
SGLANG_SPAN = {
    **VLLM_SPAN,
    "gen_ai.usage.cached_tokens": 1024,
    "gen_ai.response.model": "qwen",
    "gen_ai.response.finish_reasons": ["stop"],
}
PROPOSED_VLLM_SPAN = {**VLLM_SPAN, "gen_ai.usage.cache_read.input_tokens": 512}
HTTP_SPAN = {"http.route": "/v1/chat/completions"}  # not an LLM request span: ignored


def json_value(value: Any) -> dict[str, Any]:
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}
    if isinstance(value, float):
        return {"doubleValue": value}
    if isinstance(value, list):
        return {"arrayValue": {"values": [json_value(v) for v in value]}}
    return {"stringValue": value}


def json_export(*spans: dict[str, Any]) -> bytes:
    return orjson.dumps(
        {
            "resourceSpans": [
                {
                    "resource": {
                        "attributes": [{"key": "service.name", "value": {"stringValue": "vllm-server"}}]
                    },
                    "scopeSpans": [
                        {
                            "scope": {"name": "vllm.tracing.otel"},
                            "spans": [
                                {
                                    "name": "llm_request",
                                    "kind": 2,
                                    "traceId": "5b8efff798038103d269b633813fc60c",
                                    "spanId": "eee19b7ec3c1b174",
                                    "attributes": [
                                        {"key": k, "value": json_value(v)} for k, v in span.items()
                                    ],
                                }
                                for span in spans
                            ],
                        }
                    ],
                }
            ]
        }
    )


def any_value(value: Any) -> AnyValue:
    if isinstance(value, int):
        return AnyValue(int_value=value)
    if isinstance(value, float):
        return AnyValue(double_value=value)
    if isinstance(value, list):
        result = AnyValue()
        result.array_value.values.extend(any_value(v) for v in value)
        return result
    return AnyValue(string_value=value)


def protobuf_export(*spans: dict[str, Any], scope_name: str = "vllm.tracing.otel") -> bytes:
    request = ExportTraceServiceRequest()
    scope = request.resource_spans.add().scope_spans.add()
    scope.scope.name = scope_name
    for attributes in spans:
        span = scope.spans.add(name="llm_request")
        span.attributes.extend(KeyValue(key=k, value=any_value(v)) for k, v in attributes.items())
    return bytes(request.SerializeToString())


@pytest.mark.parametrize(
    ("encode", "content_type"),
    [(json_export, "application/json"), (protobuf_export, "application/x-protobuf")],
)
def test_spans_become_records(encode: Any, content_type: str) -> None:
    result = read_traces(encode(SGLANG_SPAN, PROPOSED_VLLM_SPAN, VLLM_SPAN, HTTP_SPAN), content_type)
    batch = result.validated.batch
    assert result.spans == 3
    assert batch.cached_tokens.tolist() == [1024, 512]
    assert batch.prompt_tokens.tolist() == [2048, 2048]
    assert batch.model_names == ["qwen"]
    assert batch.finish_reason == ["stop", None]
    assert batch.prefill_seconds.tolist() == [0.071, 0.071]
    assert batch.ttft_seconds.tolist() == [0.081, 0.081]
    assert result.validated.rejections.details(5) == [
        {
            "index": 2,
            "field": None,
            "reason": "missing_cached_tokens",
            "message": "the span has no cached-token attribute (it is not counted as a miss)",
        }
    ]


def test_undecodable_bodies() -> None:
    for body, content_type in ((b"{", "application/json"), (b"\xff\xff\xff", "application/x-protobuf")):
        with pytest.raises(PayloadUndecodable):
            read_traces(body, content_type)
    with pytest.raises(UnsupportedMediaType):
        read_traces(b"", "text/csv")


@given(st.binary(max_size=200))
def test_protobuf_parser_fuzz(body: bytes) -> None:
    with contextlib.suppress(PayloadUndecodable):
        read_traces(body, "application/x-protobuf")


@given(
    st.recursive(
        st.none() | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=5),
        lambda c: (
            st.lists(c, max_size=3)
            | st.dictionaries(
                st.sampled_from(
                    ["resourceSpans", "scopeSpans", "spans", "attributes", "key", "value", "intValue"]
                ),
                c,
                max_size=3,
            )
        ),
        max_leaves=15,
    )
)
def test_json_parser_fuzz(value: Any) -> None:
    with contextlib.suppress(PayloadUndecodable):
        read_traces(orjson.dumps(value), "application/json")


@pytest.fixture
def client() -> Iterator[TestClient]:
    with TestClient(create_app(load_settings(), CollectorRegistry())) as test_client:
        yield test_client


def test_partial_success_in_the_request_encoding(client: TestClient) -> None:
    answer = client.post(
        "/v1/traces",
        content=gzip.compress(protobuf_export(SGLANG_SPAN, VLLM_SPAN)),
        headers={"content-type": "application/x-protobuf", "content-encoding": "gzip"},
    )
    assert answer.status_code == 200
    assert answer.headers["content-type"] == "application/x-protobuf"
    parsed = ExportTraceServiceResponse.FromString(answer.content)
    assert parsed.partial_success.rejected_spans == 1
    assert "missing_cached_tokens" in parsed.partial_success.error_message

    answer = client.post(
        "/v1/traces", content=json_export(SGLANG_SPAN), headers={"content-type": "application/json"}
    )
    assert answer.status_code == 200 and answer.json() == {}
    text = client.get("/metrics").text
    values = {
        (s.name, frozenset(s.labels.items())): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    assert values[("kvlens_records_received_total", frozenset({("source", "otlp")}))] == 3
    assert (
        values[
            (
                "kvlens_records_rejected_total",
                frozenset({("source", "otlp"), ("reason", "missing_cached_tokens")}),
            )
        ]
        == 1
    )
    assert (
        values[
            (
                "kvlens_requests_total",
                frozenset({("model", "qwen"), ("prompt_len", "2048-8191"), ("cache", "hit")}),
            )
        ]
        == 2
    )


def test_bad_exports_get_a_status_body(client: TestClient) -> None:
    answer = client.post("/v1/traces", content=b"{nope", headers={"content-type": "application/json"})
    assert answer.status_code == 400
    assert answer.json()["code"] == 3
    answer = client.post(
        "/v1/traces", content=b"\xff\xff", headers={"content-type": "application/x-protobuf"}
    )
    assert answer.status_code == 400
    assert answer.content.startswith(b"\x08\x03\x12")
    assert client.post("/v1/traces", content=b"", headers={"content-type": "text/csv"}).status_code == 415


@pytest.mark.parametrize(
    ("encode", "content_type"),
    [(json_export, "application/json"), (protobuf_export, "application/x-protobuf")],
)
def test_prefill_is_read_from_vllm_spans_only(encode: Any, content_type: str) -> None:
    """SGLang's time_in_model_prefill runs from the dispatch to the first token: queueing included."""
    sglang = read_traces(protobuf_export(SGLANG_SPAN, scope_name="sglang server"), "application/x-protobuf")
    assert np.isnan(sglang.validated.batch.prefill_seconds).all()
    vllm = read_traces(encode(PROPOSED_VLLM_SPAN), content_type)
    assert vllm.validated.batch.prefill_seconds.tolist() == [0.071]


def test_attributes_of_other_instrumentations_and_their_precedence() -> None:
    openinference = {"llm.token_count.prompt": 800, "llm.token_count.prompt_details.cache_read": 512,
                     "llm.model_name": "m-oi"}  # fmt: skip
    openllmetry = {"gen_ai.usage.input_tokens": 900, "gen_ai.usage.cache_read_input_tokens": 256,
                   "gen_ai.request.model": "asked", "gen_ai.response.model": "served",
                   "gen_ai.response.time_to_first_chunk": 0.2}  # fmt: skip
    sglang_reasons = {**SGLANG_SPAN, "gen_ai.response.finish_reasons": '["length"]'}
    batch = read_traces(protobuf_export(openinference, openllmetry, sglang_reasons), "application/x-protobuf")
    records = batch.validated.batch
    assert records.prompt_tokens.tolist() == [800, 900, 2048]
    assert records.cached_tokens.tolist() == [512, 256, 1024]
    assert [records.model_names[c] for c in records.model_codes] == ["m-oi", "served", "qwen"]
    assert records.ttft_seconds.tolist()[1] == 0.2
    assert records.finish_reason == [None, None, "length"]
