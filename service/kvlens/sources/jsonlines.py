"""Decoding JSON text from outside: orjson first, then the standard library, which also reads
NaN, Infinity and 1e400, so that those are rejected by field with a clear reason rather than as
undecodable lines."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

import orjson

from kvlens.records import Rejections, Validated, batch_from_objects
from kvlens.sources import jsonscan
from kvlens.sources.formats import NOT_A_REQUEST

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


def records_from_lines(lines: Iterable[bytes], convert: Callable[[Any], Any]) -> tuple[Validated, int]:
    """Decode, convert (a format of :mod:`kvlens.sources.formats`) and validate JSON lines; also
    the number of lines that describe no request (:data:`~kvlens.sources.formats.NOT_A_REQUEST`)."""
    objects, positions, malformed = decode_lines(lines)
    converted = [convert(value) for value in objects]
    if any(value is NOT_A_REQUEST for value in converted):
        kept = [(value, position) for value, position in zip(converted, positions, strict=True)]
        kept = [(value, position) for value, position in kept if value is not NOT_A_REQUEST]
        ignored = len(converted) - len(kept)
        converted, positions = [value for value, _ in kept], [position for _, position in kept]
    else:
        ignored = 0
    validated = batch_from_objects(converted, positions)
    return validated.with_rejections(Rejections.single(malformed, "malformed_json")), ignored


def loads(data: bytes) -> Any:
    """orjson, then the standard library (which reads NaN/Infinity/1e400 for field-level errors)."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        pass
    try:
        return jsonscan.decode(json.loads, data)
    except ValueError:
        return UNDECODABLE
