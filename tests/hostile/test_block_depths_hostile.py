"""Block depths (a block's position in its chain, 2 bytes a held block) against chains no engine
sends: deeper than 65,534 blocks, a block whose parent is itself, two blocks each the other's
parent. The depth never wraps: past 65,534 a block has none (its tokens counted apart, no work
modelled), and a cycle's blocks cannot climb past it. Pinned: these held before this review."""

from __future__ import annotations

import pytest

from kvlens.fleet.index import FleetIndex

pytestmark = pytest.mark.timeout(120)
DEEPEST = 65_534


def twice(steps: list[tuple[list[int], int | None]]) -> FleetIndex:
    """The steps stored, the replica cleared, the steps stored again (recomputed: with depths)."""
    index = FleetIndex()
    index.admit("r")
    for _ in range(2):
        for hashes, parent in steps:
            index.stored("r", hashes, parent, [1] * len(hashes), 1)
        index.cleared("r")
    return index


def test_a_chain_deeper_than_the_deepest_depth_has_none_past_it() -> None:
    blocks = DEEPEST + 1 + 4_465
    index = twice([(list(range(1, blocks + 1)), None)])
    known = sum(range(1, DEEPEST + 2))  # one token a block, at positions 1 .. 65,535
    assert dict(index.recomputed_pairs) == {("r", "new"): known, ("r", "evicted_here"): known}
    assert dict(index.depth_unknown_tokens) == {("r", "new"): 4_465, ("r", "evicted_here"): 4_465}


def test_a_block_that_is_its_own_parent_has_no_depth() -> None:
    index = twice([([7], 7)] * 1_000)
    assert dict(index.recomputed_pairs) == {}
    assert sum(index.depth_unknown_tokens.values()) == 2_000


def test_a_cycle_of_two_blocks_climbs_no_further_than_its_stores() -> None:
    index = twice([([1], None), ([2], 1), ([1], 2), ([2], 1), ([1], 2)])
    pairs = dict(index.recomputed_pairs)
    assert all(0 < value <= 5 * 6 // 2 * 2 for value in pairs.values()), pairs
    assert dict(index.depth_unknown_tokens) == {}
