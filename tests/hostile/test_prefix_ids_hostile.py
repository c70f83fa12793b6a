"""``prefix_hashes`` ids as a sender spells them: every reader keys an id alike
(:func:`kvlens.records.prefix_key`), and reading a record's ids costs no Python call a block, so a
body of the shortest ids cannot buy seconds of the ingest worker."""

from __future__ import annotations

import sys
from collections import Counter
from types import FrameType
from typing import Any

import orjson
import pytest

from kvlens.exporter.diagnoses import RequestDiagnoses
from kvlens.records import RecordBatch, prefix_key, prefix_keys
from kvlens.sources.push import read_records
from kvlens.tenancy import BlockStorers, tenant_key

pytestmark = pytest.mark.timeout(60)


def batch(*records: dict[str, Any]) -> RecordBatch:
    validated = read_records(orjson.dumps(list(records)), 50_000, keep_prefix_hashes=True)
    assert validated.batch is not None
    return validated.batch


def record(ids: list[Any], cached: int = 0, **fields: Any) -> dict[str, Any]:
    prompt = 16 * len(ids)
    return {"model": "m", "prompt_tokens": prompt, "cached_tokens": cached, "block_size": 16, **fields} | {
        "prefix_hashes": ids
    }


def test_an_id_of_decimal_digits_is_keyed_alike_by_every_reader() -> None:
    """Before: the tenants' block storers read a list of ids in one numpy pass that took a string
    of decimal digits for the number it spells: LiteLLM's 16-hex-digit id "1234567890123456" (no
    letter in it) became 1234567890123456, not 0x1234567890123456 as prefix_key reads it, so the
    same block sent as an int by another tenant was no cross-tenant hit."""
    ids: list[Any] = ["1234567890123456", "42", -1, 2**64 - 1, 2**70, "x"]
    assert prefix_keys(ids) == [prefix_key(one) for one in ids]
    assert prefix_keys([1, -1, 2**63]) == [1, 2**64 - 1, 2**63]
    storers = BlockStorers(100)
    assert storers.add(batch(record(["1234567890123456"], tenant="a"))) == []
    hits = storers.add(batch(record([0x1234567890123456], cached=16, tenant="b")))
    assert [(hit.storer, hit.tokens) for hit in hits] == [(tenant_key("a"), 16)]


def python_calls(work: Any) -> Counter[str]:
    calls: Counter[str] = Counter()

    def count(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            calls[frame.f_code.co_name] += 1

    sys.setprofile(count)
    try:
        work()
    finally:
        sys.setprofile(None)
    return calls


@pytest.mark.parametrize("ids", [[1] * 100_000, list(range(100_000))], ids=["one id", "distinct"])
def test_a_record_of_100000_blocks_is_diagnosed_without_a_python_call_a_block(ids: list[int]) -> None:
    """Before: each block cost a prefix_key call and a classification call in pure Python (0.21 s
    for 100,000 int ids: an 8 MiB body of one-digit ids, 4M blocks, held the ingest worker 8 s).
    The CPU measured on a shared machine is no exact assertion; the Python calls a block are."""
    diagnoses = RequestDiagnoses(10, 1_000_000, 16)
    diagnoses.add(batch(record(ids, request_id="warm")))
    hostile = batch(record(ids, request_id="r"))
    calls = python_calls(lambda: diagnoses.add(hostile))
    assert max(calls.values()) < 100, calls.most_common(3)
    got = diagnoses.get("r")
    assert got is not None and got.cause == "evicted_here"


def test_a_block_id_repeated_in_a_record_is_looked_up_in_the_fleet_once() -> None:
    """Before: with KV events by engine hash, each block seen on another replica was looked up in
    the fleet index (its lock taken) once per position: a record of 100,000 one-digit ids cost
    100,000 look-ups, 0.23 s (an 8 MiB body of them: about 9.5 s of the ingest worker)."""
    looked: Counter[int] = Counter()

    def holders(key: int) -> list[str]:
        looked[key] += 1
        return ["a"] if key % 2 else []

    diagnoses = RequestDiagnoses(10, 1_000, 16)
    diagnoses.classifier.holders = holders
    ids = [i % 10 for i in range(100_000)]
    diagnoses.add(batch(record(ids, request_id="a", replica="a")))
    diagnoses.add(batch(record(ids, request_id="b", replica="b")))
    assert looked == Counter(range(10))
    got = diagnoses.get("b")
    assert got is not None and (got.cause, got.tokens) == ("evicted_elsewhere", (0, 0, 800_000, 800_000, 0))
