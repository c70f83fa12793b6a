"""The structural scan agrees with a JSON decoder on every text a decoder accepts, whatever the
slice boundaries, and finds the cost of a body without building it."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlens import jsonscan

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.text(alphabet=st.sampled_from('ab,:[]{}"\\\n '), max_size=6),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner, max_size=4),
    max_leaves=20,
)


def dumps(value: Any, compact: bool) -> bytes:
    return json.dumps(value, separators=(",", ":") if compact else (", ", ": ")).encode()


@settings(max_examples=300, deadline=None)
@given(st.lists(json_values, max_size=6), st.booleans(), st.integers(1, 40))
def test_array_elements_are_what_a_decoder_finds(values: list[Any], compact: bool, slice_bytes: int) -> None:
    text = dumps(values, compact)
    original = jsonscan.SLICE_BYTES
    jsonscan.SLICE_BYTES = slice_bytes  # boundaries inside strings, escapes and numbers
    try:
        structure = jsonscan.scan(text, 100)
    finally:
        jsonscan.SLICE_BYTES = original
    assert structure.balanced
    assert [json.loads(element) for element in jsonscan.array_elements(text, structure)] == values


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(max_size=4), json_values, max_size=6))
def test_keys_of_an_object_are_counted(value: dict[str, Any]) -> None:
    assert jsonscan.scan(dumps(value, True)).keys == len(value)


@pytest.mark.parametrize(
    "text",
    [b"[1,2", b"[1]]", b"[1],", b"[1] [2]", b'["open', b"{}{}", b"1", b"", b"]["],
)
def test_texts_that_are_not_one_array_or_object_are_unbalanced(text: bytes) -> None:
    assert not jsonscan.scan(text, 10).balanced


def test_the_scan_stops_past_the_limit_without_keeping_offsets() -> None:
    text = b"[" + b"0," * 1_000_000 + b"0]"
    structure = jsonscan.scan(text, 999, stop_past_limit=True)
    assert structure.separator_count >= 1000 and structure.separators is None
    assert not structure.complete


def test_objects_at_a_depth_are_counted_up_to_a_limit() -> None:
    spans = b'{"resourceSpans":[{"scopeSpans":[{"spans":[' + b",".join([b"{}"] * 50) + b"]}]}]}"
    assert jsonscan.scan(spans, object_depth=7).objects_at_depth == 50
    assert not jsonscan.scan(spans, object_depth=7, object_limit=10).complete


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(st.text(max_size=5), json_values | st.text(min_size=60, max_size=80), max_size=6),
    st.integers(1, 50),
)
def test_the_extractor_keeps_the_small_top_level_fields(value: dict[str, Any], slice_bytes: int) -> None:
    text = dumps(value, False)
    extractor = jsonscan.FieldExtractor(value_limit=50)
    for start in range(0, len(text), slice_bytes):
        extractor.feed(text[start : start + slice_bytes])
    kept = extractor.finish()
    assert kept is not None
    # a value's bytes run from after its colon to its comma: the space after ": " counts
    small = {key: item for key, item in value.items() if len(b" " + dumps(item, False)) <= 50}
    assert json.loads(kept) == small


@pytest.mark.parametrize("text", [b'["a", 1]', b'{"a": 1', b'{"a": 1} x', b"x{", b'"string"'])
def test_the_extractor_gives_nothing_for_what_is_not_one_object(text: bytes) -> None:
    extractor = jsonscan.FieldExtractor()
    extractor.feed(text)
    assert extractor.finish() is None


def test_the_extractor_stops_keeping_past_its_total() -> None:
    extractor = jsonscan.FieldExtractor(total_limit=100)
    extractor.feed(json.dumps({f"k{i}": i for i in range(1000)}).encode())
    kept = extractor.finish()
    assert kept is not None and len(kept) <= 102 and json.loads(kept)["k0"] == 0


@settings(deadline=None)
@given(
    st.dictionaries(st.text(max_size=3), json_values, max_size=5),
    st.lists(json_values, max_size=6),
    st.lists(json_values, max_size=3),
    st.booleans(),
    st.integers(1, 50),
)
def test_the_extractor_hands_out_the_elements_of_the_arrays_asked_for(
    other: dict[str, Any], items: list[Any], more: list[Any], compact: bool, slice_bytes: int
) -> None:
    value = {**other, "items": items, "more": more, "kept": 7}
    text = dumps(value, compact)
    extractor = jsonscan.FieldExtractor(value_limit=10_000, arrays=("items", "more", "absent"))
    handed: list[tuple[str, Any]] = []
    for start in range(0, len(text), slice_bytes):
        for name, element in extractor.feed(text[start : start + slice_bytes]):
            handed.append((name, None if element is None else json.loads(element)))
    assert handed == [
        ("items", None),
        *(("items", e) for e in items),
        ("more", None),
        *(("more", e) for e in more),
    ]
    kept = extractor.finish()
    assert kept is not None
    assert json.loads(kept) == {**other, "kept": 7}  # the streamed arrays are not kept
    assert extractor.values == 1


def test_the_extractor_refuses_an_element_past_its_limit_and_counts_values_after_the_object() -> None:
    def too_long(name: str) -> None:
        raise ValueError(name)

    extractor = jsonscan.FieldExtractor(arrays=("a",), element_limit=10, too_long=too_long)
    assert extractor.feed(b'{"a": [1, "short",') == [("a", None), ("a", b"1"), ("a", b'"short"')]
    with pytest.raises(ValueError, match=r"^a$"):
        extractor.feed(b' "a string of more than ten bytes"]}')
    several = jsonscan.FieldExtractor()
    several.feed(b'{"a": 1}\n{"a": [2]}\n{"b": {}}\n')
    assert several.finish() is None and several.values == 3
