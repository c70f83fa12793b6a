"""Every decoder of outside bytes, fuzzed: it answers with records and reasons, or with its one
documented error, and never puts a value the validator did not check into a batch."""

from __future__ import annotations

import contextlib
import gzip
import json
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlens.errors import InputError, PayloadUndecodable
from kvlens.records import REASONS, Validated
from kvlens.sources.encoding import DecodeLimits, decode
from kvlens.sources.formats import FORMATS, converter
from kvlens.sources.jsonlines import records_from_lines
from kvlens.sources.push import read_records

LIMITS = DecodeLimits(1 << 20, 100, 16)

record_like = st.fixed_dictionaries(
    {},
    optional={
        "prompt_tokens": st.one_of(
            st.integers(-5, 20_000_000), st.floats(), st.text(max_size=3), st.booleans()
        ),
        "cached_tokens": st.one_of(st.integers(-5, 100), st.none(), st.floats(allow_nan=True)),
        "model": st.text(max_size=6),
        "ttft_seconds": st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-1, 10)),
        "extra": st.integers(),
    },
)


def check(validated: Validated, total: int | None = None) -> None:
    batch = validated.batch
    assert np.all(batch.cached_tokens <= batch.prompt_tokens)
    assert np.all((batch.prompt_tokens >= 0) & (batch.prompt_tokens <= 10_000_000))
    for column in (batch.queue_seconds, batch.prefill_seconds, batch.ttft_seconds, batch.e2e_seconds):
        present = column[~np.isnan(column)]
        assert np.all(np.isfinite(present)) and np.all(present >= 0)
    assert set(validated.rejections.counts_by_reason()) <= set(REASONS)
    if total is not None:
        assert len(batch) + len(validated.rejections) == total


def as_ndjson(records: list[Any]) -> bytes:
    return b"\n".join(json.dumps(r, allow_nan=True).encode() for r in records)


@settings(max_examples=300, deadline=None)
@given(st.lists(record_like, max_size=8), st.sampled_from(["ndjson", "array", "gzip"]))
def test_push_payloads_account_for_every_record(records: list[dict[str, Any]], shape: str) -> None:
    body = as_ndjson(records) if shape != "array" else json.dumps(records, allow_nan=True).encode()
    if shape == "gzip":
        body = decode(gzip.compress(body), "gzip", LIMITS)
    try:
        validated = read_records(body, 1000)
    except PayloadUndecodable:
        assert not records
        return
    check(validated, len(records))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_push_arbitrary_bytes(body: bytes) -> None:
    with contextlib.suppress(PayloadUndecodable):
        check(read_records(body, 1000))


@given(st.binary(max_size=300))
def test_gzip_arbitrary_bytes(body: bytes) -> None:
    with contextlib.suppress(InputError):
        decode(b"\x1f\x8b" + body, "gzip", DecodeLimits(4096, 100, 16))


tail_lines = st.lists(
    st.one_of(st.binary(max_size=40), record_like.map(lambda r: json.dumps(r).encode())), max_size=8
)


@settings(max_examples=200, deadline=None)
@given(tail_lines, st.sampled_from(FORMATS))
def test_tailed_lines_in_every_format(lines: list[bytes], name: str) -> None:
    check(records_from_lines(lines, converter(name, model="m"))[0])


def test_nan_is_a_field_rejection_not_a_lost_line() -> None:
    body = (
        b'{"prompt_tokens": 5, "cached_tokens": 1, "ttft_seconds": NaN}\n'
        b'{"prompt_tokens": 5, "cached_tokens": 1}'
    )
    validated = read_records(body, 1000)
    assert len(validated.batch) == 1
    assert validated.rejections.details(1)[0]["field"] == "ttft_seconds"
    assert validated.rejections.counts_by_reason() == {"not_finite": 1}
