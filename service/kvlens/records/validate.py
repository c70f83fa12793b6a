"""Validation of decoded JSON values, whole columns at once, against the bounds declared on
:class:`~kvlens.records.schema.Record`: :func:`batch_from_objects` returns the valid records as a
batch and a reason for each other one. This is the slow path, which any record can take; the fast
one (:mod:`kvlens.records.wire`) gives up to it on the first record it cannot take whole.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from kvlens.records.batch import Rejections, Validated, assemble
from kvlens.records.labels import MAX_LABEL_BYTES, valid_label
from kvlens.records.schema import (
    ABSENT_INT,
    FIELD_INDEX,
    FIELD_NAMES,
    FIELDS,
    KNOWN,
    MAX_PREFIX_BLOCKS,
    OK,
    REASON_CODE,
    TOO_MANY_HASHES,
    FieldSpec,
)


class _Missing:
    __slots__ = ()


MISSING: Final = _Missing()
_ABSENT_TYPES: Final = frozenset({type(None), _Missing})


def batch_from_objects(objects: Sequence[Any], positions: Sequence[int] | None = None) -> Validated:
    """Validate decoded JSON values column by column.

    ``positions`` gives each object's index in the original payload (defaults to 0..N-1), so
    rejections point at the right line even when the caller dropped undecodable ones.
    """
    count = len(objects)
    index = np.arange(count, dtype=np.int64) if positions is None else np.asarray(positions, np.int64)
    field_error = np.full(count, -1, np.int16)
    reason_error = np.zeros(count, np.int16)

    if set(map(type, objects)) - {dict}:
        not_object = np.fromiter((type(o) is not dict for o in objects), bool, count)
        reason_error[not_object] = REASON_CODE["not_an_object"]
        objects = [o if type(o) is dict else {} for o in objects]

    raw_columns = _extract_columns(objects)
    columns: dict[str, Any] = {}
    known_keys = 0
    types: set[type]
    for code, spec in enumerate(FIELDS):
        raw = raw_columns.get(spec.name)
        if raw is None:
            raw, types = [MISSING] * count, {_Missing}
        else:
            types = set(map(type, raw))
            known_keys += count - (raw.count(MISSING) if _Missing in types else 0)
        values, reasons = _validate_column(spec, raw, types)
        columns[spec.name] = values
        _first_error(field_error, reason_error, reasons, code)

    cached_over = columns["cached_tokens"] > columns["prompt_tokens"]
    cached_over &= reason_error == OK
    _first_error(
        field_error,
        reason_error,
        np.where(cached_over, REASON_CODE["cached_exceeds_prompt"], OK).astype(np.int16),
        FIELD_INDEX["cached_tokens"],
    )
    unknown_fields = sum(map(len, objects)) - known_keys

    bad = reason_error != OK
    rejections = Rejections(index[bad], field_error[bad], reason_error[bad]) if bad.any() else Rejections()
    if bad.any():
        keep = ~bad
        for name, values in columns.items():
            columns[name] = (
                values[keep] if isinstance(values, np.ndarray) else list(itertools.compress(values, keep))
            )

    return Validated(assemble(columns), rejections, unknown_fields)


def valid_prefix_hashes(value: Any) -> bool:
    """A list of ints and strings of Unicode text, each pass at C speed (a body may carry 4M ids).
    A string with a lone surrogate (JSON's ``"\\ud800"``) has no UTF-8, so no key
    (:func:`~kvlens.records.schema.prefix_key`): refused here, before the record is counted,
    rather than failing a reader after it was."""
    if type(value) is not list or len(value) > MAX_PREFIX_BLOCKS:
        return False
    kinds = set(map(type, value))
    if not kinds <= {int, str}:
        return False
    if str in kinds:
        try:
            "".join([item for item in value if type(item) is str]).encode()
        except UnicodeEncodeError:
            return False
    return True


def reduce_to_known(value: Any) -> tuple[Any, int]:
    """A decoded record reduced to what validation reads, and its number of unknown fields.

    The live sidecar decodes a hostile body one record at a time; keeping only the known fields,
    with a container where a scalar belongs replaced by an empty one of its type (validation only
    needs the type), and prefix_hashes checked and dropped, bounds what a record can hold on to.
    """
    if type(value) is not dict:
        return ([] if type(value) is list else {} if type(value) is dict else value), 0
    reduced: dict[str, Any] = {}
    unknown = 0
    for key, item in value.items():
        if key not in KNOWN:
            unknown += 1
            continue
        kind = type(item)
        if key == "prefix_hashes":
            item = _hashes_stand_in(item)
        elif kind is list:
            item = []
        elif kind is dict:
            item = {}
        reduced[key] = item
    return reduced, unknown


def _hashes_stand_in(value: Any) -> Any:
    """What validation reads for a decoded prefix_hashes: itself when valid (or absent), else a
    stand-in of its fault (0 is not a list)."""
    if value is None or value is TOO_MANY_HASHES or valid_prefix_hashes(value):
        return value
    return TOO_MANY_HASHES if type(value) is list and len(value) > MAX_PREFIX_BLOCKS else 0


def _extract_columns(objects: Sequence[dict[str, Any]]) -> dict[str, list[Any]]:
    """Known fields as lists, ``MISSING`` where a record lacks one.

    Senders usually emit the same keys in every record; then one ``itemgetter`` per record and a
    transpose do the work of a dictionary lookup per field per record.
    """
    if not objects:
        return {}
    keys = tuple(objects[0])
    if len(keys) >= 2 and KNOWN.issuperset(keys) and set(map(len, objects)) == {len(keys)}:
        try:
            rows = list(map(operator.itemgetter(*keys), objects))
        except KeyError:
            pass  # same sizes, other keys: read field by field
        else:
            return {key: list(column) for key, column in zip(keys, zip(*rows, strict=True), strict=True)}
    return {name: [o.get(name, MISSING) for o in objects] for name in FIELD_NAMES}


def _first_error(
    field_error: npt.NDArray[np.int16],
    reason_error: npt.NDArray[np.int16],
    reasons: npt.NDArray[np.int16],
    field_code: int,
) -> None:
    new = (reasons != OK) & (reason_error == OK)
    if new.any():
        field_error[new] = field_code
        reason_error[new] = reasons[new]


def _validate_column(spec: FieldSpec, raw: list[Any], types: set[type]) -> tuple[Any, npt.NDArray[np.int16]]:
    """Values and a reason code per record (0 = valid); ``types`` is the set of types in ``raw``."""
    if types <= _ABSENT_TYPES and not spec.required:
        absent: Any = [None] * len(raw)
        if spec.kind is int or spec.kind is float:
            absent = np.full(len(raw), ABSENT_INT if spec.kind is int else math.nan)
        return absent, np.zeros(len(raw), np.int16)
    if spec.kind is int or spec.kind is float:
        return _numeric_column(spec, raw, types)
    if spec.kind is str:
        return _string_column(spec, raw, types)
    return _list_column(spec, raw)


def _numeric_column(spec: FieldSpec, raw: list[Any], types: set[type]) -> tuple[Any, npt.NDArray[np.int16]]:
    count = len(raw)
    is_int = spec.kind is int
    dtype = np.int64 if is_int else np.float64
    absent = ABSENT_INT if is_int else math.nan
    low = spec.low if spec.low is not None else -math.inf
    high = spec.high if spec.high is not None else math.inf
    reasons = np.zeros(count, np.int16)
    accepted = {int} if is_int else {int, float}

    if types <= accepted | _ABSENT_TYPES:
        has_absent = bool(types & _ABSENT_TYPES)
        if has_absent:
            present = np.fromiter((v is not MISSING and v is not None for v in raw), bool, count)
            raw = [v if v is not MISSING and v is not None else absent for v in raw]
        try:
            values = np.fromiter(raw, dtype, count)
        except OverflowError:  # an integer beyond int64: fall through to the careful path
            pass
        else:
            if not has_absent:
                present = np.ones(count, bool)
            if not is_int:
                not_finite = present & ~np.isfinite(values)
                reasons[not_finite] = REASON_CODE["not_finite"]
            in_range = (values >= low) & (values <= high)
            reasons[present & ~in_range & (reasons == OK)] = REASON_CODE["out_of_range"]
            if spec.required and has_absent:
                reasons[~present] = REASON_CODE["missing"]
            values[reasons != OK] = absent
            return values, reasons

    values = np.full(count, absent, dtype=dtype)
    wrong_type = REASON_CODE["not_an_integer" if is_int else "not_a_number"]
    for i, value in enumerate(raw):
        kind = type(value)
        if value is MISSING or value is None:
            if spec.required:
                reasons[i] = REASON_CODE["missing"]
        elif kind not in accepted:
            reasons[i] = wrong_type
        elif kind is float and not math.isfinite(value):
            reasons[i] = REASON_CODE["not_finite"]
        elif not low <= value <= high:
            reasons[i] = REASON_CODE["out_of_range"]
        else:
            values[i] = value
    return values, reasons


def _string_column(
    spec: FieldSpec, raw: list[Any], types: set[type]
) -> tuple[list[str | None], npt.NDArray[np.int16]]:
    reasons = np.zeros(len(raw), np.int16)
    values: list[Any] = raw
    if types != {str}:
        values = [v if type(v) is str else None for v in raw]
        if not types <= {str} | _ABSENT_TYPES:
            for i, value in enumerate(raw):
                if not (value is MISSING or value is None or type(value) is str):
                    reasons[i] = REASON_CODE["not_a_string"]
    if "" in values:  # an empty label or id means "not given"
        values = [v or None for v in values]
    if spec.is_label:
        bad = {v for v in set(values) if v is not None and not valid_label(v)}
        if bad:
            reasons[[v in bad for v in values]] = REASON_CODE["invalid_label"]
    else:
        max_length = spec.max_length or MAX_LABEL_BYTES
        lengths = map(len, values) if None not in values else (len(v) for v in values if v is not None)
        if max(lengths, default=0) > max_length:
            reasons[[v is not None and len(v) > max_length for v in values]] = REASON_CODE["too_long"]
        if not _unicode("".join(filter(None, values))):  # one pass; per value only when it fails
            not_text = [v is not None and not _unicode(v) for v in values]
            reasons[not_text & (reasons == OK)] = REASON_CODE["not_a_string"]
    return values, reasons


def _unicode(text: str) -> bool:
    """Whether ``text`` is Unicode that UTF-8 can hold: a JSON ``\\u`` escape can make a lone
    surrogate, which no exposition, Parquet file or DuckDB column takes."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _list_column(spec: FieldSpec, raw: list[Any]) -> tuple[list[Any], npt.NDArray[np.int16]]:
    count = len(raw)
    reasons = np.zeros(count, np.int16)
    values: list[Any] = [None] * count
    max_length = spec.max_length or MAX_PREFIX_BLOCKS
    for i, value in enumerate(raw):
        if value is MISSING or value is None:
            continue
        if value is TOO_MANY_HASHES or (type(value) is list and len(value) > max_length):
            reasons[i] = REASON_CODE["too_long"]
        elif valid_prefix_hashes(value):
            values[i] = value
        else:
            reasons[i] = REASON_CODE["not_a_list"]
    return values, reasons
