"""``POST /v1/records`` payloads: a JSON object, a JSON array, or NDJSON; gzip allowed.

The whole payload is first read as one JSON array (NDJSON lines joined with commas) by the
all-or-nothing fast path of :func:`kvlens.records.batch_from_json_array`. When that fails, the
payload is decoded line by line: a line that does not decode is reported by its index and the
lines beside it still count. orjson is tried first, then the standard library, which also reads
NaN, Infinity and 1e400 so that they are rejected by field with a clear reason rather than as
undecodable lines.
"""

from __future__ import annotations

import zlib
from typing import Any

from kvlens.records import Rejections, Validated, batch_from_json_array, batch_from_objects
from kvlens.sources.jsonlines import UNDECODABLE, decode_lines, loads, orjson_or_none

SOURCE = "push"
_GZIP_MAGIC = b"\x1f\x8b"


class PayloadTooLarge(Exception):
    """The body, or what it decompresses to, is over the limit."""


class PayloadUndecodable(Exception):
    """Nothing in the body decodes; the message says why without quoting it."""


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


def read_records(body: bytes) -> Validated:
    """Every record of a payload, validated; rejections point at array indices or NDJSON lines
    (blank lines not counted). Raises :class:`PayloadUndecodable` when nothing decodes."""
    text = body.strip()
    if text[:1] == b"[":
        as_array, expected = text, None
    else:
        lines = text.count(b"\n") + 1
        as_array = b"[" + text.replace(b"\n", b",") + b"]" if b"\n\n" not in text else b""
        expected = lines
    if as_array:
        batch = batch_from_json_array(as_array)
        if batch is not None and expected in (None, len(batch)):
            return Validated(batch, Rejections(), 0)
    objects, positions, malformed = _decode(text, as_array, expected)
    return batch_from_objects(objects, positions).with_rejections(
        Rejections.single(malformed, "malformed_json")
    )


def _decode(
    text: bytes, as_array: bytes, expected: int | None
) -> tuple[list[Any], list[int] | None, list[int]]:
    """Decoded values, their positions in the payload (None: 0..N-1) and undecodable lines."""
    if not text:
        return [], None, []
    if expected is None:  # a JSON array
        value = loads(text)
        if value is UNDECODABLE:
            raise PayloadUndecodable("body is not valid JSON (an array was expected)")
        return value, None, []
    joined = orjson_or_none(as_array) if as_array else None
    if isinstance(joined, list) and len(joined) == expected:
        return joined, None, []
    if expected > 1 and text[:1] == b"{":  # one pretty-printed object?
        single = orjson_or_none(text)
        if isinstance(single, dict):
            return [single], None, []

    objects, positions, malformed = decode_lines(text.split(b"\n"))
    if not objects:
        single = loads(text)  # one pretty-printed object holding NaN or Infinity
        if single is not UNDECODABLE:
            return [single], None, []
        raise PayloadUndecodable("no line is valid JSON (expected an object, an array or NDJSON)")
    return objects, positions, malformed
