"""Content-Encoding undone within the limits: every bomb refused early, every honest body whole."""

from __future__ import annotations

import gzip
import os
import zlib

import pytest

from kvlens.errors import CompressionBomb, PayloadTooLarge, PayloadUndecodable, UnsupportedEncoding
from kvlens.sources.encoding import DecodeLimits, Inflater, decode

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


@pytest.mark.parametrize(
    ("body", "encoding"),
    [
        (gzip.compress(b"[1,") + gzip.compress(b"2]"), "gzip"),
        (zlib.compress(b"[1,2]"), "deflate"),
        (zlib.compress(b"[1,2]")[2:-4], "deflate"),
        (b"[1,2]", None),
    ],
)
@pytest.mark.parametrize("piece", [1, 3, 64 * 1024])
def test_a_body_fed_in_pieces_inflates_as_decode_does(body: bytes, encoding: str | None, piece: int) -> None:
    inflater = Inflater(encoding, LIMITS)
    out = b"".join(inflater.feed(body[i : i + piece]) for i in range(0, len(body), piece))
    assert out + inflater.finish() == decode(body, encoding, LIMITS) == b"[1,2]"


def test_a_bomb_fed_in_pieces_is_refused_once_its_output_crosses_the_cap() -> None:
    bomb = gzip.compress(b"\n" * (256 * 1024 * 1024), 9)  # 256 MiB in about 250 KiB
    limits = DecodeLimits(max_bytes=16 * 1024 * 1024, max_ratio=float("inf"), max_members=16)
    inflater = Inflater("gzip", limits)
    produced = 0
    with pytest.raises(PayloadTooLarge):
        for i in range(0, len(bomb), 64 * 1024):  # as a socket hands it over
            produced += len(inflater.feed(bomb[i : i + 64 * 1024]))
    assert produced <= 16 * 1024 * 1024  # the slice that crossed the cap is never handed out


def test_a_body_cut_short_is_found_at_its_end() -> None:
    inflater = Inflater("gzip", LIMITS)
    assert inflater.feed(gzip.compress(b"[1,2]")[:-6]) == b"[1,2]"
    with pytest.raises(PayloadUndecodable, match="truncated"):
        inflater.finish()


@pytest.mark.parametrize("wbits", [15, -15])  # zlib-wrapped and raw deflate
def test_data_after_a_deflate_stream_in_a_later_piece_is_refused(wbits: int) -> None:
    packer = zlib.compressobj(wbits=wbits)
    inflater = Inflater("deflate", LIMITS)
    assert inflater.feed(packer.compress(b"[1,2]") + packer.flush()) == b"[1,2]"
    with pytest.raises(PayloadUndecodable, match="after the end"):
        inflater.feed(b"[3]")  # refused before anything of this piece is inflated


def test_stacked_encodings_are_refused() -> None:
    with pytest.raises(UnsupportedEncoding):
        Inflater("gzip, gzip", LIMITS)


def test_identity_is_held_to_the_size_cap() -> None:
    inflater = Inflater("identity", DecodeLimits(max_bytes=10, max_ratio=100, max_members=16))
    assert inflater.feed(b"x" * 10) == b"x" * 10
    with pytest.raises(PayloadTooLarge):
        inflater.feed(b"x")
