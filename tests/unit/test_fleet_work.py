"""The funnel in compute: each recomputed block's modelled prefill work from its depth in its
chain, by the cost model of compute saved, checked against positions computed by hand."""

from __future__ import annotations

import pytest

from kvlens.definitions import CostModel, flops_cost_model
from kvlens.exporter.collector import kv_families
from kvlens.fleet.causes import EVICTED_HERE, HELD_ELSEWHERE, NEW, UNKNOWN
from kvlens.fleet.index import FleetIndex
from kvlens.fleet.ordering import Publisher
from kvlens.fleet.subscriber import KVEvents

BLOCK = 4
COST = CostModel(a=1.0, b=1.0 / 1024.0)


def pairs(first: int, last: int) -> int:
    """Causal pairs of the tokens at positions first..last (1-based): a token at p attends to p."""
    return sum(range(first, last + 1))


def chain(index: FleetIndex, replica: str, hashes: list[int], parent: int | None = None) -> None:
    index.stored(replica, hashes, parent, [h % 1000 for h in hashes for _ in range(BLOCK)], BLOCK)


@pytest.mark.parametrize("alike", [False, True])
def test_a_lost_block_at_depth_0_and_at_depth_100_cost_their_positions(alike: bool) -> None:
    index = FleetIndex(hashes_alike=alike)
    hashes = list(range(1000, 1101))  # 101 blocks: depths 0..100, one event
    chain(index, "a", hashes)
    assert index.recomputed_pairs[("a", NEW)] == pairs(1, 101 * BLOCK)
    index.removed("a", [hashes[0], hashes[100]])
    chain(index, "a", [hashes[0]])  # depth 0 again: the first block of its chain
    chain(index, "a", [hashes[100]], parent=hashes[99])  # depth 100: its parent still held
    snapshot = index.snapshot()
    depth0, depth100 = pairs(1, BLOCK), pairs(100 * BLOCK + 1, 101 * BLOCK)
    assert (depth0, depth100) == (10, 1610)
    assert snapshot.recomputed_pairs[("a", EVICTED_HERE)] == depth0 + depth100
    assert snapshot.recomputed_work(COST)[("a", EVICTED_HERE)] == 2 * BLOCK + (10 + 1610) / 1024
    # a block at depth 100 costs what C(n) - C(h) says of its 4 tokens after 400 cached
    assert COST.remaining_work_of(101 * BLOCK, 100 * BLOCK) == BLOCK + 1610 / 1024
    assert snapshot.depth_unknown_tokens == {}


def test_a_chain_whose_start_was_never_seen_is_counted_depth_unknown_never_guessed() -> None:
    index = FleetIndex(hashes_alike=True)
    index.stored("b", [7, 8], None, [1] * 2 * BLOCK, BLOCK)  # held on b: a's store is held elsewhere
    chain(index, "a", [7, 8, 9], parent=6)  # 6 never seen on a: no depth for any of them
    chain(index, "a", [10], parent=9)  # a child of a depth-unknown block: unknown too
    snapshot = index.snapshot()
    assert snapshot.recomputed_tokens[("a", HELD_ELSEWHERE)] == 2 * BLOCK
    assert snapshot.depth_unknown_tokens == {("a", HELD_ELSEWHERE): 2 * BLOCK, ("a", NEW): 2 * BLOCK}
    assert snapshot.recomputed_pairs.get(("a", NEW), 0) == 0
    assert snapshot.recomputed_work(COST)[("a", NEW)] == 0.0
    # by content key, an unseen parent leaves the content unknown as well as the depth
    keyed = FleetIndex()
    chain(keyed, "a", [7, 8], parent=6)
    assert keyed.snapshot().depth_unknown_tokens == {("a", UNKNOWN): 2 * BLOCK}


def test_depth_survives_the_replica_table_growing() -> None:
    """Past the table's first 256 slots it is rebuilt: the depths move with their rows."""
    index = FleetIndex()
    hashes = list(range(10_000, 12_000))
    for start in range(0, 2_000, 50):
        chain(index, "a", hashes[start : start + 50], parent=hashes[start - 1] if start else None)
    index.removed("a", [hashes[1_999]])
    before = index.recomputed_pairs[("a", EVICTED_HERE)]
    chain(index, "a", [hashes[1_999]], parent=hashes[1_998])
    assert index.recomputed_pairs[("a", EVICTED_HERE)] - before == pairs(1_999 * BLOCK + 1, 2_000 * BLOCK)
    assert index.recomputed_pairs[("a", NEW)] == pairs(1, 2_000 * BLOCK)


def test_the_work_is_exported_beside_the_tokens_in_the_fleet_model_s_unit() -> None:
    index = FleetIndex()
    events = KVEvents([Publisher("a", "tcp://127.0.0.1:1")], index, in_process=True)
    chain(index, "a", [1, 2])
    flops = flops_cost_model(1e9, heads=32, head_dim=128, layers=32)
    samples = {
        (family.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in kv_families(events, flops)
        for sample in family.samples
    }
    labels = (("cause", NEW), ("replica", "a"), ("unit", "flops"))
    assert samples["kvlens_kv_recomputed_work", labels] == 2e9 * 8 + 4 * 32 * 128 * 32 * pairs(1, 8)
    assert samples["kvlens_kv_recomputed_work", (("cause", EVICTED_HERE), *labels[1:])] == 0
    assert samples["kvlens_kv_depth_unknown_tokens", labels[:2]] == 0
