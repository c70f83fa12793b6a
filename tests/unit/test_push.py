"""POST /v1/records payloads: the decoding paths agree, and what a body may hold is bounded."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvlens.errors import PayloadUndecodable, TooManyRecords
from kvlens.records import MAX_PREFIX_BLOCKS, batch_from_objects
from kvlens.sources import push

field_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 20_000_000),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=4),
    st.lists(st.integers(0, 9), max_size=3),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
)
records = st.fixed_dictionaries(
    {},
    optional={
        "prompt_tokens": field_values,
        "cached_tokens": field_values,
        "model": field_values,
        "queue_seconds": field_values,
        "prefix_hashes": st.one_of(field_values, st.lists(st.one_of(st.integers(), st.text(max_size=3)))),
        "unknown": field_values,
    },
)
PAD = {"zz_padding": "x" * (push.SMALL_RECORD_BYTES + 10)}  # pushes a record onto the large path


def outcome(element: bytes) -> tuple[Any, ...]:
    value, unknown = push.decode_record(element)
    validated = batch_from_objects([value])
    details = validated.rejections.details(1)
    return (len(validated.batch), [(d["field"], d["reason"]) for d in details], unknown)


@settings(max_examples=300, deadline=None)
@given(records)
@example({"prompt_tokens": 0, "cached_tokens": 0, "prefix_hashes": None})  # was not_a_list when large
def test_large_records_are_judged_as_small_ones_are(record: dict[str, Any]) -> None:
    small = outcome(json.dumps(record).encode())
    large = outcome(json.dumps({**record, **PAD}).encode())
    assert large[:2] == small[:2]
    assert large[2] == small[2] + 1  # the padding is one more unknown field


@pytest.mark.parametrize("value", ["1e400", "-1e400", "NaN", "Infinity"])
def test_numbers_json_cannot_hold_are_rejected_by_field(value: str) -> None:
    body = f'{{"prompt_tokens": 5, "cached_tokens": 1, "ttft_seconds": {value}}}'.encode()
    validated = push.read_records(body, 10)
    assert validated.rejections.details(1)[0]["field"] == "ttft_seconds"
    large = body[:-1] + b", " + json.dumps(PAD)[1:].encode()
    if value.endswith("e400"):
        assert push.read_records(large, 10).rejections.details(1)[0]["field"] == "ttft_seconds"
    else:  # a large record is decoded by a strict decoder: NaN and Infinity are not JSON
        with pytest.raises(PayloadUndecodable):
            push.read_records(large, 10)


def test_the_live_path_checks_prefix_hashes_and_keeps_none() -> None:
    good = {"prompt_tokens": 32, "cached_tokens": 16, "prefix_hashes": [1, "a2"]}
    validated = push.read_records(orjson.dumps([good, good]), 10)
    assert len(validated.batch) == 2 and validated.batch.prefix_hashes == [None, None]
    too_many = {**good, "prefix_hashes": list(range(MAX_PREFIX_BLOCKS + 1))}
    bad = {**good, "prefix_hashes": [[1]]}
    validated = push.read_records(orjson.dumps([good, too_many, bad]), 10)
    assert len(validated.batch) == 1
    assert validated.rejections.counts_by_reason() == {"too_long": 1, "not_a_list": 1}
    [too_long] = push.read_records(orjson.dumps(too_many), 10).rejections.details(1)
    assert too_long == {
        "index": 0,
        "field": "prefix_hashes",
        "reason": "too_long",
        "message": f"must be at most {MAX_PREFIX_BLOCKS} items",
    }


@pytest.mark.parametrize(
    "body",
    [
        b"[" + b"0," * 10 + b"0]",
        b"[" + b"{}," * 10 + b"{}]",
        b"\n".join([b'{"prompt_tokens": 1, "cached_tokens": 0}'] * 11),
        b"{}" + b"\n" * 11 + b"{}",  # blank lines count: a line is what the limit bounds
        b"\n" * 11,  # also when there is nothing else (issue 15, 8e: this was taken)
        b" \r\n" * 11,
    ],
)
def test_more_records_than_allowed_are_refused_before_decoding(body: bytes) -> None:
    with pytest.raises(TooManyRecords):
        push.read_records(body, 10)


def test_exactly_the_limit_is_taken() -> None:
    body = orjson.dumps([{"prompt_tokens": 1, "cached_tokens": 0}] * 10)
    assert len(push.read_records(body, 10).batch) == 10
    line = orjson.dumps({"prompt_tokens": 1, "cached_tokens": 0})
    # each line ending in a newline, as the plugin writes them: the last newline opens no line
    for lines in (b"\n".join([line] * 10), (line + b"\n") * 10, (line + b"\n") * 10 + b" "):
        assert len(push.read_records(lines, 10).batch) == 10


def test_an_array_that_does_not_close_is_undecodable() -> None:
    with pytest.raises(PayloadUndecodable):
        push.read_records(b'[{"prompt_tokens": 1, "cached_tokens": 0},', 10)


def test_a_pretty_printed_object_is_one_record() -> None:
    body = json.dumps({"prompt_tokens": 3, "cached_tokens": 1, "ttft_seconds": float("nan")}, indent=2)
    validated = push.read_records(body.encode(), 10)
    assert validated.rejections.counts_by_reason() == {"not_finite": 1}
