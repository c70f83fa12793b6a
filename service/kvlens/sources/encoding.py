"""``Content-Encoding`` of request bodies, undone within bounds a hostile body cannot push past.

gzip (also recognised by its magic bytes when no encoding is declared), deflate (zlib-wrapped, as
HTTP defines it, or raw, as some clients send it) and identity. A body is inflated in slices, and
refused as soon as it crosses one of its limits, so a few KiB can never cost more than the limits
allow: the output is at most ``max_bytes``; past the first MiB of output, at most ``max_ratio``
times the compressed size (an 8 KiB body inflating to 8 MiB is a bomb, not telemetry); at most
``max_members`` gzip members (thousands of empty members cost CPU for nothing).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Final

from kvlens.errors import CompressionBomb, PayloadTooLarge, PayloadUndecodable, UnsupportedEncoding

GZIP_MAGIC: Final = b"\x1f\x8b"
RATIO_FREE_BYTES: Final = 1024 * 1024  # small bodies may compress as well as they like
SLICE_BYTES: Final = 256 * 1024  # inflate this much at a time, then check the limits


@dataclass(frozen=True)
class DecodeLimits:
    max_bytes: int
    max_ratio: float
    max_members: int


def decode(body: bytes, content_encoding: str | None, limits: DecodeLimits) -> bytes:
    """The body with its content encoding undone; raises an :class:`~kvlens.errors.InputError`."""
    encoding = (content_encoding or "").strip().lower()
    if encoding in ("", "identity"):
        if encoding == "" and body.startswith(GZIP_MAGIC):
            return _inflate(body, 31, limits)
        return body
    if encoding in ("gzip", "x-gzip"):
        return _inflate(body, 31, limits)
    if encoding == "deflate":
        return _inflate(body, 15 if _zlib_header(body) else -15, limits)
    raise UnsupportedEncoding("Content-Encoding must be gzip, deflate or identity")


def _zlib_header(body: bytes) -> bool:
    return len(body) >= 2 and body[0] & 0x0F == 8 and (body[0] << 8 | body[1]) % 31 == 0


def _inflate(body: bytes, wbits: int, limits: DecodeLimits) -> bytes:
    out = bytearray()
    data = body
    members = 0
    try:
        while data:
            members += 1
            if members > limits.max_members:
                raise CompressionBomb(f"more than {limits.max_members} gzip members")
            inflater = zlib.decompressobj(wbits=wbits)
            while not inflater.eof:
                inflated = inflater.decompress(data, SLICE_BYTES)
                out += inflated
                _check(len(out), len(body), limits)
                data = inflater.unconsumed_tail
                if not (inflated or data or inflater.eof):
                    raise PayloadUndecodable("the compressed body is truncated")
            data = inflater.unused_data  # the next gzip member, if any
            if wbits != 31:
                if data:
                    raise PayloadUndecodable("data after the end of the deflate stream")
                break
    except zlib.error:
        raise PayloadUndecodable("the body is not valid gzip or deflate") from None
    return bytes(out)


def _check(size: int, compressed: int, limits: DecodeLimits) -> None:
    if size > limits.max_bytes:
        raise PayloadTooLarge(f"the decompressed body exceeds {limits.max_bytes} bytes")
    if size > RATIO_FREE_BYTES and size > limits.max_ratio * compressed:
        raise CompressionBomb(f"the body decompresses more than {limits.max_ratio:g} times")
