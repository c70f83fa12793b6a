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

from kvlens.errors import (
    CompressionBomb,
    InputError,
    PayloadTooLarge,
    PayloadUndecodable,
    UnsupportedEncoding,
)

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
    if encoding == "" and body.startswith(GZIP_MAGIC):
        encoding = "gzip"
    inflater = Inflater(encoding, limits)
    return inflater.feed(body) + inflater.finish()


class Inflater:
    """Undoes a content encoding piece by piece as the body arrives, checking the limits after
    each slice it inflates, so a bomb is refused before its output costs more than the limits.

    :func:`decode` feeds a whole body at once; a scrape feeds each piece read off the socket.
    Identity bodies are held to ``max_bytes`` too: a scrape's is not bounded before this.
    """

    def __init__(self, content_encoding: str | None, limits: DecodeLimits) -> None:
        encoding = (content_encoding or "").strip().lower()
        if encoding not in ("", "identity", "gzip", "x-gzip", "deflate"):
            raise UnsupportedEncoding("Content-Encoding must be gzip, deflate or identity")
        self._limits = limits
        self._identity = encoding in ("", "identity")
        # deflate is zlib-wrapped or raw: told by its first two bytes, so they are waited for
        self._wbits: int | None = 31 if encoding in ("gzip", "x-gzip") else None
        self._head = b""
        self._inflater: zlib._Decompress | None = None
        self._members = 0
        self._stream_ended = False  # deflate has one stream; gzip may have more members
        self._compressed = 0
        self._produced = 0

    def feed(self, data: bytes) -> bytes:
        """The bytes that ``data`` inflates to (some may come only with later pieces)."""
        self._compressed += len(data)
        if self._identity:
            self._count(len(data))
            return data
        if self._wbits is None:
            self._head += data
            if len(self._head) < 2:
                return b""
            data, self._head = self._head, b""
            self._wbits = 15 if _zlib_header(data) else -15
        return self._inflate(data)

    def finish(self) -> bytes:
        """What is left once the body has ended; raises if the compressed stream is cut short."""
        out = b""
        if self._wbits is None and self._head:  # a deflate body of one byte: not zlib-wrapped
            self._wbits = -15
            out, self._head = self._inflate(self._head), b""
        if self._inflater is not None:
            out += self._inflate(b"")  # output zlib still holds
            if self._inflater is not None:
                raise PayloadUndecodable("the compressed body is truncated")
        return out

    def _inflate(self, data: bytes) -> bytes:
        if not data and self._inflater is None:
            return b""
        out, inflated = bytearray(), b""  # both dropped if a limit is crossed
        try:
            while True:
                inflater = self._inflater or self._next_member()
                inflated = inflater.decompress(data, SLICE_BYTES)
                out += inflated
                self._count(len(inflated))
                if inflater.eof:
                    self._inflater = None
                    data = inflater.unused_data  # the next gzip member, if any
                    if not data:
                        break
                else:
                    data = inflater.unconsumed_tail
                    if not data and len(inflated) < SLICE_BYTES:  # short of a slice: nothing waits inside
                        break
        except zlib.error:
            raise PayloadUndecodable("the body is not valid gzip or deflate") from None
        except InputError:
            # The error's traceback holds this frame, and asyncio's futures put the error in a
            # reference cycle that only the cyclic GC breaks (minutes, in a busy process): a
            # refused bomb must not keep its 16 MiB alive until then.
            del out, inflated
            raise
        return bytes(out)

    def _next_member(self) -> zlib._Decompress:
        if self._stream_ended:
            raise PayloadUndecodable("data after the end of the deflate stream")
        self._members += 1
        if self._members > self._limits.max_members:
            raise CompressionBomb(f"more than {self._limits.max_members} gzip members")
        assert self._wbits is not None  # set before anything is inflated
        self._stream_ended = self._wbits != 31
        self._inflater = zlib.decompressobj(wbits=self._wbits)
        return self._inflater

    def _count(self, produced: int) -> None:
        self._produced += produced
        limits = self._limits
        if self._produced > limits.max_bytes:
            raise PayloadTooLarge(f"the decompressed body exceeds {limits.max_bytes} bytes")
        if self._produced > RATIO_FREE_BYTES and self._produced > limits.max_ratio * self._compressed:
            raise CompressionBomb(f"the body decompresses more than {limits.max_ratio:g} times")


def _zlib_header(body: bytes) -> bool:
    return len(body) >= 2 and body[0] & 0x0F == 8 and (body[0] << 8 | body[1]) % 31 == 0
