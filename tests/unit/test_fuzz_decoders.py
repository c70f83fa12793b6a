"""Every decoder of outside bytes, fuzzed: it answers with records and reasons, or with its one
documented error, and never puts a value the validator did not check into a batch."""

from __future__ import annotations

import contextlib
import gzip
import json
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlens.errors import InputError, PayloadUndecodable
from kvlens.records import REASONS, Validated
from kvlens.sources.encoding import DecodeLimits, decode
from kvlens.sources.formats import FORMATS, converter
from kvlens.sources.jsonlines import records_from_lines
from kvlens.sources.otlp import JSON, PROTOBUF, length_delimited, read_traces
from kvlens.sources.otlp import encode_varint as varint
from kvlens.sources.push import read_records

LIMITS = DecodeLimits(1 << 20, 100, 16)

record_like = st.fixed_dictionaries(
    {},
    optional={
        "prompt_tokens": st.one_of(
            st.integers(-5, 20_000_000), st.floats(), st.text(max_size=3), st.booleans()
        ),
        "cached_tokens": st.one_of(st.integers(-5, 100), st.none(), st.floats(allow_nan=True)),
        "model": st.text(max_size=6),
        "ttft_seconds": st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-1, 10)),
        "extra": st.integers(),
    },
)


def check(validated: Validated, total: int | None = None) -> None:
    batch = validated.batch
    assert np.all(batch.cached_tokens <= batch.prompt_tokens)
    assert np.all((batch.prompt_tokens >= 0) & (batch.prompt_tokens <= 10_000_000))
    for column in (batch.queue_seconds, batch.prefill_seconds, batch.ttft_seconds, batch.e2e_seconds):
        present = column[~np.isnan(column)]
        assert np.all(np.isfinite(present)) and np.all(present >= 0)
    assert set(validated.rejections.counts_by_reason()) <= set(REASONS)
    if total is not None:
        assert len(batch) + len(validated.rejections) == total


def as_ndjson(records: list[Any]) -> bytes:
    return b"\n".join(json.dumps(r, allow_nan=True).encode() for r in records)


@settings(max_examples=300, deadline=None)
@given(st.lists(record_like, max_size=8), st.sampled_from(["ndjson", "array", "gzip"]))
def test_push_payloads_account_for_every_record(records: list[dict[str, Any]], shape: str) -> None:
    body = as_ndjson(records) if shape != "array" else json.dumps(records, allow_nan=True).encode()
    if shape == "gzip":
        body = decode(gzip.compress(body), "gzip", LIMITS)
    try:
        validated = read_records(body, 1000)
    except PayloadUndecodable:
        assert not records
        return
    check(validated, len(records))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_push_arbitrary_bytes(body: bytes) -> None:
    with contextlib.suppress(PayloadUndecodable):
        check(read_records(body, 1000))


@given(st.binary(max_size=300))
def test_gzip_arbitrary_bytes(body: bytes) -> None:
    with contextlib.suppress(InputError):
        decode(b"\x1f\x8b" + body, "gzip", DecodeLimits(4096, 100, 16))


tail_lines = st.lists(
    st.one_of(st.binary(max_size=40), record_like.map(lambda r: json.dumps(r).encode())), max_size=8
)


@settings(max_examples=200, deadline=None)
@given(tail_lines, st.sampled_from(FORMATS))
def test_tailed_lines_in_every_format(lines: list[bytes], name: str) -> None:
    check(records_from_lines(lines, converter(name, model="m"))[0])


def test_nan_is_a_field_rejection_not_a_lost_line() -> None:
    body = (
        b'{"prompt_tokens": 5, "cached_tokens": 1, "ttft_seconds": NaN}\n'
        b'{"prompt_tokens": 5, "cached_tokens": 1}'
    )
    validated = read_records(body, 1000)
    assert len(validated.batch) == 1
    assert validated.rejections.details(1)[0]["field"] == "ttft_seconds"
    assert validated.rejections.counts_by_reason() == {"not_finite": 1}


# ---------------------------------------------------------------------------------------------
# Issue 15, defect 6: arbitrary bytes and arbitrary nesting reach every decoder of outside input;
# it answers with records and reasons or with an InputError (a 4xx), never anything else (which
# the app would answer with a 500).

OPENERS = {
    "array": (b"[", b"]"),
    "object": (b'{"k":', b"}"),
    "OTLP array value": (b'{"arrayValue":{"values":[', b"]}}"),
}


# (levels, opener and closer, innermost value, closers written): built in the test, so that a
# failing example is shown by its shape, not as 300 KB of brackets
nestings = st.tuples(
    st.sampled_from([0, 2, 1000, 1025, 40_000, 100_000, 150_000]) | st.integers(0, 150_000),
    st.sampled_from(sorted(OPENERS)),
    st.sampled_from([b"1", b"{}", b'"x"', b"[]"]),
    st.sampled_from(["all", "none", "half"]),
)


def nested(nesting: tuple[int, str, bytes, str]) -> bytes:
    """A JSON value nested up to 150,000 levels (the review's attack was 100,000), or cut short."""
    depth, kind, inner, closed = nesting
    opener, closer = OPENERS[kind]
    return opener * depth + inner + closer * {"all": depth, "none": 0, "half": depth // 2}[closed]


def no_exception_escapes(decode: Any, body: bytes) -> None:
    with contextlib.suppress(InputError):
        decode(body)


def otlp_json_with(value: bytes, where: str) -> bytes:
    attribute = b'{"key":"gen_ai.usage.input_tokens","value":' + value + b"}"
    return {
        "export": b'{"resourceSpans":' + value + b"}",
        "span": b'{"resourceSpans":[{"scopeSpans":[{"spans":[' + value + b"]}]}]}",
        "attribute value": b'{"resourceSpans":[{"scopeSpans":[{"spans":[{"attributes":['
        + attribute
        + b"]}]}]}]}",
    }[where]


@settings(max_examples=60, deadline=None)
@given(nestings, st.sampled_from(["ndjson", "array", "one"]))
def test_push_takes_any_nesting(nesting: tuple[int, str, bytes, str], shape: str) -> None:
    value = nested(nesting)
    record = b'{"prompt_tokens":8,"cached_tokens":4,"unknown":' + value + b"}"
    good = b'{"prompt_tokens":8,"cached_tokens":4}'
    body = {"one": record, "ndjson": good + b"\n" + record, "array": b"[" + good + b"," + record + b"]"}[
        shape
    ]
    no_exception_escapes(lambda b: read_records(b, 1000), body)


@settings(max_examples=60, deadline=None)
@given(nestings, st.sampled_from(["export", "span", "attribute value"]))
def test_otlp_json_takes_any_nesting(nesting: tuple[int, str, bytes, str], where: str) -> None:
    body = otlp_json_with(nested(nesting), where)
    no_exception_escapes(lambda b: read_traces(b, JSON, 1000), body)


@settings(max_examples=40, deadline=None)
@given(nestings, st.sampled_from(FORMATS))
def test_tailed_lines_take_any_nesting(nesting: tuple[int, str, bytes, str], name: str) -> None:
    value = nested(nesting)
    line = b'{"prompt_tokens":8,"cached_tokens":4,"usage":' + value + b"}"
    check(records_from_lines([line, value], converter(name, model="m"))[0])


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=400))
def test_otlp_json_arbitrary_bytes(body: bytes) -> None:
    no_exception_escapes(lambda b: read_traces(b, JSON, 1000), b'{"resourceSpans":' + body)
    no_exception_escapes(lambda b: read_traces(b, JSON, 1000), body)


# Protobuf: wire-format trees shaped like an export (the field numbers kvlens follows, and
# others), every wire type, then cut short or with a byte changed.


field_number = st.sampled_from([1, 2, 3, 4, 5, 9, 11, 536870911])
scalar_field = st.one_of(
    st.tuples(field_number, st.integers(0, 2**64 - 1)).map(lambda f: varint(f[0] << 3) + varint(f[1])),
    # fixed64 and fixed32, also cut short (the review's struct.error: a double of 3 bytes)
    st.tuples(field_number, st.binary(max_size=8)).map(lambda f: varint(f[0] << 3 | 1) + f[1]),
    st.tuples(field_number, st.binary(max_size=4)).map(lambda f: varint(f[0] << 3 | 5) + f[1]),
    st.tuples(
        field_number, st.sampled_from([b"gen_ai.usage.input_tokens", b"gen_ai.usage.cached_tokens", b"x"])
    ).map(lambda f: length_delimited(f[0], f[1])),
)
protobuf_message = st.recursive(
    st.lists(scalar_field, max_size=4).map(b"".join),
    lambda inner: st.lists(
        st.one_of(scalar_field, st.tuples(field_number, inner).map(lambda f: length_delimited(*f))),
        max_size=4,
    ).map(b"".join),
    max_leaves=30,
)


noise = st.lists(
    st.one_of(scalar_field, protobuf_message.map(lambda m: length_delimited(11, m))), max_size=2
).map(b"".join)


def wrapped(number: int, fields: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    """Field ``number`` holding one or two of ``fields``, among others kvlens does not read."""
    inside = st.tuples(noise, st.lists(fields, min_size=1, max_size=2).map(b"".join), noise)
    return inside.map(lambda parts: length_delimited(number, b"".join(parts)))


KEYS = [b"gen_ai.usage.input_tokens", b"gen_ai.usage.cached_tokens", b"gen_ai.response.finish_reasons"]
any_value_field = st.one_of(
    st.tuples(st.sampled_from([2, 3]), st.integers(0, 2**64 - 1)).map(
        lambda f: varint(f[0] << 3) + varint(f[1])
    ),
    st.binary(max_size=8).map(lambda double: b"\x21" + double),  # double_value, maybe cut short
    st.text(max_size=5).map(lambda text: length_delimited(1, text.encode())),
    protobuf_message.map(lambda m: length_delimited(5, m)),  # array_value
)
key_value = st.tuples(st.sampled_from(KEYS), st.lists(any_value_field, max_size=3).map(b"".join)).map(
    lambda kv: length_delimited(1, kv[0]) + length_delimited(2, kv[1])
)
span = wrapped(2, key_value.map(lambda kv: length_delimited(9, kv)))
export_shaped = wrapped(1, wrapped(2, st.one_of(span, wrapped(1, st.just(length_delimited(1, b"vllm"))))))


@settings(max_examples=250, deadline=None)
@given(
    export_shaped | protobuf_message,
    st.integers(0, 10_000),
    st.integers(0, 255),
    st.sampled_from(["cut", "change", "whole"]),
)
def test_protobuf_exports_cut_short_or_changed(message: bytes, at: int, byte: int, how: str) -> None:
    if message:
        at %= len(message)
        message = {
            "cut": message[:at],
            "change": message[:at] + bytes([byte]) + message[at + 1 :],
            "whole": message,
        }[how]
    no_exception_escapes(lambda b: read_traces(b, PROTOBUF, 1000), message)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 30_000))
def test_protobuf_array_values_nested_deep(depth: int) -> None:
    value = b"\x18\x05"  # int_value 5
    for _ in range(depth):
        value = length_delimited(5, length_delimited(1, value))
    attribute = length_delimited(1, b"gen_ai.usage.input_tokens") + length_delimited(2, value)
    span = length_delimited(9, attribute)
    body = length_delimited(1, length_delimited(2, length_delimited(2, span)))
    no_exception_escapes(lambda b: read_traces(b, PROTOBUF, 1000), body)
