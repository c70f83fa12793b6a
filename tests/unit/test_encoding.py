"""Content-Encoding undone within the limits: every bomb refused early, every honest body whole."""

from __future__ import annotations

import gzip
import os
import zlib

import pytest

from kvlens.errors import CompressionBomb, PayloadTooLarge, PayloadUndecodable, UnsupportedEncoding
from kvlens.sources.encoding import DecodeLimits, decode

LIMITS = DecodeLimits(max_bytes=8 * 1024 * 1024, max_ratio=100, max_members=16)


@pytest.mark.parametrize(
    ("body", "encoding"),
    [
        (gzip.compress(b"[1,2]"), "gzip"),
        (gzip.compress(b"[1,2]"), None),  # by its magic bytes
        (gzip.compress(b"[1,") + gzip.compress(b"2]"), "x-gzip"),  # two members
        (zlib.compress(b"[1,2]"), "deflate"),  # zlib-wrapped, as HTTP defines it
        (zlib.compress(b"[1,2]")[2:-4], "deflate"),  # raw, as some clients send it
        (b"[1,2]", "identity"),
        (gzip.compress(b"[1,2]"), " GZIP "),
    ],
)
def test_honest_bodies_decode_whole(body: bytes, encoding: str | None) -> None:
    assert decode(body, encoding, LIMITS) == b"[1,2]"


def test_an_incompressible_body_of_the_largest_size_decodes() -> None:
    payload = os.urandom(8 * 1024 * 1024)
    assert decode(gzip.compress(payload, 1), "gzip", LIMITS) == payload


def test_a_well_compressing_small_body_is_not_a_bomb() -> None:
    payload = b'{"prompt_tokens": 128, "cached_tokens": 16}\n' * 20_000  # 880 KiB, ratio ~300
    assert decode(gzip.compress(payload), "gzip", LIMITS) == payload


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (gzip.compress(b"0" * (9 * 1024 * 1024)), CompressionBomb),  # ratio first
        (gzip.compress(os.urandom(9 * 1024 * 1024), 1), PayloadTooLarge),
        (gzip.compress(b"") * 17, CompressionBomb),
        (gzip.compress(b"[1]")[:-6], PayloadUndecodable),
        (b"\x1f\x8bgarbage", PayloadUndecodable),
        (gzip.compress(b"[1]") + b"tail", PayloadUndecodable),
    ],
)
def test_bombs_and_broken_bodies_are_refused(body: bytes, error: type[Exception]) -> None:
    with pytest.raises(error):
        decode(body, "gzip", LIMITS)


def test_unknown_encodings_are_refused_without_echoing_them() -> None:
    with pytest.raises(UnsupportedEncoding) as refused:
        decode(b"{}", "br-CANARY", LIMITS)
    assert "CANARY" not in str(refused.value)
    assert refused.value.status == 415
