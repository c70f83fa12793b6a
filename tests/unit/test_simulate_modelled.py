"""Causes modelled from records (prefix ids + replica) through per-replica modelled caches,
checked exactly against the simulator's walk on the bundled trace."""

from __future__ import annotations

from collections import Counter

from kvlens.fleet.causes import EVICTED_HERE, HELD_ELSEWHERE, NEW
from kvlens.fleet.index import FleetIndex
from kvlens.records import prefix_key
from kvlens.simulate.modelled import ModelledFleet
from kvlens.simulate.run import walk
from kvlens.simulate.trace import BUNDLED, MOONCAKE, Trace

BLOCK = 512


def causes(index: FleetIndex) -> Counter[str]:
    out: Counter[str] = Counter()
    for (_, cause), tokens in index.recomputed_tokens.items():
        out[cause] += tokens
    return out


def test_one_modelled_replica_loses_what_the_walk_of_its_capacity_loses() -> None:
    requests = list(Trace(str(BUNDLED), MOONCAKE, BLOCK).requests())
    reachable = walk(requests, None, BLOCK, "reachable").totals.cached_tokens
    bounded = walk(requests, 3000, BLOCK, "bounded").totals.cached_tokens
    fleet = ModelledFleet(FleetIndex(hashes_alike=True), 3000, BLOCK)
    reused = sum(fleet.record("r0", r.blocks, r.prompt_tokens) for r in requests)
    assert reused == bounded
    found = causes(fleet.index)
    assert set(found) == {NEW, EVICTED_HERE}
    assert found[EVICTED_HERE] == reachable - bounded


def test_unbounded_modelled_replicas_lose_to_routing_what_they_did_not_reuse() -> None:
    requests = list(Trace(str(BUNDLED), MOONCAKE, BLOCK).requests())[:1500]
    reachable = walk(requests, None, BLOCK, "reachable").totals.cached_tokens
    fleet = ModelledFleet(FleetIndex(hashes_alike=True), None, BLOCK)
    reused = sum(fleet.record(f"r{i % 3}", r.blocks, r.prompt_tokens) for i, r in enumerate(requests))
    found = causes(fleet.index)
    assert set(found) == {NEW, HELD_ELSEWHERE}
    assert found[HELD_ELSEWHERE] == reachable - reused


def test_litellm_ids_and_their_partial_last_block() -> None:
    assert prefix_key("00000000000000ff") == 255
    assert prefix_key("not hex at all") == prefix_key("not hex at all") != prefix_key("not hex at al1")
    fleet = ModelledFleet(FleetIndex(hashes_alike=True), None, 16, partial_last_block=True)
    ids = [f"{i:016x}" for i in (1, 2, 3)]  # 2 full blocks and a partial one: 40 tokens
    assert fleet.record("a", ids, 40) == 0
    assert fleet.index.recomputed["a", NEW] == 2
    assert fleet.record("b", ids, 40) == 0
    assert fleet.index.recomputed["b", HELD_ELSEWHERE] == 2
    assert fleet.record("a", ids[:2], 32) == 16  # the last token's block is recomputed


def test_an_index_keyed_by_content_is_refused() -> None:
    import pytest

    with pytest.raises(ValueError, match="hashes_alike=True"):
        ModelledFleet(FleetIndex(), 10, 16)
