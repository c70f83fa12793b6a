"""The fast path: records decoded and validated in one pass by msgspec against a struct built
from :data:`~kvlens.records.schema.FIELDS`, never a dict per record."""

from __future__ import annotations

import functools
import itertools
import math
import operator
from collections.abc import Callable, Iterator
from typing import Annotated, Any, Final

import msgspec
import numpy as np
import numpy.typing as npt

from kvlens import jsonscan
from kvlens.records.batch import RecordBatch, assemble
from kvlens.records.labels import labels_valid
from kvlens.records.schema import (
    ABSENT_INT,
    FIELD_NAMES,
    FIELDS,
    MAX_PREFIX_BLOCKS,
    TOO_MANY_HASHES,
    FieldSpec,
)

# A JSON array whose records are all valid and carry only known fields is decoded and validated
# in one pass by msgspec against a struct built from the same FIELDS. Anything else (one bad
# record, an unknown field) returns None and goes through batch_from_objects, which reports each
# record's reason and counts unknown fields.

_ABSENT_RAW: Final = msgspec.Raw()  # prefix_hashes' default in the live structs: absent
ALL_FIELDS: Final = frozenset(FIELD_NAMES)
REQUIRED_FIELDS: Final = frozenset(spec.name for spec in FIELDS if spec.required)


def _wire_struct(prefix_hashes: Any, names: frozenset[str] = ALL_FIELDS) -> type[msgspec.Struct]:
    """The struct of the fields ``names`` (all by default): a record with any other field is
    refused, as it is by the struct of all fields when the field is unknown."""
    kinds: dict[type, Any] = {int: int, float: float, str: str, list: prefix_hashes}
    fields: list[tuple[str, Any] | tuple[str, Any, Any]] = []
    for spec in FIELDS:
        if spec.name not in names:
            continue
        if spec.kind is list and prefix_hashes is msgspec.Raw:
            fields.append((spec.name, msgspec.Raw, _ABSENT_RAW))
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
_HASHES_DECODER: Final = msgspec.json.Decoder(
    Annotated[list[int | str], msgspec.Meta(max_length=MAX_PREFIX_BLOCKS)]
)
# JSON lines are decoded this much at a time: a slice's records stay in the CPU's caches while
# their columns are taken, and are freed at once (on 1M records the decode and the columns cost
# ~25 % less CPU than in 8 MiB chunks; 16-512 KiB all did about as well).
SLICE_BYTES = 64 * 1024


@functools.lru_cache(maxsize=64)
def _line_decoder(names: frozenset[str], keep_prefix_hashes: bool) -> msgspec.json.Decoder[Any]:
    return msgspec.json.Decoder(_wire_struct(list[int | str] if keep_prefix_hashes else msgspec.Raw, names))


def batch_from_json_array(data: bytes, *, keep_prefix_hashes: bool = True) -> RecordBatch | None:
    """The batch, when every record in the JSON array ``data`` is valid and has only known
    fields; otherwise None (the caller then validates record by record). Without
    ``keep_prefix_hashes`` they are checked, and left out of the batch."""
    try:
        records = jsonscan.decode((_WIRE_DECODER if keep_prefix_hashes else _LIVE_WIRE_DECODER).decode, data)
    except msgspec.DecodeError:
        return None
    columns = _Columns(keep_prefix_hashes)
    columns.add(records, ALL_FIELDS)
    # the structs freed before the columns are joined: a body of 50,000 records held as structs
    # and as whole columns at once went past its documented memory (4 x the body)
    del records
    return columns.batch()


def batch_from_json_lines(data: bytes, *, keep_prefix_hashes: bool = False) -> RecordBatch | None:
    """Like :func:`batch_from_json_array` (by default as live: prefix_hashes checked, not kept)
    for JSON values separated by whitespace: NDJSON, or one pretty-printed record."""
    columns = _Columns(keep_prefix_hashes)
    try:
        for piece in _slices(data):
            columns.add(*columns.decode(piece))
    except msgspec.DecodeError:
        return None
    return columns.batch()


def _slices(data: bytes) -> Iterator[memoryview]:
    """``data`` in pieces of about :data:`SLICE_BYTES`, each cut just after a newline that a
    ``{`` follows. Valid records never hold one (no newline inside a string, no object inside a
    record), so a cut falls between records, and text that is valid in pieces is valid whole."""
    view, start = memoryview(data), 0
    while start < len(data):
        end = data.find(b"\n{", start + SLICE_BYTES)
        end = len(data) if end < 0 else end + 1
        yield view[start:end]
        start = end


class _Columns:
    """The columns of records decoded a slice at a time. Each slice is decoded by the struct of
    the fields seen so far (``names``; the required ones at first): a field that no record holds
    is never read off each record, and its column is the absent value whole. A slice with
    another field is refused by that struct and decoded again by the struct of all fields (what
    it refuses is invalid); the fields its records hold join ``names``, which only grows: a slice
    is decoded twice only when it adds a field, so at most as many slices as there are fields."""

    def __init__(self, keep_prefix_hashes: bool) -> None:
        self.keep_prefix_hashes = keep_prefix_hashes
        self.names = REQUIRED_FIELDS
        self.parts: list[tuple[int, dict[str, Any]]] = []  # (records, the columns of names)

    def decode(self, piece: memoryview) -> tuple[list[Any], frozenset[str]]:
        """The records of JSON lines ``piece`` and the fields to read off them; DecodeError when
        one is not a valid record of known fields."""
        try:
            return jsonscan.decode(
                _line_decoder(self.names, self.keep_prefix_hashes).decode_lines, piece
            ), self.names
        except msgspec.DecodeError:
            if self.names == ALL_FIELDS:
                raise
        records = jsonscan.decode(_line_decoder(ALL_FIELDS, self.keep_prefix_hashes).decode_lines, piece)
        absent = None if self.keep_prefix_hashes else _ABSENT_RAW  # what a missing field decodes to
        held = {
            name
            for name in ALL_FIELDS - self.names
            if operator.countOf(
                map(operator.attrgetter(name), records), None if name != "prefix_hashes" else absent
            )
            < len(records)
        }
        self.names = self.names | held
        return records, self.names

    def add(self, records: list[Any], names: frozenset[str]) -> None:
        count = len(records)
        part: dict[str, Any] = {}
        for spec in FIELDS:
            if spec.name in names:
                get = operator.attrgetter(spec.name)
                part[spec.name] = (
                    _numbers(records, get, spec.kind, count)
                    if spec.kind in (int, float)
                    else list(map(get, records))
                )
        self.parts.append((count, part))

    def batch(self) -> RecordBatch | None:
        """The batch of the records added; None when a check that the struct cannot make fails
        (labels, ``cached_tokens <= prompt_tokens``, live prefix_hashes)."""
        count = sum(records for records, _ in self.parts)
        columns: dict[str, Any] = {}
        for spec in FIELDS:
            name = spec.name
            numbers = spec.kind is int or spec.kind is float
            if not any(name in part for _, part in self.parts):
                columns[name] = _absent(spec, count)
                continue
            # each part's column taken out as it is joined (one part: used as it is), so that the
            # parts and the joined columns are not all held at once
            pieces = [
                part.pop(name) if name in part else _absent(spec, records) for records, part in self.parts
            ]
            if numbers:
                columns[name] = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
                continue
            raw = pieces[0] if len(pieces) == 1 else list(itertools.chain.from_iterable(pieces))
            if spec.kind is str:
                if "" in raw:
                    raw = [v or None for v in raw]
                if spec.is_label and not labels_valid(raw):
                    return None
                columns[name] = raw
            elif self.keep_prefix_hashes:
                columns[name] = raw
            else:
                if any(
                    r is not None
                    and r is not _ABSENT_RAW
                    and bytes(r) != b"null"
                    and type(decode_prefix_hashes(r)) is not list
                    for r in raw
                ):
                    return None
                columns[name] = [None] * count
        if (columns["cached_tokens"] > columns["prompt_tokens"]).any():
            return None
        return assemble(columns)


def _absent(spec: FieldSpec, count: int) -> Any:
    """The column of ``count`` records without the field ``spec``."""
    if spec.kind is int:
        return np.full(count, ABSENT_INT, np.int64)
    if spec.kind is float:
        return np.full(count, math.nan, np.float64)
    return [None] * count


def _numbers(records: list[Any], get: Callable[[Any], Any], kind: type, count: int) -> npt.NDArray[Any]:
    dtype = np.int64 if kind is int else np.float64
    try:
        return np.fromiter(map(get, records), dtype, count)
    except TypeError:  # some are None (absent)
        absent = ABSENT_INT if kind is int else math.nan
        return np.fromiter((absent if v is None else v for v in map(get, records)), dtype, count)


def strict_records(lines: bytes) -> int | None:
    """How many records the JSON lines ``lines`` hold when the decoder of
    :func:`batch_from_json_lines` (keeping prefix_hashes) accepts each (kinds and bounds, known
    fields only), without building their columns; None when it does not. Two checks are left to
    the caller, as the batch functions make them after decoding: ``cached_tokens <=
    prompt_tokens`` and :func:`labels_valid` over :data:`LABEL_FIELDS`."""
    count, columns = 0, _Columns(keep_prefix_hashes=True)
    try:
        # a slice of lines at a time (as batch_from_json_lines): its records stay in the CPU's
        # caches and are freed at once (the strict decode of 1M records took ~40 % less CPU
        # than in one call)
        for piece in _slices(lines):
            count += len(columns.decode(piece)[0])
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
