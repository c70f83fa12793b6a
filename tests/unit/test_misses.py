"""Per-request diagnoses against a scripted fleet: which block each request first missed, why,
and the tokens and work of each cause, by hand."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import orjson
import pytest

from kvlens.cli import main
from kvlens.definitions import CostModel
from kvlens.exporter.diagnoses import RequestDiagnoses
from kvlens.exporter.settings import DIAGNOSIS_BYTES
from kvlens.fleet.limits import SEEN_BLOCK_BYTES
from kvlens.fleet.misses import (
    EVICTED_ELSEWHERE,
    EVICTED_HERE,
    HELD_ELSEWHERE,
    HIT,
    MISS_CAUSES,
    NEW,
    SEEN_ELSEWHERE,
    Diagnosis,
    MissClassifier,
    block_pairs,
)
from kvlens.records import RecordBatch, batch_from_objects
from tests.json_outputs import validate

B = 4
COST = CostModel(a=1.0, b=1.0 / 1024.0)


def tokens_of(diagnosis: Diagnosis) -> dict[str, int]:
    return {c: t for c, t in zip(MISS_CAUSES, diagnosis.tokens, strict=True) if t}


def test_a_scripted_fleet_s_requests_are_diagnosed_block_by_block() -> None:
    classifier = MissClassifier()
    # r1 computes blocks 1..4 (and 2 tokens of a partial block): all new, first miss at block 0
    first = classifier.diagnose("q1", "a", [1, 2, 3, 4], 4 * B + 2, 0, B)
    assert first is not None
    assert (first.first_missed_block, first.cause, tokens_of(first)) == (0, NEW, {NEW: 4 * B + 2})
    assert first.pairs[0] == sum(range(1, 4 * B + 3))
    # on a, blocks 1, 2 from cache; 3 was evicted here; 5 is a new block at depth 3
    second = classifier.diagnose("q2", "a", [1, 2, 3, 5], 4 * B, 2 * B, B)
    assert second is not None
    assert (second.first_missed_block, second.cause) == (2, EVICTED_HERE)
    assert tokens_of(second) == {EVICTED_HERE: B, NEW: B}
    assert second.pairs[MISS_CAUSES.index(EVICTED_HERE)] == block_pairs(2, B) == sum(range(9, 13))
    assert second.work(COST) == {EVICTED_HERE: B + 42 / 1024, NEW: B + 58 / 1024}
    assert second.lost_work(COST) == B + 42 / 1024
    # on b: the whole prefix was only ever on a: from the records alone, seen elsewhere
    third = classifier.diagnose("q3", "b", [1, 2], 2 * B, 0, B)
    assert third is not None
    assert (third.first_missed_block, third.cause, tokens_of(third)) == (
        0,
        SEEN_ELSEWHERE,
        {SEEN_ELSEWHERE: 2 * B},
    )
    # everything a block cache could give came from cache: a hit, nothing missed but the tail
    fourth = classifier.diagnose("q4", "b", [1, 2], 2 * B + 1, 2 * B, B)
    assert fourth is not None
    assert (fourth.first_missed_block, fourth.cause, tokens_of(fourth)) == (None, HIT, {NEW: 1})
    assert fourth.pairs[0] == 2 * B + 1


def test_with_the_engines_holders_elsewhere_splits_into_held_and_evicted() -> None:
    held = {1: ["a"], 2: []}
    classifier = MissClassifier(holders=lambda key: held.get(key, []))
    classifier.diagnose("q1", "a", [1, 2], 2 * B, 0, B)
    diagnosis = classifier.diagnose("q2", "b", [1, 2, 3], 3 * B, 0, B)
    assert diagnosis is not None
    assert diagnosis.cause == HELD_ELSEWHERE
    assert tokens_of(diagnosis) == {HELD_ELSEWHERE: B, EVICTED_ELSEWHERE: B, NEW: B}
    assert diagnosis.as_json(COST)["missed_tokens"] == {NEW: B, HELD_ELSEWHERE: B, EVICTED_ELSEWHERE: B}


def test_the_oldest_blocks_are_forgotten_past_the_cap_and_memory_stays_bounded() -> None:
    classifier = MissClassifier(remember_blocks=3)
    classifier.diagnose("q1", "a", [1, 2, 3, 4], 4 * B, 0, B)
    assert classifier.forgotten == 1
    again = classifier.diagnose("q2", "a", [1], B, 0, B)  # block 1 forgotten: new again
    assert again is not None and again.cause == NEW
    big = MissClassifier(remember_blocks=100_000)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for first in range(0, 200_000, 50):
        big.diagnose(None, "a", list(range(first + 2**40, first + 2**40 + 50)), 50 * B, 0, B)
    used = tracemalloc.get_traced_memory()[1] - before  # the peak
    tracemalloc.stop()
    assert big.forgotten == 100_000
    assert 40 < used / 100_000 <= SEEN_BLOCK_BYTES


def build_batch(records: list[dict[str, object]]) -> RecordBatch:
    validated = batch_from_objects(records)
    assert not len(validated.rejections)
    return validated.batch


def test_the_sidecar_keeps_the_last_n_diagnoses_in_the_documented_bytes() -> None:
    """10,000 diagnoses kept of 30,000 requests (ids of 36 characters, as UUIDs), measured with
    tracemalloc: at most DIAGNOSIS_BYTES each, beside the classifier's blocks."""
    diagnoses = RequestDiagnoses(keep=10_000, remember_blocks=1_000, block_size=B)
    blocks = [list(range(i * 4, i * 4 + 4)) for i in range(30_000)]
    batches = [
        build_batch(
            [
                {
                    "request_id": f"{i:036d}",
                    "replica": "a",
                    "prompt_tokens": 4 * B,
                    "cached_tokens": B,
                    "prefix_hashes": blocks[i],
                }
                for i in range(start, start + 1_000)
            ]
        )
        for start in range(0, 30_000, 1_000)
    ]
    diagnoses.add(batches[0])  # the classifier at its cap of blocks before measuring
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for batch in batches[1:]:
        diagnoses.add(batch)
    used = tracemalloc.get_traced_memory()[1] - before
    tracemalloc.stop()
    assert len(diagnoses) == 10_000
    assert diagnoses.get(f"{19_999:036d}") is None
    kept = diagnoses.get(f"{29_999:036d}")
    assert kept is not None and kept.first_missed_block == 1
    assert diagnoses.counts()[NEW] == 30_000
    assert 200 < used / 10_000 <= DIAGNOSIS_BYTES


def test_analyze_lists_the_misses_per_length_group_with_the_worst_requests(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Records out of arrival order: classified by arrival. q2 finds its prefix only on a (seen
    elsewhere, from the records alone); q3 comes back to a after its second block left."""
    records = [
        {"request_id": "q3", "replica": "a", "prompt_tokens": 3 * B, "cached_tokens": B,
         "block_size": B, "prefix_hashes": ["x1", "x2", "x9"], "arrival_time": 3.0},
        {"request_id": "q1", "replica": "a", "prompt_tokens": 2 * B, "cached_tokens": 0,
         "block_size": B, "prefix_hashes": ["x1", "x2"], "arrival_time": 1.0},
        {"request_id": "q2", "replica": "b", "prompt_tokens": 2 * B, "cached_tokens": 0,
         "block_size": B, "prefix_hashes": ["x1", "x2"], "arrival_time": 2.0},
        {"request_id": "q4", "prompt_tokens": 2 * B, "cached_tokens": 0, "arrival_time": 4.0},
    ]  # fmt: skip
    path = tmp_path / "records.jsonl"
    path.write_bytes(b"\n".join(orjson.dumps(r) for r in records) + b"\n")
    assert main(["analyze", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    validate(report)
    misses = report["misses"]
    assert misses["records"] == 3
    (label, group), *_ = misses["groups"].items()
    assert (label, list(misses["groups"])) == ("0-511", ["0-511"])
    assert group["first_miss"] == {
        "hit": 0, "new": 1, "evicted_here": 1,
        "held_elsewhere": 0, "evicted_elsewhere": 0, "seen_elsewhere": 1,
    }  # fmt: skip
    assert group["tokens"] == {
        "new": 3 * B, "evicted_here": B, "held_elsewhere": 0, "evicted_elsewhere": 0, "seen_elsewhere": 2 * B,
    }  # fmt: skip
    lost_q2 = 2 * B + pairs_of(0, 2 * B) / 1024
    lost_q3 = B + pairs_of(B, 2 * B) / 1024
    assert group["work"] == {
        "work_units": {
            "new": 2 * B + pairs_of(0, 2 * B) / 1024 + B + pairs_of(2 * B, 3 * B) / 1024,
            "evicted_here": lost_q3,
            "held_elsewhere": 0.0,
            "evicted_elsewhere": 0.0,
            "seen_elsewhere": lost_q2,
        }
    }
    assert [
        (w["request_id"], w["cause"], w["first_missed_block"], w["lost_work"]) for w in group["worst"]
    ] == [
        ("q2", "seen_elsewhere", 0, lost_q2),
        ("q3", "evicted_here", 1, lost_q3),
    ]
    assert "only the engines' KV events tell apart" in misses["note"]
    assert main(["analyze", str(path)]) == 0
    out = capsys.readouterr().out
    assert "Why requests missed" in out
    assert "0-511: q2 on b lost" in out


def pairs_of(before: int, last: int) -> int:
    """Causal pairs of the tokens at positions before+1..last."""
    return sum(range(before + 1, last + 1))


@pytest.mark.timeout(30)
def test_forgetting_the_oldest_blocks_takes_constant_time_a_block() -> None:
    """400,000 blocks through a memory of 100,000: 300,000 forgotten, each in constant time (a
    plain dict's oldest key is found past every key deleted before it: about 45 s here, where
    this takes a few)."""
    classifier = MissClassifier(remember_blocks=100_000)
    for first in range(0, 400_000, 100):
        classifier.diagnose(None, "a", list(range(first, first + 100)), 100 * B, 0, B)
    assert classifier.forgotten == 300_000


@pytest.mark.timeout(30)
def test_each_record_s_model_is_read_in_constant_time() -> None:
    """The misses walk reads each hashed record's model: one column built once, not the whole
    column again a record (20,000 hashed records took 4.4 s, 1M would take hours)."""
    from kvlens.analysis.misses import request_misses
    from kvlens.analysis.report import Derived
    from kvlens.config import load_settings

    settings = load_settings()
    records = [
        {
            "model": f"m{i % 3}",
            "prompt_tokens": 4 * B + 1,
            "cached_tokens": 0,
            "block_size": B,
            "prefix_hashes": [i, i + 1, i + 2, i + 3],
        }
        for i in range(60_000)
    ]
    batch = batch_from_objects(records).batch
    derived = Derived.of(batch, settings.prompt_length_edges, settings.cost_model_for, settings.default_model)
    assert derived.model is derived.model
    report = request_misses(derived)
    assert report is not None
    assert report["records"] == 60_000
