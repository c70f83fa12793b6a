"""OTLP/HTTP traces (``POST /v1/traces``): LLM request spans -> kvlens records.

A span is an LLM request when it carries ``gen_ai.usage.prompt_tokens`` (or
``gen_ai.usage.input_tokens``); other spans in the same export are ignored. Cached tokens come
from ``gen_ai.usage.cached_tokens`` (SGLang) or ``gen_ai.usage.cache_read.input_tokens`` (the
name proposed for vLLM, which sets none as of 0.33). A request span without either is rejected
as ``missing_cached_tokens``, never counted as a miss.

Protobuf bodies are decoded with ``opentelemetry-proto`` (the ``otlp`` extra); JSON bodies
(proto3 JSON: ``intValue`` as a string, hex ids) are read directly.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import orjson

from kvlens.records import Rejections, Validated, batch_from_objects

SOURCE = "otlp"
PROTOBUF = "application/x-protobuf"
JSON = "application/json"

# span attribute -> record field; the first present attribute of a field wins
_ATTRIBUTES = (
    ("gen_ai.usage.prompt_tokens", "prompt_tokens"),
    ("gen_ai.usage.input_tokens", "prompt_tokens"),
    ("gen_ai.usage.cached_tokens", "cached_tokens"),
    ("gen_ai.usage.cache_read.input_tokens", "cached_tokens"),
    ("gen_ai.usage.completion_tokens", "output_tokens"),
    ("gen_ai.usage.output_tokens", "output_tokens"),
    ("gen_ai.latency.time_in_queue", "queue_seconds"),
    ("gen_ai.latency.time_in_model_prefill", "prefill_seconds"),
    ("gen_ai.latency.time_to_first_token", "ttft_seconds"),
    ("gen_ai.latency.time_in_model_decode", "decode_seconds"),
    ("gen_ai.latency.e2e", "e2e_seconds"),
    ("gen_ai.request.id", "request_id"),
    ("gen_ai.response.model", "model"),
    ("gen_ai.request.model", "model"),
    ("gen_ai.response.finish_reasons", "finish_reason"),
)
_FIELD_OF = dict(_ATTRIBUTES)


class TracesUndecodable(Exception):
    """The body is not an OTLP trace export of the declared content type."""


class ProtobufUnavailable(Exception):
    """A protobuf body arrived but opentelemetry-proto is not installed."""


@dataclass(frozen=True)
class TracesResult:
    validated: Validated
    spans: int  # LLM request spans seen (accepted + rejected)


def read_traces(body: bytes, content_type: str) -> TracesResult:
    """Records of the LLM request spans in an export; raises TracesUndecodable."""
    kind = content_type.split(";")[0].strip().lower()
    if kind == JSON:
        spans = list(_json_spans(body))
    elif kind in (PROTOBUF, "application/protobuf"):
        spans = list(_protobuf_spans(body))
    else:
        raise TracesUndecodable(f"unsupported content type {kind[:64]!r}; use {PROTOBUF} or {JSON}")
    records: list[dict[str, Any]] = []
    positions: list[int] = []
    missing: list[int] = []
    for attributes in spans:
        record: dict[str, Any] = {}
        for key, value in attributes.items():
            field = _FIELD_OF.get(key)
            if field is not None and field not in record:
                record[field] = value
        if "prompt_tokens" not in record:
            continue  # not an LLM request span
        index = len(positions) + len(missing)
        if "cached_tokens" not in record:
            missing.append(index)
            continue
        reasons = record.get("finish_reason")
        if isinstance(reasons, list):
            record["finish_reason"] = reasons[0] if reasons and isinstance(reasons[0], str) else None
        records.append(record)
        positions.append(index)
    validated = batch_from_objects(records, positions)
    without_cached = Rejections.single(missing, "missing_cached_tokens")
    return TracesResult(validated.with_rejections(without_cached), len(positions) + len(missing))


def _json_spans(body: bytes) -> Iterator[dict[str, Any]]:
    try:
        export = orjson.loads(body) if body.strip() else {}
    except orjson.JSONDecodeError:
        raise TracesUndecodable("body is not valid JSON") from None
    if not isinstance(export, dict):
        raise TracesUndecodable("an OTLP export is a JSON object")
    for resource_spans in _list(export.get("resourceSpans")):
        for scope_spans in _list(resource_spans.get("scopeSpans")):
            for span in _list(scope_spans.get("spans")):
                yield {
                    item["key"]: _json_value(item.get("value"))
                    for item in _list(span.get("attributes"))
                    if isinstance(item.get("key"), str)
                }


def _list(value: Any) -> list[dict[str, Any]]:
    return [item for item in value if isinstance(item, dict)] if isinstance(value, list) else []


def _json_value(value: Any) -> Any:
    if not isinstance(value, dict):
        return None
    if "intValue" in value:  # int64 is a string in proto3 JSON
        raw = value["intValue"]
        if isinstance(raw, int) and not isinstance(raw, bool):
            return raw
        return int(raw) if isinstance(raw, str) and raw.lstrip("-").isdigit() else raw
    if "doubleValue" in value:
        return value["doubleValue"]
    if "stringValue" in value:
        return value["stringValue"]
    if "boolValue" in value:
        return value["boolValue"]
    if "arrayValue" in value and isinstance(value["arrayValue"], dict):
        return [_json_value(v) for v in _list(value["arrayValue"].get("values"))]
    return None


def _protobuf_spans(body: bytes) -> Iterator[dict[str, Any]]:
    try:
        from google.protobuf.message import DecodeError
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    except ImportError:
        raise ProtobufUnavailable(
            "protobuf OTLP needs opentelemetry-proto: pip install 'kvlens[otlp]'"
        ) from None
    request = ExportTraceServiceRequest()
    try:
        request.ParseFromString(body)
    except (DecodeError, ValueError):
        raise TracesUndecodable("body is not a valid OTLP protobuf export") from None
    for resource_spans in request.resource_spans:
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                yield {attribute.key: _protobuf_value(attribute.value) for attribute in span.attributes}


def _protobuf_value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_protobuf_value(v) for v in value.array_value.values]
    if kind in ("int_value", "double_value", "string_value", "bool_value"):
        return getattr(value, kind)
    return None


def error_status(message: str, content_type: str) -> bytes:
    """A google.rpc.Status (code 3, INVALID_ARGUMENT) for a 400, in the request's encoding."""
    if content_type.split(";")[0].strip().lower() == JSON:
        return orjson.dumps({"code": 3, "message": message})
    text = message.encode()[:1000]
    return b"\x08\x03" + b"\x12" + _varint(len(text)) + text  # field 1 code, field 2 message


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def response(rejected: int, message: str, content_type: str) -> bytes:
    """ExportTraceServiceResponse, in the request's encoding (partial success when rejected)."""
    if content_type.split(";")[0].strip().lower() == JSON:
        body: dict[str, Any] = {}
        if rejected:
            body["partialSuccess"] = {"rejectedSpans": str(rejected), "errorMessage": message}
        return orjson.dumps(body)
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

    answer = ExportTraceServiceResponse()
    if rejected:
        answer.partial_success.rejected_spans = rejected
        answer.partial_success.error_message = message
    return bytes(answer.SerializeToString())
