"""``POST /v1/records`` payloads: a JSON object, a JSON array, or NDJSON.

A payload is first tried whole by the all-or-nothing fast path of
:func:`kvlens.records.batch_from_json_array` (or ``batch_from_json_lines`` for NDJSON). When that fails,
it is split into its records (array elements by :mod:`kvlens.jsonscan`, lines by newline)
and each is decoded and reduced on its own: a record that does not decode is reported by its index
and the records beside it still count.

What a body may cost is bounded before anything is decoded: at most ``max_records`` records (array
elements, or NDJSON lines, blank ones included: each newline ends a line, and text after the last
newline is one more unless it is blank, so a body of only newlines is refused past the limit as
any other, and N records each ending in a newline are N lines); the fast path runs only when the
body cannot hold more objects than that; a record of up to :data:`SMALL_RECORD_BYTES` is decoded
whole (orjson, then the standard library, which also reads NaN, Infinity and 1e400 so that they
are rejected by field with a clear reason), a larger one field by field, skipping what kvlens does
not read.
"""

from __future__ import annotations

import math
import re
from typing import Any, Final

import msgspec

from kvlens import jsonscan
from kvlens.errors import PayloadUndecodable, TooManyRecords
from kvlens.records import (
    FIELD_NAMES,
    Rejections,
    Validated,
    batch_from_json_array,
    batch_from_json_lines,
    batch_from_objects,
    decode_prefix_hashes,
    reduce_to_known,
)
from kvlens.sources.jsonlines import UNDECODABLE, loads

SOURCE = "push"
SMALL_RECORD_BYTES: Final = 64 * 1024
MIN_RECORD_BYTES: Final = len(b'{"prompt_tokens":0,"cached_tokens":0}')  # the shortest valid record
VALIDATE_CHUNK: Final = 8192  # records reduced and validated at a time
_WHITESPACE: Final = b" \t\r\n"
_NOT_WHITESPACE: Final = re.compile(rb"[^ \t\r\n]")

# A record's known fields as undecoded JSON; unknown fields are skipped by the decoder unbuilt.
_RawRecord = msgspec.defstruct(
    "RawRecord", [(name, msgspec.Raw, msgspec.Raw()) for name in FIELD_NAMES], kw_only=True
)
_RAW_RECORD: Final = msgspec.json.Decoder(_RawRecord)
_SCALAR: Final = msgspec.json.Decoder(bool | int | float | str | None)


def read_records(body: bytes, max_records: int, *, keep_prefix_hashes: bool = False) -> Validated:
    """Every record of a payload, validated; rejections point at array indices or NDJSON lines
    (blank lines not counted). Raises :class:`~kvlens.errors.TooManyRecords` past
    ``max_records`` and :class:`~kvlens.errors.PayloadUndecodable` when nothing decodes.
    ``prefix_hashes`` are checked, and kept only with ``keep_prefix_hashes`` (the modelled
    caches read them; the sums do not)."""
    found = _NOT_WHITESPACE.search(body)
    if found is not None and found.group() == b"[":
        return _read_array(body, max_records, keep_prefix_hashes)
    if len(body) > max_records and _line_count(body) > max_records:
        raise _too_many(max_records)
    if found is None:
        return batch_from_objects([])
    return _read_lines(body, max_records, keep_prefix_hashes)


def _line_count(text: bytes) -> int:
    """NDJSON lines, blank ones included (see the module's docstring)."""
    last = _NOT_WHITESPACE.search(text, text.rfind(b"\n") + 1)
    return text.count(b"\n") + (last is not None)


def _may_hold_more(body: bytes, max_records: int) -> bool:
    """Whether the body could hold more than ``max_records`` records (each needs a ``{`` and at
    least MIN_RECORD_BYTES bytes): the fast path builds a record per record before it can count."""
    return len(body) > MIN_RECORD_BYTES * max_records and body.count(b"{") > max_records


def _too_many(max_records: int) -> TooManyRecords:
    return TooManyRecords(f"more than {max_records} records in one request; send smaller batches")


def _read_array(text: bytes, max_records: int, keep_prefix_hashes: bool) -> Validated:
    if not _may_hold_more(text, max_records):
        batch = batch_from_json_array(text, keep_prefix_hashes=keep_prefix_hashes)
        if batch is not None:
            return Validated(batch, Rejections(), 0)
    structure = jsonscan.scan(text, max_records - 1, stop_past_limit=True)
    if structure.separator_count >= max_records:
        raise _too_many(max_records)
    if not structure.balanced:
        raise PayloadUndecodable("the body is not valid JSON (an array was expected)")
    return _read_elements(jsonscan.array_elements(text, structure))


def _read_lines(text: bytes, max_records: int, keep_prefix_hashes: bool) -> Validated:
    if not _may_hold_more(text, max_records):
        batch = batch_from_json_lines(text, keep_prefix_hashes=keep_prefix_hashes)
        if batch is not None:
            return Validated(batch, Rejections(), 0)
    text = text.strip(_WHITESPACE)
    if text[:1] == b"{" and b"\n" in text and jsonscan.scan(text).balanced:
        return _read_elements([text])  # one pretty-printed record
    elements = [line.strip(_WHITESPACE) for line in text.split(b"\n")]
    elements = [line for line in elements if line]
    validated = _read_elements(elements)
    if len(validated.rejections) == len(elements) == _malformed(validated):
        raise PayloadUndecodable("no line is valid JSON (expected an object, an array or NDJSON)")
    return validated


def _malformed(validated: Validated) -> int:
    return validated.rejections.counts_by_reason().get("malformed_json", 0)


def _read_elements(elements: list[bytes]) -> Validated:
    """Decode, reduce and validate records one chunk at a time (memory: one chunk's objects);
    valid ``prefix_hashes`` stay in the batch either way (one chunk's at a time)."""
    parts = []
    for start in range(0, len(elements), VALIDATE_CHUNK):
        objects: list[Any] = []
        kept: list[int] = []
        malformed: list[int] = []
        unknown = 0
        for index, element in enumerate(elements[start : start + VALIDATE_CHUNK], start):
            value, extra = decode_record(element)
            if value is UNDECODABLE:
                malformed.append(index)
                continue
            objects.append(value)
            kept.append(index)
            unknown += extra
        validated = batch_from_objects(objects, kept).with_rejections(
            Rejections.single(malformed, "malformed_json")
        )
        parts.append(Validated(validated.batch, validated.rejections, validated.unknown_fields + unknown))
    return Validated.concat(parts) if parts else batch_from_objects([])


def decode_record(element: bytes) -> tuple[Any, int]:
    """One record's JSON text -> (what validation reads, unknown fields); UNDECODABLE when the
    text is not JSON."""
    if len(element) <= SMALL_RECORD_BYTES:
        value = loads(element)
        return (UNDECODABLE, 0) if value is UNDECODABLE else reduce_to_known(value)
    try:
        raw = jsonscan.decode(_RAW_RECORD.decode, element)
    except msgspec.ValidationError:  # valid JSON, not an object
        return 0, 0
    except msgspec.DecodeError:
        return UNDECODABLE, 0
    fields = {
        name: _raw_value(name, value)
        for name in FIELD_NAMES
        if (value := getattr(raw, name))  # an empty Raw: absent
    }
    unknown = jsonscan.scan(element).keys - len(fields)
    return reduce_to_known(fields)[0], unknown


def _raw_value(name: str, raw: msgspec.Raw) -> Any:
    """A field's value, or an empty stand-in of its type when it is a container (validation needs
    only the type) or a number beyond float range (rejected as such)."""
    if name == "prefix_hashes":
        if bytes(raw).strip() == b"null":  # absent, as on the small path
            return None
        hashes = decode_prefix_hashes(raw)
        return 0 if hashes is None else hashes
    try:
        return _SCALAR.decode(raw)
    except msgspec.ValidationError:
        first = bytes(raw)[:1]
        if first == b"[":
            return []
        if first == b"{":
            return {}
        return -math.inf if first == b"-" else math.inf
