"""What the fleet index hands a scrape (:meth:`kvlens.fleet.index.FleetIndex.snapshot`): its
counters by replica, cause and tier, copied under the index's lock, and the modelled work of the
recomputed tokens read from them by any cost model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvlens.definitions import CostModel


@dataclass
class IndexSnapshot:
    recomputed_blocks: dict[tuple[str, str], int]  # (replica, cause) -> blocks
    recomputed_tokens: dict[tuple[str, str], int]  # (replica, cause) -> tokens
    recomputed_pairs: dict[tuple[str, str], int]  # (replica, cause) -> causal pairs, known depth
    depth_unknown_tokens: dict[tuple[str, str], int]  # (replica, cause) -> tokens, depth unknown
    stored: dict[tuple[str, str], int]  # (replica, medium) -> blocks stored
    removed: dict[tuple[str, str], int]  # (replica, medium) -> blocks removed
    held: dict[tuple[str, str], int]  # (replica, medium) -> blocks held now
    distinct_blocks: int  # blocks some replica holds
    duplicated_blocks: int  # (block, replica) holdings beyond the first of each block
    remembered_blocks: int
    forgotten_blocks: int
    untracked_blocks: int
    unknown_removed: int
    memory_bytes: int
    # replica -> blocks of primary-tier stores that start a chain without a cache salt (counted
    # with ``require_cache_salt`` only, by shard 0 only)
    unsalted_blocks: dict[str, int] = field(default_factory=dict)

    def recomputed_work(self, cost: CostModel) -> dict[tuple[str, str], float]:
        """(replica, cause) -> the modelled prefill work of its recomputed tokens whose depth is
        known: ``a*tokens + b*pairs`` (:meth:`CostModel.work_of_sums`), each token's pairs from
        its position in its chain, so a block lost deep in a long prompt weighs what recomputing
        it costs (the same cost model as compute saved). Tokens of unknown depth are left out
        (:attr:`depth_unknown_tokens`), never given a guessed position."""
        work = {}
        for key, tokens in self.recomputed_tokens.items():
            known = tokens - self.depth_unknown_tokens.get(key, 0)
            work[key] = cost.work_of_sums(known, self.recomputed_pairs.get(key, 0))
        return work
