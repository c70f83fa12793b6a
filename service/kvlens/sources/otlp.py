"""OTLP/HTTP traces (``POST /v1/traces``): LLM request spans -> kvlens records.

A span is an LLM request when it carries a prompt token count; other spans in the same export
are ignored. :data:`ATTRIBUTES` lists what is read, from the GenAI semantic conventions, vLLM's and
SGLang's own tracing, OpenLLMetry and OpenInference; when a span carries several attributes for
one field, the first listed wins (so the model that served the request beats the model that was
asked for), whatever their order in the span. A request span without a cached-token attribute
is rejected as ``missing_cached_tokens``, never counted as a miss (vLLM 0.33 sets none).
``gen_ai.latency.time_in_model_prefill`` is prefill only in vLLM's spans (first token minus
scheduled); SGLang's counts from the dispatch, scheduler queueing included, so it is not read
from other instrumentation scopes.

Both encodings are read by decoders of kvlens's own that look only at span attributes and never
build what they skip, so a body's cost is bounded by its size and the limits, not by what it
nests: protobuf by a wire-format reader (spans counted against ``max_records_per_request``; other
fields stepped over, at most one per :data:`FIELD_BYTES` body bytes), JSON by msgspec, one span
at a time, after a scan has counted the spans. An array value is read one level deep: an array
inside it reads as an empty one (no attribute kvlens reads holds one), so no value recurses.
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

import msgspec
import orjson

from kvlens import jsonscan
from kvlens.errors import PayloadUndecodable, TooManyRecords, UnsupportedMediaType
from kvlens.records import Rejections, Validated, batch_from_objects

SOURCE = "otlp"
PROTOBUF = "application/x-protobuf"
JSON = "application/json"
MEDIA_TYPES: Final = {PROTOBUF: PROTOBUF, "application/protobuf": PROTOBUF, JSON: JSON}
MAX_ATTRIBUTES_PER_SPAN: Final = 1024  # past it a span's attributes are not read (OTel SDKs cap 128)
MAX_ARRAY_VALUE_BYTES: Final = 64 * 1024
# Protobuf fields stepped over outside the span count, per body byte: a real span averages one per
# 7 bytes or more, a span holding only its name one per 6. The densest valid encoding holds one per
# 2; stepping over one per 4 costs at most 1.5 to 2.1 s of a CPU for an 8 MiB body (measured), less
# than a real 50,000-span export of 6 MiB takes (3.4 s).
FIELD_BYTES: Final = 4
FIELD_ALLOWANCE: Final = 1024

# (span attribute, record field, who sets it); for each field the first attribute present wins
ATTRIBUTES: Final = (
    ("gen_ai.usage.input_tokens", "prompt_tokens", "GenAI semconv; OpenLLMetry"),
    ("gen_ai.usage.prompt_tokens", "prompt_tokens", "vLLM, SGLang; older GenAI semconv"),
    ("llm.token_count.prompt", "prompt_tokens", "OpenInference"),
    (
        "gen_ai.usage.cache_read.input_tokens",
        "cached_tokens",
        "GenAI semconv; vLLM PRs #40799, #44325, #54476 (open)",
    ),
    ("gen_ai.usage.cache_read_input_tokens", "cached_tokens", "OpenLLMetry before the semconv name"),
    ("gen_ai.usage.cached_tokens", "cached_tokens", "SGLang"),
    ("llm.token_count.prompt_details.cache_read", "cached_tokens", "OpenInference"),
    ("gen_ai.usage.output_tokens", "output_tokens", "GenAI semconv"),
    ("gen_ai.usage.completion_tokens", "output_tokens", "vLLM, SGLang"),
    ("llm.token_count.completion", "output_tokens", "OpenInference"),
    ("gen_ai.latency.time_in_queue", "queue_seconds", "vLLM (SGLang defines it, never sets it)"),
    (
        "gen_ai.latency.time_in_model_prefill",
        "prefill_seconds",
        "vLLM (scope vllm.*; SGLang's includes queueing: not read)",
    ),
    ("gen_ai.latency.time_to_first_token", "ttft_seconds", "vLLM, SGLang"),
    ("gen_ai.response.time_to_first_chunk", "ttft_seconds", "GenAI semconv (streaming)"),
    ("gen_ai.latency.time_in_model_decode", "decode_seconds", "vLLM, SGLang"),
    ("gen_ai.latency.e2e", "e2e_seconds", "vLLM, SGLang"),
    ("gen_ai.request.id", "request_id", "vLLM, SGLang"),
    ("gen_ai.response.id", "request_id", "GenAI semconv; OpenLLMetry"),
    ("gen_ai.response.model", "model", "GenAI semconv; SGLang; OpenLLMetry"),
    ("gen_ai.request.model", "model", "GenAI semconv; OpenLLMetry"),
    ("llm.model_name", "model", "OpenInference"),
    ("gen_ai.response.finish_reasons", "finish_reason", "GenAI semconv (an array); SGLang (its JSON text)"),
)
PREFILL_SCOPES: Final = ("vllm",)  # instrumentation scopes whose time_in_model_prefill is prefill
_RANK: Final = {key: rank for rank, (key, _, _) in enumerate(ATTRIBUTES)}
_FIELD_OF: Final = {key: field for key, field, _ in ATTRIBUTES}
_WANTED: Final = {key.encode(): key for key, _, _ in ATTRIBUTES}
_INT64: Final = re.compile(r"-?[0-9]{1,19}")


@dataclass(frozen=True)
class TracesResult:
    validated: Validated
    spans: int  # LLM request spans seen (accepted + rejected)


def attributes_table() -> str:
    """The README's table of the span attributes read (a test fails when the README drifts)."""
    rows = ["| record field | span attributes, first present wins | set by |", "|---|---|---|"]
    for field in dict.fromkeys(field for _, field, _ in ATTRIBUTES):
        read = [(key, who) for key, named, who in ATTRIBUTES if named == field]
        keys = "<br>".join(f"`{key}`" for key, _ in read)
        sources = "<br>".join(who for _, who in read)
        rows.append(f"| `{field}` | {keys} | {sources} |")
    return "\n".join(rows)


def media_type(content_type: str | None) -> str:
    """The OTLP encoding of a request's Content-Type (protobuf when none is given)."""
    if not content_type:
        return PROTOBUF
    media = MEDIA_TYPES.get(content_type.split(";")[0].strip().lower())
    if media is None:
        raise UnsupportedMediaType(f"Content-Type must be {PROTOBUF} or {JSON}")
    return media


def read_traces(body: bytes, media: str, max_records: int) -> TracesResult:
    """Records of the LLM request spans in an export of encoding ``media`` (see
    :func:`media_type`); raises :class:`~kvlens.errors.InputError`."""
    spans = _json_spans(body, max_records) if media == JSON else _protobuf_spans(body, max_records)
    records: list[dict[str, Any]] = []
    positions: list[int] = []
    missing: list[int] = []
    malformed: list[int] = []
    for scope, attributes in spans:
        index = len(positions) + len(missing) + len(malformed)
        if attributes is None:  # a span that does not decode: it may have been a request
            malformed.append(index)
            continue
        if not scope.startswith(PREFILL_SCOPES):
            attributes.pop("gen_ai.latency.time_in_model_prefill", None)
        record: dict[str, Any] = {}
        for key in sorted(attributes, key=_RANK.__getitem__):
            record.setdefault(_FIELD_OF[key], attributes[key])
        if "prompt_tokens" not in record:
            continue  # not an LLM request span
        if "cached_tokens" not in record:
            missing.append(index)
            continue
        if "finish_reason" in record:
            record["finish_reason"] = _first_reason(record["finish_reason"])
        records.append(record)
        positions.append(index)
    validated = batch_from_objects(records, positions).with_rejections(
        Rejections.single(missing, "missing_cached_tokens") + Rejections.single(malformed, "malformed_json")
    )
    return TracesResult(validated, len(positions) + len(missing) + len(malformed))


def _first_reason(reasons: Any) -> Any:
    """The first finish reason of an array, or of the JSON text of one (as SGLang sets it)."""
    if isinstance(reasons, str) and reasons.startswith("["):
        try:
            reasons = orjson.loads(reasons)
        except orjson.JSONDecodeError:
            return None
    if isinstance(reasons, list):
        return reasons[0] if reasons and isinstance(reasons[0], str) else None
    return reasons


def _too_many(max_records: int) -> TooManyRecords:
    return TooManyRecords(f"more than {max_records} spans in one export; send smaller batches")


# ---------------------------------------------------------------------------------------------
# JSON (proto3 JSON mapping: lowerCamelCase names, int64 as strings)


class _KeyValue(msgspec.Struct):
    key: str = ""
    value: msgspec.Raw = msgspec.Raw()


class _Span(msgspec.Struct):
    attributes: list[msgspec.Raw] = []


class _Scope(msgspec.Struct, frozen=True):
    name: str = ""


class _ScopeSpans(msgspec.Struct):
    scope: _Scope = _Scope()
    spans: list[msgspec.Raw] = []


class _ResourceSpans(msgspec.Struct):
    scopeSpans: list[_ScopeSpans] = []


class _Export(msgspec.Struct):
    resourceSpans: list[_ResourceSpans] = []


class _ArrayValue(msgspec.Struct):
    values: list[_AnyValue] = []


class _AnyValue(msgspec.Struct):
    stringValue: str | None = None
    boolValue: bool | None = None
    intValue: int | str | None = None
    doubleValue: float | str | None = None
    arrayValue: _ArrayValue | None = None


_EXPORT: Final = msgspec.json.Decoder(_Export)
_SPAN: Final = msgspec.json.Decoder(_Span)
_KEY_VALUE: Final = msgspec.json.Decoder(_KeyValue)
_ANY_VALUE: Final = msgspec.json.Decoder(_AnyValue)
_SPAN_DEPTH: Final = 7  # {resourceSpans: [{scopeSpans: [{spans: [{  <- here


Span = tuple[str, dict[str, Any] | None]  # (instrumentation scope name, attributes or None: undecodable)


def _json_spans(body: bytes, max_records: int) -> Iterator[Span]:
    if not body.strip():
        return
    structure = jsonscan.scan(body, object_depth=_SPAN_DEPTH, object_limit=max_records)
    if structure.objects_at_depth > max_records:
        raise _too_many(max_records)
    if not structure.balanced or body.lstrip()[:1] != b"{":
        raise PayloadUndecodable("the body is not an OTLP JSON export (a JSON object)")
    try:
        export = jsonscan.decode(_EXPORT.decode, body)
    except msgspec.DecodeError:  # also ValidationError: a field of the wrong type
        raise PayloadUndecodable("the body is not an OTLP JSON export") from None
    for resource_spans in export.resourceSpans:
        for scope_spans in resource_spans.scopeSpans:
            for span in scope_spans.spans:
                try:
                    attributes = jsonscan.decode(_SPAN.decode, span).attributes
                    yield scope_spans.scope.name, _json_attributes(attributes)
                except msgspec.DecodeError:
                    yield scope_spans.scope.name, None


def _json_attributes(raw_attributes: list[msgspec.Raw]) -> dict[str, Any]:
    attributes: dict[str, Any] = {}
    for raw in raw_attributes[:MAX_ATTRIBUTES_PER_SPAN]:
        item = jsonscan.decode(_KEY_VALUE.decode, raw)
        if item.key in _RANK and bytes(item.value):
            attributes[item.key] = _json_value(jsonscan.decode(_ANY_VALUE.decode, item.value))
    return attributes


def _json_value(value: _AnyValue, *, in_array: bool = False) -> Any:
    if value.stringValue is not None:
        return value.stringValue
    if value.boolValue is not None:
        return value.boolValue
    if value.intValue is not None:
        raw = value.intValue
        if isinstance(raw, int):
            return raw
        return int(raw) if _INT64.fullmatch(raw) else raw  # else rejected as not_an_integer
    if value.doubleValue is not None:
        raw_double = value.doubleValue
        if isinstance(raw_double, float):
            return raw_double
        special = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
        return special.get(raw_double, raw_double)  # rejected: not finite, or not a number
    if value.arrayValue is not None:
        return [] if in_array else [_json_value(item, in_array=True) for item in value.arrayValue.values]
    return None


# ---------------------------------------------------------------------------------------------
# Protobuf: ExportTraceServiceRequest{1: ResourceSpans{2: ScopeSpans{2: Span{9: KeyValue{
#   1: key, 2: AnyValue{1: string, 2: bool, 3: int64, 4: double, 5: ArrayValue{1: AnyValue}}}}}}}


class _Steps:
    """Counts the fields a request has us step over, spans aside (counted against max_records);
    past the budget the export is refused, naming that limit."""

    def __init__(self, body_bytes: int) -> None:
        self.left = body_bytes // FIELD_BYTES + FIELD_ALLOWANCE


def _protobuf_spans(body: bytes, max_records: int) -> Iterator[Span]:
    steps = _Steps(len(body))
    spans = 0
    view = memoryview(body)
    for resource_spans in _messages(view, 1, steps):
        for scope_spans in _messages(resource_spans, 2, steps):
            # One pass: encoders write the scope (field 1) before the spans (field 2).
            scope: str | bytes = ""
            for number, payload in _fields(scope_spans, steps, wanted=(1, 2)):
                if number == 1 and not scope:
                    scope = next((_utf8(name) for name in _messages(payload, 1, steps)), "")
                elif number == 2:
                    spans += 1
                    steps.left += 1  # a span is counted against max_records, not as a field
                    if spans > max_records:
                        raise _too_many(max_records)
                    yield scope if isinstance(scope, str) else "", _protobuf_attributes(payload, steps)


def _protobuf_attributes(span: memoryview, steps: _Steps) -> dict[str, Any]:
    attributes: dict[str, Any] = {}
    for count, item in enumerate(_messages(span, 9, steps)):
        if count == MAX_ATTRIBUTES_PER_SPAN:
            break
        key_first = len(item) > 2 and item[0] == 0x0A and item[1] < 0x80  # as encoders write it
        if key_first and bytes(item[2 : 2 + item[1]]) not in _WANTED:
            continue  # most attributes: skipped after one look at the key
        key = value = None
        for number, payload in _fields(item, steps, wanted=(1, 2)):
            if number == 1:
                key = _WANTED.get(bytes(payload))
            elif number == 2:
                value = payload
        if key is not None and value is not None:
            attributes[key] = _protobuf_value(value, steps)
    return attributes


def _protobuf_value(value: memoryview, steps: _Steps, *, in_array: bool = False) -> Any:
    result: Any = None
    for number, payload in _fields(value, steps, scalars=True):
        if number == 1 and isinstance(payload, memoryview):
            result = _utf8(payload)
        elif number == 2 and isinstance(payload, int):
            result = bool(payload)
        elif number == 3 and isinstance(payload, int):
            result = payload - (1 << 64) if payload >= 1 << 63 else payload  # int64, two's complement
        elif number == 4 and isinstance(payload, bytes):
            result = struct.unpack("<d", payload)[0]
        elif number == 5 and isinstance(payload, memoryview) and len(payload) <= MAX_ARRAY_VALUE_BYTES:
            items = [] if in_array else _messages(payload, 1, steps)
            result = [_protobuf_value(item, steps, in_array=True) for item in items]
    return result


def _utf8(payload: memoryview) -> str | bytes:
    try:
        return bytes(payload).decode("utf-8")
    except UnicodeDecodeError:
        return b""  # not a string: rejected by field


def _messages(buffer: memoryview, wanted: int, steps: _Steps) -> Iterator[memoryview]:
    """The payloads of the length-delimited field ``wanted`` of a message."""
    return (payload for _, payload in _fields(buffer, steps, wanted=(wanted,)))


def _fields(
    buffer: memoryview, steps: _Steps, *, scalars: bool = False, wanted: tuple[int, ...] = ()
) -> Iterator[tuple[int, Any]]:
    """(field number, payload) of each length-delimited field (only of the fields ``wanted`` when
    given: the others are stepped over unsliced), and with ``scalars`` of each varint (int) and
    fixed64 (bytes) field too."""
    position, end = 0, len(buffer)
    while position < end:
        steps.left -= 1
        if steps.left < 0:
            raise TooManyRecords(
                f"the export holds more protobuf fields than one per {FIELD_BYTES} bytes (spans not "
                "counted); send smaller batches"
            )
        tag = buffer[position]  # one-byte tags and lengths are the rule: read them inline
        if tag < 0x80:
            position += 1
        else:
            tag, position = _varint(buffer, position)
        wire = tag & 7
        if wire == 2:
            length = buffer[position] if position < end else 0x80
            if length < 0x80:
                position += 1
            else:
                length, position = _varint(buffer, position)
            stop = position + length
            if stop > end:
                raise PayloadUndecodable("the body is not a valid OTLP protobuf export")
            if not wanted or tag >> 3 in wanted:
                yield tag >> 3, buffer[position:stop]
            position = stop
        elif wire == 0:
            value, position = _varint(buffer, position)
            if scalars:
                yield tag >> 3, value
        elif wire in (1, 5):
            width = 8 if wire == 1 else 4
            if position + width > end:  # a fixed64 or fixed32 cut short
                raise PayloadUndecodable("the body is not a valid OTLP protobuf export")
            if scalars and wire == 1:
                yield tag >> 3, bytes(buffer[position : position + width])
            position += width
        else:
            raise PayloadUndecodable("the body is not a valid OTLP protobuf export")
    if position != end:
        raise PayloadUndecodable("the body is not a valid OTLP protobuf export")


def _varint(buffer: memoryview, position: int) -> tuple[int, int]:
    result = shift = 0
    while shift < 70:
        if position >= len(buffer):
            break
        byte = buffer[position]
        position += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, position
        shift += 7
    raise PayloadUndecodable("the body is not a valid OTLP protobuf export")


def encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def length_delimited(number: int, payload: bytes) -> bytes:
    return encode_varint(number << 3 | 2) + encode_varint(len(payload)) + payload


# ---------------------------------------------------------------------------------------------
# Answers, in the request's encoding


def error_status(message: str, media: str) -> bytes:
    """A google.rpc.Status (code 3, INVALID_ARGUMENT) for a 400."""
    if media == JSON:
        return orjson.dumps({"code": 3, "message": message})
    return b"\x08\x03" + length_delimited(2, message.encode()[:1000])


def response(rejected: int, message: str, media: str) -> bytes:
    """ExportTraceServiceResponse (partial success when spans were rejected)."""
    if media == JSON:
        body: dict[str, Any] = {}
        if rejected:
            body["partialSuccess"] = {"rejectedSpans": str(rejected), "errorMessage": message}
        return orjson.dumps(body)
    if not rejected:
        return b""
    partial = b"\x08" + encode_varint(rejected) + length_delimited(2, message.encode())
    return length_delimited(1, partial)
