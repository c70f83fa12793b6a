"""``POST /v1/records`` payloads: a JSON object, a JSON array, or NDJSON; gzip allowed.

Decoding is all or nothing per line: a line that does not decode is reported by its index and
the lines beside it still count. orjson is tried first on the whole payload (NDJSON is joined
into one array); only when that fails does decoding fall back line by line, and then to the
standard library, which also reads NaN, Infinity and 1e400 so that they are rejected by field
with a clear reason rather than as undecodable lines.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from typing import Any

import orjson

SOURCE = "push"
_GZIP_MAGIC = b"\x1f\x8b"


class PayloadTooLarge(Exception):
    """The body, or what it decompresses to, is over the limit."""


class PayloadUndecodable(Exception):
    """Nothing in the body decodes; the message says why without quoting it."""


@dataclass(frozen=True)
class DecodedPayload:
    objects: list[Any]
    positions: list[int] | None  # index in the payload of each object; None means 0..N-1
    malformed: list[int]  # indices of lines that did not decode

    @property
    def total(self) -> int:
        return len(self.objects) + len(self.malformed)


def decompress(body: bytes, content_encoding: str | None, max_bytes: int) -> bytes:
    """Undo gzip (by header or magic bytes), refusing to inflate past ``max_bytes``."""
    encoding = (content_encoding or "").strip().lower()
    if encoding in ("", "identity") and not body.startswith(_GZIP_MAGIC):
        return body
    if encoding not in ("", "identity", "gzip", "x-gzip"):
        raise PayloadUndecodable(f"unsupported Content-Encoding {encoding[:32]!r}; use gzip or none")
    out = bytearray()
    data = body
    try:
        while data:
            inflater = zlib.decompressobj(wbits=31)
            out += inflater.decompress(data, max_bytes + 1 - len(out))
            if len(out) > max_bytes or inflater.unconsumed_tail:
                raise PayloadTooLarge(f"decompressed body exceeds {max_bytes} bytes")
            data = inflater.unused_data  # concatenated gzip members
    except zlib.error:
        raise PayloadUndecodable("body is not valid gzip") from None
    return bytes(out)


def decode_records(body: bytes) -> DecodedPayload:
    text = body.strip()
    if not text:
        return DecodedPayload([], None, [])
    if text[:1] == b"[":
        value = _loads(text)
        if value is _UNDECODABLE:
            raise PayloadUndecodable("body is not valid JSON (an array was expected)")
        return DecodedPayload(value, None, [])

    lines = text.count(b"\n") + 1
    if lines > 1 and text[:1] == b"{":  # one pretty-printed object?
        single = orjson_or_none(text)
        if isinstance(single, dict):
            return DecodedPayload([single], None, [])
    if b"\n\n" not in text:
        joined = orjson_or_none(b"[" + text.replace(b"\n", b",") + b"]")
        if isinstance(joined, list) and len(joined) == lines:
            return DecodedPayload(joined, None, [])

    objects: list[Any] = []
    positions: list[int] = []
    malformed: list[int] = []
    index = 0
    for line in text.split(b"\n"):
        if not line.strip():
            continue
        value = _loads(line)
        if value is _UNDECODABLE:
            malformed.append(index)
        else:
            objects.append(value)
            positions.append(index)
        index += 1
    if not objects:
        single = _loads(text)  # one pretty-printed object holding NaN or Infinity
        if single is not _UNDECODABLE:
            return DecodedPayload([single], None, [])
        raise PayloadUndecodable("no line is valid JSON (expected an object, an array or NDJSON)")
    return DecodedPayload(objects, positions, malformed)


_UNDECODABLE: Any = object()


def orjson_or_none(data: bytes) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return None


def _loads(data: bytes) -> Any:
    """orjson, then the standard library (which reads NaN/Infinity/1e400 for field-level errors)."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        pass
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        return _UNDECODABLE
