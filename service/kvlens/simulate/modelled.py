"""The causes without KV events: records that carry ``prefix_hashes`` and ``replica`` (a gateway's
log, LiteLLM's ``prefix_block_hashes``, kvlens records) replayed through one modelled cache per
replica, the simulator's :class:`~kvlens.simulate.cache.PrefixCache` of a configured capacity,
whose events feed a :class:`~kvlens.fleet.index.FleetIndex` (give it ``hashes_alike=True``: the
ids are chained already, so they are the keys).

The causes are **modelled**: each request takes and releases its blocks at once (the simulator's
one-cache walk, :func:`kvlens.simulate.run.walk`), in the order the records are given (sort them
by arrival), and a replica's real cache size, pinning and eviction order are approximated by the
capacity. Keep their counters apart from the ones KV events give.

Prefix ids are keys as :func:`kvlens.records.prefix_key` reads them. LiteLLM also ids the prompt's final
partial block, which an engine never caches: with ``partial_last_block=True`` the last id is
dropped when the prompt is not a whole number of blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from kvlens.fleet.index import FleetIndex
from kvlens.records import prefix_keys
from kvlens.simulate.cache import PrefixCache


class IndexSink:
    """A modelled cache's events, straight into the index: the ids are the keys (hashes alike),
    so a block's tokens are never read and zeros of the right length stand in for them (making
    tokens from each key, as the simulated engines do, cost two thirds of the time)."""

    def __init__(self, index: FleetIndex, name: str, block_size: int) -> None:
        self.index = index
        self.name = name
        self.block_size = block_size

    def stored(self, blocks: Sequence[object], parent: object | None, scope: object = None) -> None:
        hashes = cast("list[int]", list(blocks))
        tokens = [0] * (len(hashes) * self.block_size)
        self.index.stored(self.name, hashes, cast("int | None", parent), tokens, self.block_size)

    def removed(self, blocks: Sequence[object]) -> None:
        self.index.removed(self.name, cast("list[int]", list(blocks)))


class ModelledFleet:
    def __init__(
        self,
        index: FleetIndex,
        capacity_blocks: int | None,
        block_size: int,
        *,
        partial_last_block: bool = False,
    ) -> None:
        if not index.hashes_alike:
            raise ValueError("the modelled fleet's index keys blocks by their ids: give it hashes_alike=True")
        self.index = index
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size
        self.partial_last_block = partial_last_block
        self._caches: dict[str, PrefixCache] = {}

    def record(self, replica: str, prefix_ids: Sequence[int | str], prompt_tokens: int) -> int:
        """One finished request: its blocks through ``replica``'s modelled cache. Returns the
        tokens the modelled cache would have reused."""
        keys = prefix_keys(prefix_ids)
        if self.partial_last_block and prompt_tokens % self.block_size and keys:
            keys = keys[:-1]
        cache = self._caches.get(replica)
        if cache is None:
            sink = IndexSink(self.index, replica, self.block_size)
            cache = self._caches[replica] = PrefixCache(self.capacity_blocks, sink)
        limit = (prompt_tokens - 1) // self.block_size  # the last token is always recomputed
        with self.index.lock:
            reused, held = cache.acquire(keys, limit)
            cache.release(keys, held)
        return reused * self.block_size
