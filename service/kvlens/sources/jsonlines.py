"""Decoding JSON text from outside: orjson first, then the standard library, which also reads
NaN, Infinity and 1e400, so that those are rejected by field with a clear reason rather than as
undecodable lines."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

import orjson

from kvlens.records import Rejections, Validated, batch_from_objects

UNDECODABLE: Any = object()


def decode_lines(lines: Iterable[bytes]) -> tuple[list[Any], list[int], list[int]]:
    """JSON lines (blank ones skipped, not counted): the values, their line indices, and the
    indices of lines that do not decode."""
    objects: list[Any] = []
    positions: list[int] = []
    malformed: list[int] = []
    index = 0
    for line in lines:
        if not line.strip():
            continue
        value = loads(line)
        if value is UNDECODABLE:
            malformed.append(index)
        else:
            objects.append(value)
            positions.append(index)
        index += 1
    return objects, positions, malformed


def records_from_lines(lines: Iterable[bytes], convert: Callable[[Any], Any]) -> Validated:
    """Decode, convert (a format of :mod:`kvlens.sources.formats`) and validate JSON lines."""
    objects, positions, malformed = decode_lines(lines)
    validated = batch_from_objects([convert(value) for value in objects], positions)
    return validated.with_rejections(Rejections.single(malformed, "malformed_json"))


def orjson_or_none(data: bytes) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return None


def loads(data: bytes) -> Any:
    """orjson, then the standard library (which reads NaN/Infinity/1e400 for field-level errors)."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        pass
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        return UNDECODABLE
