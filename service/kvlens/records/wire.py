"""The fast path: records decoded and validated in one pass by msgspec against a struct built
from :data:`~kvlens.records.schema.FIELDS`, never a dict per record."""

from __future__ import annotations

import math
from typing import Annotated, Any, Final

import msgspec
import numpy as np
import numpy.typing as npt

from kvlens import jsonscan
from kvlens.records.batch import RecordBatch, assemble
from kvlens.records.labels import labels_valid
from kvlens.records.schema import ABSENT_INT, FIELDS, MAX_PREFIX_BLOCKS, TOO_MANY_HASHES

# A JSON array whose records are all valid and carry only known fields is decoded and validated
# in one pass by msgspec against a struct built from the same FIELDS. Anything else (one bad
# record, an unknown field) returns None and goes through batch_from_objects, which reports each
# record's reason and counts unknown fields.


def _wire_struct(prefix_hashes: Any) -> type[msgspec.Struct]:
    kinds: dict[type, Any] = {int: int, float: float, str: str, list: prefix_hashes}
    fields: list[tuple[str, Any] | tuple[str, Any, Any]] = []
    for spec in FIELDS:
        if spec.kind is list and prefix_hashes is msgspec.Raw:
            fields.append((spec.name, msgspec.Raw, msgspec.Raw()))
            continue
        limits: dict[str, Any] = {"ge": spec.low, "le": spec.high, "max_length": spec.max_length}
        meta = msgspec.Meta(**{k: v for k, v in limits.items() if v is not None})
        annotated: Any = Annotated[kinds[spec.kind], meta]
        fields.append((spec.name, annotated) if spec.required else (spec.name, annotated | None, None))
    # gc=False: a record holds numbers, strings and a list of them, never a cycle; tracking
    # millions of them made the collector's passes a sixth of the strict decode
    return msgspec.defstruct("WireRecord", fields, kw_only=True, forbid_unknown_fields=True, gc=False)


# Offline (analyze) keeps prefix_hashes; the live sidecar checks them but keeps only b"" (absent),
# so that a body of short hashes cannot cost ten times its size in Python strings.
_WireRecord = _wire_struct(list[int | str])
_LiveWireRecord = _wire_struct(msgspec.Raw)
_WIRE_DECODER: Final = msgspec.json.Decoder(list[_WireRecord])  # type: ignore[valid-type]
_LIVE_WIRE_DECODER: Final = msgspec.json.Decoder(list[_LiveWireRecord])  # type: ignore[valid-type]
_LIVE_LINE_DECODER: Final = msgspec.json.Decoder(_LiveWireRecord)
_LINE_DECODER: Final = msgspec.json.Decoder(_WireRecord)
_ABSENT_RAW: Final = _LiveWireRecord.__struct_defaults__[-1]  # prefix_hashes' default: absent
_HASHES_DECODER: Final = msgspec.json.Decoder(
    Annotated[list[int | str], msgspec.Meta(max_length=MAX_PREFIX_BLOCKS)]
)


def batch_from_json_array(data: bytes, *, keep_prefix_hashes: bool = True) -> RecordBatch | None:
    """The batch, when every record in the JSON array ``data`` is valid and has only known
    fields; otherwise None (the caller then validates record by record). Without
    ``keep_prefix_hashes`` they are checked, and left out of the batch."""
    try:
        records = jsonscan.decode((_WIRE_DECODER if keep_prefix_hashes else _LIVE_WIRE_DECODER).decode, data)
    except msgspec.DecodeError:
        return None
    return _wire_batch(records, keep_prefix_hashes)


def batch_from_json_lines(data: bytes, *, keep_prefix_hashes: bool = False) -> RecordBatch | None:
    """Like :func:`batch_from_json_array` (by default as live: prefix_hashes checked, not kept)
    for JSON values separated by whitespace: NDJSON, or one pretty-printed record."""
    decoder = _LINE_DECODER if keep_prefix_hashes else _LIVE_LINE_DECODER
    try:
        records = jsonscan.decode(decoder.decode_lines, data)
    except msgspec.DecodeError:
        return None
    return _wire_batch(records, keep_prefix_hashes)


WIRE_CHUNK: Final = 1024  # records turned into columns at a time (see _wire_batch)


def _wire_batch(records: list[Any], keep_prefix_hashes: bool) -> RecordBatch | None:
    count = len(records)
    columns: dict[str, Any] = {
        spec.name: np.empty(count, np.int64 if spec.kind is int else np.float64)
        if spec.kind is int or spec.kind is float
        else [None] * count  # filled in place: a list grown by extend is copied as it grows
        for spec in FIELDS
    }
    # A tuple per record (one C call each), transposed by zip: the columns in FIELDS' order, the
    # struct's own (a getattr per field and record cost twice as much). A chunk at a time, into
    # the columns: a record's tuple costs ~200 bytes while it lives, which for 50,000 records put
    # the request past its documented memory.
    for start in range(0, count, WIRE_CHUNK):
        chunk = records[start : start + WIRE_CHUNK]
        values = zip(*map(msgspec.structs.astuple, chunk), strict=True)
        for spec, raw in zip(FIELDS, values, strict=True):
            column = columns[spec.name]
            if spec.kind is int or spec.kind is float:
                column[start : start + len(chunk)] = _numbers_with_absent(raw, spec.kind, len(chunk))
            elif spec.kind is str:
                strings = [v or None for v in raw] if "" in raw else raw
                if spec.is_label and not labels_valid(strings):
                    return None
                column[start : start + len(chunk)] = strings
            elif keep_prefix_hashes:
                column[start : start + len(chunk)] = raw
            else:  # the column stays None: checked, not kept
                if raw.count(_ABSENT_RAW) != len(raw) and any(
                    r is not _ABSENT_RAW and bytes(r) != b"null" and type(decode_prefix_hashes(r)) is not list
                    for r in raw
                ):
                    return None
    if (columns["cached_tokens"] > columns["prompt_tokens"]).any():
        return None
    return assemble(columns)


STRICT_SLICE_BYTES = 128 * 1024  # lines decoded at a time by strict_records


def strict_records(lines: bytes) -> int | None:
    """How many records the JSON lines ``lines`` hold when the decoder of
    :func:`batch_from_json_lines` (keeping prefix_hashes) accepts each (kinds and bounds, known
    fields only), without building them; None when it does not (a record spanning lines may
    also give None: the lines are decoded :data:`STRICT_SLICE_BYTES` at a time). Two checks are left to the
    caller, as the batch functions make them after decoding: ``cached_tokens <= prompt_tokens``
    and :func:`labels_valid` over :data:`LABEL_FIELDS`."""
    count, start, view = 0, 0, memoryview(lines)
    try:
        # a slice of lines at a time: its records stay in the CPU's caches and are freed at
        # once (the strict decode of 1M records took ~40 % less CPU than in one call)
        while start < len(lines):
            end = lines.find(b"\n", start + STRICT_SLICE_BYTES)
            end = len(lines) if end < 0 else end + 1
            count += len(jsonscan.decode(_LINE_DECODER.decode_lines, view[start:end]))
            start = end
    except msgspec.DecodeError:
        return None
    return count


def decode_prefix_hashes(raw: bytes | msgspec.Raw) -> list[int | str] | None:
    """The hashes in the JSON text ``raw``; :data:`TOO_MANY_HASHES` past MAX_PREFIX_BLOCKS; None
    when it is not a list of integers and strings. Never builds more than that many items."""
    data = bytes(raw)
    too_many = data.count(b",") >= MAX_PREFIX_BLOCKS  # a bound: commas inside strings raise it
    if too_many and jsonscan.scan(data).separator_count >= MAX_PREFIX_BLOCKS:
        return TOO_MANY_HASHES  # type: ignore[no-any-return]
    try:
        hashes: list[int | str] = jsonscan.decode(_HASHES_DECODER.decode, data)
    except msgspec.DecodeError:
        return None
    return hashes


def _numbers_with_absent(raw: tuple[Any, ...], kind: type, count: int) -> npt.NDArray[Any]:
    """A column of numbers, absent ones (None) as ABSENT_INT or NaN. A field absent from every
    record (common: a source sends few of the optional ones) costs a fill, not a pass in Python."""
    dtype = np.int64 if kind is int else np.float64
    try:
        return np.fromiter(raw, dtype, count)  # fails at the first None
    except TypeError:
        absent = ABSENT_INT if kind is int else math.nan
        if raw.count(None) == count:
            return np.full(count, absent, dtype)
        return np.fromiter((absent if v is None else v for v in raw), dtype, count)
