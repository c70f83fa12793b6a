"""The bad-input matrix of the record validator, and its agreement with the documented schema."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from kvlens.records import (
    REASONS,
    Record,
    RecordBatch,
    batch_from_json_array,
    batch_from_json_lines,
    batch_from_objects,
)
from kvlens.simulate.demo import DemoTraffic

GOOD = {"prompt_tokens": 128, "cached_tokens": 16}


def reject_one(record: Any) -> dict[str, Any]:
    """Validate ``record`` between two good ones; return its rejection, checking the neighbours."""
    validated = batch_from_objects([GOOD, record, GOOD])
    assert len(validated.batch) == 2, "the good records beside a bad one must be kept"
    assert validated.batch.prompt_tokens.tolist() == [128, 128]
    (rejection,) = validated.rejections.details(10)
    assert rejection["index"] == 1
    return rejection


@pytest.mark.parametrize(
    ("record", "field", "reason"),
    [
        ({"cached_tokens": 1}, "prompt_tokens", "missing"),
        ({"prompt_tokens": None, "cached_tokens": 1}, "prompt_tokens", "missing"),
        ({"prompt_tokens": 10}, "cached_tokens", "missing"),
        ({"prompt_tokens": math.nan, "cached_tokens": 0}, "prompt_tokens", "not_an_integer"),
        ({"prompt_tokens": math.inf, "cached_tokens": 0}, "prompt_tokens", "not_an_integer"),
        ({"prompt_tokens": 12.5, "cached_tokens": 0}, "prompt_tokens", "not_an_integer"),
        ({"prompt_tokens": True, "cached_tokens": 0}, "prompt_tokens", "not_an_integer"),
        ({"prompt_tokens": "128", "cached_tokens": 0}, "prompt_tokens", "not_an_integer"),
        ({"prompt_tokens": [1], "cached_tokens": 0}, "prompt_tokens", "not_an_integer"),
        ({"prompt_tokens": -1, "cached_tokens": 0}, "prompt_tokens", "out_of_range"),
        ({"prompt_tokens": 10_000_001, "cached_tokens": 0}, "prompt_tokens", "out_of_range"),
        ({"prompt_tokens": 2**70, "cached_tokens": 0}, "prompt_tokens", "out_of_range"),
        ({"prompt_tokens": 10, "cached_tokens": 11}, "cached_tokens", "cached_exceeds_prompt"),
        ({**GOOD, "queue_seconds": math.nan}, "queue_seconds", "not_finite"),
        ({**GOOD, "queue_seconds": math.inf}, "queue_seconds", "not_finite"),
        ({**GOOD, "queue_seconds": -0.1}, "queue_seconds", "out_of_range"),
        ({**GOOD, "ttft_seconds": 86_400.5}, "ttft_seconds", "out_of_range"),
        ({**GOOD, "prefill_seconds": "0.2"}, "prefill_seconds", "not_a_number"),
        ({**GOOD, "e2e_seconds": False}, "e2e_seconds", "not_a_number"),
        ({**GOOD, "model": 7}, "model", "not_a_string"),
        ({**GOOD, "model": "m" * 129}, "model", "invalid_label"),
        ({**GOOD, "model": "é" * 65}, "model", "invalid_label"),  # 130 bytes of UTF-8
        ({**GOOD, "model": "bad\ud800"}, "model", "invalid_label"),
        ({**GOOD, "model": "new\nline"}, "model", "invalid_label"),
        ({**GOOD, "model": "nul\x00"}, "model", "invalid_label"),
        ({**GOOD, "request_id": "r" * 257}, "request_id", "too_long"),
        # a lone surrogate (only a JSON \u escape makes one) is no text UTF-8 can hold
        ({**GOOD, "request_id": "id\ud800"}, "request_id", "not_a_string"),
        ({**GOOD, "finish_reason": "\udc00"}, "finish_reason", "not_a_string"),
        ({**GOOD, "arm": "warm\udfff"}, "arm", "not_a_string"),
        ({**GOOD, "block_size": 0}, "block_size", "out_of_range"),
        ({**GOOD, "prefix_hashes": "abc"}, "prefix_hashes", "not_a_list"),
        ({**GOOD, "prefix_hashes": [1, None]}, "prefix_hashes", "not_a_list"),
        ([1, 2], None, "not_an_object"),
        ("text", None, "not_an_object"),
        (None, None, "not_an_object"),
    ],
)
def test_bad_record_is_rejected_with_field_and_reason(record: Any, field: str | None, reason: str) -> None:
    rejection = reject_one(record)
    assert (rejection["field"], rejection["reason"]) == (field, reason)
    assert rejection["message"]
    if isinstance(record, dict):
        for value in record.values():
            if isinstance(value, str) and len(value) > 3:
                assert value not in rejection["message"]


def test_first_failing_field_in_schema_order_is_reported() -> None:
    rejection = reject_one({"prompt_tokens": -1, "cached_tokens": "x"})
    assert rejection["field"] == "prompt_tokens"


def test_optional_fields_may_be_absent_or_null() -> None:
    validated = batch_from_objects([GOOD, {**GOOD, "ttft_seconds": None, "output_tokens": None}])
    assert len(validated.rejections) == 0
    assert np.isnan(validated.batch.ttft_seconds).all()
    assert validated.batch.output_tokens.tolist() == [-1, -1]


def test_mixed_presence_keeps_values_in_place() -> None:
    validated = batch_from_objects([{**GOOD, "ttft_seconds": 0.5}, GOOD, {**GOOD, "ttft_seconds": 2}])
    ttft = validated.batch.ttft_seconds
    assert ttft[0] == 0.5 and np.isnan(ttft[1]) and ttft[2] == 2.0


def test_unknown_fields_are_ignored_and_counted() -> None:
    validated = batch_from_objects([{**GOOD, "future_field": 1, "another": {}}, {**GOOD, "model": None}])
    assert len(validated.batch) == 2
    assert validated.unknown_fields == 2


def test_models_are_dictionary_encoded() -> None:
    validated = batch_from_objects(
        [{**GOOD, "model": "a"}, {**GOOD, "model": "b"}, GOOD, {**GOOD, "model": "a"}]
    )
    assert validated.batch.model_names == ["a", "b"]
    assert validated.batch.model_codes.tolist() == [0, 1, -1, 0]


def test_positions_map_rejections_back_to_payload_lines() -> None:
    validated = batch_from_objects([GOOD, {"prompt_tokens": -5, "cached_tokens": 0}], positions=[3, 7])
    assert validated.rejections.details(5)[0]["index"] == 7


def test_rejection_counts_are_by_reason() -> None:
    validated = batch_from_objects(
        [{"cached_tokens": 1}, {"cached_tokens": 2}, {**GOOD, "queue_seconds": -1}]
    )
    assert validated.rejections.counts_by_reason() == {"missing": 2, "out_of_range": 1}
    assert set(validated.rejections.counts_by_reason()) <= set(REASONS)


# The documented pydantic schema and the vectorized validator must agree on every record.
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**64), 2**64),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=140),
)
field_values = st.one_of(
    json_scalars,
    st.integers(0, 10_000_000),
    st.floats(0, 90_000),
    st.lists(st.one_of(st.integers(0, 2**40), st.text(max_size=4)), max_size=3),
)
records = st.fixed_dictionaries(
    {"prompt_tokens": st.one_of(st.integers(0, 10_000_000), json_scalars)},
    optional={
        "cached_tokens": st.one_of(st.integers(0, 10_000_000), json_scalars),
        "queue_seconds": field_values,
        "ttft_seconds": field_values,
        "output_tokens": field_values,
        "block_size": field_values,
        "request_id": field_values,
        "model": st.one_of(field_values, st.sampled_from(["é" * 65, "a\tb", "m" * 128, "ok"])),
        "prefix_hashes": field_values,
        "unknown": field_values,
    },
)


@settings(max_examples=400, deadline=None)
@given(records)
def test_validator_agrees_with_documented_schema(record: dict[str, Any]) -> None:
    try:
        text = json.dumps(record, allow_nan=True)
        Record.model_validate_json(text)
        schema_accepts = True
    except (ValidationError, ValueError):
        schema_accepts = False
    if "cached_tokens" not in record and "prompt_tokens" in record:
        assert not schema_accepts
    validated = batch_from_objects([json.loads(text)])
    assert (len(validated.batch) == 1) == schema_accepts, validated.rejections.details(1)

    fast = batch_from_json_array(f"[{text}]".encode())
    # as lines, after a record without optional fields: the field-by-field decode (records/wire)
    lines = batch_from_json_lines(
        f'{{"prompt_tokens": 1, "cached_tokens": 0}}\n{text}'.encode(), keep_prefix_hashes=True
    )
    if schema_accepts and "unknown" not in record:
        assert fast is not None
        assert_same_batch(fast, validated.batch)
        assert lines is not None
        assert_same_batch(lines.select(np.arange(2) == 1), validated.batch)
    else:
        assert fast is None
        assert lines is None


def assert_same_batch(first: RecordBatch, second: RecordBatch) -> None:
    for name in RecordBatch.__dataclass_fields__:
        a, b = getattr(first, name), getattr(second, name)
        if isinstance(a, np.ndarray):
            np.testing.assert_array_equal(a, b, err_msg=name)
        else:
            assert a == b, name


def test_fast_path_matches_the_column_validator_on_a_realistic_batch() -> None:
    traffic = DemoTraffic(rate_per_second=500, seed=5)
    records = [*traffic.records(0.0, 1.0), {**GOOD, "model": ""}, {**GOOD, "ttft_seconds": None}]
    fast = batch_from_json_array(orjson.dumps(records))
    assert fast is not None
    assert_same_batch(fast, batch_from_objects(records).batch)


def test_fast_path_matches_the_column_validator_across_its_chunks() -> None:
    """Columns are built a slice of SLICE_BYTES at a time: fields present in some slices only, a
    bad label in the last one, prefix_hashes kept or checked, all as the column validator has
    them (every record here is over 64 bytes: the first WIRE_CHUNK span more than one slice)."""
    from kvlens.records.wire import SLICE_BYTES

    WIRE_CHUNK = SLICE_BYTES // 64  # records past the first slice at least
    count = 2 * WIRE_CHUNK + 7
    records: list[dict[str, Any]] = [
        {**GOOD, "request_id": f"r{i}", "model": f"m{i % 3}", "prefix_hashes": [i, i + 1]}
        if i < WIRE_CHUNK
        else {**GOOD, "queue_seconds": i / 1000, "block_size": 16, "tenant": "" if i % 2 else "t"}
        for i in range(count)
    ]
    for keep in (True, False):
        fast = batch_from_json_lines(b"\n".join(map(orjson.dumps, records)), keep_prefix_hashes=keep)
        assert fast is not None
        expected = batch_from_objects(records).batch
        if not keep:
            expected = dataclasses.replace(expected, prefix_hashes=[None] * count)
        assert_same_batch(fast, expected)
    records[-1]["model"] = "tab\there"
    assert batch_from_json_array(orjson.dumps(records)) is None


@pytest.mark.parametrize(
    "records",
    [
        [GOOD, {**GOOD, "unknown_field": 1}],
        [GOOD, {"prompt_tokens": 1, "cached_tokens": 2}],
        [GOOD, {**GOOD, "model": "tab\there"}],
        [GOOD, {**GOOD, "queue_seconds": -1}],
        [GOOD, [1]],
    ],
)
def test_fast_path_declines_what_needs_per_record_reasons(records: list[Any]) -> None:
    assert batch_from_json_array(orjson.dumps(records)) is None


@pytest.mark.parametrize("field", ["request_id", "finish_reason", "arm"])
def test_a_lone_surrogate_in_text_sends_the_batch_to_the_record_by_record_validator(field: str) -> None:
    # the fast paths decode JSON text; msgspec gives the escape back as a lone surrogate
    line = '{"prompt_tokens": 10, "cached_tokens": 1, "' + field + '": "a\\ud800"}'
    assert batch_from_json_array(f"[{line}]".encode()) is None
    assert batch_from_json_lines(line.encode()) is None


@pytest.mark.parametrize("keep_prefix_hashes", [True, False])
def test_lines_read_a_field_first_seen_slices_later_as_the_validator_does(
    monkeypatch: pytest.MonkeyPatch, keep_prefix_hashes: bool
) -> None:
    """JSON lines are decoded a slice at a time by the struct of the fields seen so far: a field
    that appears only after many slices is read (and checked) like any other."""
    from kvlens.records import wire

    monkeypatch.setattr(wire, "SLICE_BYTES", 64)  # a slice a record or two
    late = {
        **GOOD,
        "model": "m",
        "tenant": "t",
        "ttft_seconds": 0.5,
        "block_size": 16,
        "prefix_hashes": [1, "a"],
    }
    records = [GOOD] * 20 + [late] + [GOOD] * 5 + [{**GOOD, "e2e_seconds": 2.0}]
    text = b"\n".join(orjson.dumps(record) for record in records)
    lines = batch_from_json_lines(text, keep_prefix_hashes=keep_prefix_hashes)
    assert lines is not None
    expected = batch_from_objects(records).batch
    if not keep_prefix_hashes:
        expected = expected.select(np.ones(len(records), bool))
        object.__setattr__(expected, "prefix_hashes", [None] * len(records))
    assert_same_batch(lines, expected)
    for refused in ({**GOOD, "prefix_hashes": [1.5]}, {**GOOD, "model": "tab\there"}, {**GOOD, "unknown": 1}):
        bad = text + b"\n" + orjson.dumps(refused)
        assert batch_from_json_lines(bad, keep_prefix_hashes=keep_prefix_hashes) is None, refused
