"""Which tenant stored each block, and the cached tokens one tenant got over blocks another stored:
the passive check of the rule "never put data of different tenants in one shared cache scope".
One owner of the rule, called by the live sidecar (:mod:`kvlens.exporter.tenants`) and by
``kvlens analyze`` alike.

The rule, per record that carries a ``tenant`` and ``prefix_hashes`` (chained block hashes: the
i-th fingerprints the whole prefix up to block i), taken in the order given:

- the blocks it got from the cache are the first ``floor(cached_tokens / block_size)`` of its
  chain (:func:`kvlens.definitions.cached_blocks`; only full blocks are cached, so a partial
  block is never credited: the count is a lower bound), at most the chain's length;
- a block never seen before is stored by this record's tenant (whether the record computed it or,
  the sidecar having started later, got it from a cache kvlens did not see filled);
- a block the record computed (past its cached blocks) that another tenant stored has several
  storers from then on: kvlens cannot tell whose copy a later hit read, so hits on it are no longer
  counted (with salted hashes two tenants never share a hash; with hashes a gateway computes
  without the salt, a salted fleet has each tenant compute its own copy, and this keeps it from
  being counted as a leak);
- each cached block whose only storer is another tenant counts ``block_size`` tokens for the
  pair (storer, getter).

Records without a tenant or without ``prefix_hashes`` are left out (neither store nor count).

Memory: at most ``capacity`` blocks are remembered, the least recently seen forgotten first (a
shared system prompt seen every minute stays). A block is keyed by
:func:`kvlens.records.prefix_key` (64 bits: an int and its 16-hex-digit spelling are one block, a
long string is not kept); a tenant by the ``hash`` of its name (one int per record, shared by the
blocks it stored). Two different tenants share a key with odds about ``n**2 / 2**62``: a miscount,
never a crash. About :data:`~kvlens.accounting.TENANT_BLOCK_BYTES` bytes a block
(measured by ``tests/unit/test_tenancy.py``). Not thread-safe: the caller holds a lock.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np

from kvlens.definitions import DEFAULT_BLOCK_SIZE, cached_blocks
from kvlens.records import RecordBatch, prefix_keys

_SEVERAL: Final = 0  # a block stored by more than one tenant (a tenant's key is never 0: _tenant_key)


@dataclass(frozen=True)
class CrossTenantHit:
    """Cached tokens a record (``row`` of its batch) got over blocks another tenant stored."""

    row: int
    storer: int  # the storing tenant's key (:func:`tenant_key`)
    tokens: int


def tenant_key(name: str) -> int:
    """A tenant's key in the store: its name's hash (never 0, which marks several storers)."""
    return hash(name) or 1


class BlockStorers:
    """The tenant that stored each remembered block, bounded to ``capacity`` blocks (LRU)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least one block")
        self.capacity = capacity
        self.forgotten = 0  # blocks forgotten past capacity
        self._storers: OrderedDict[int, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._storers)

    def add(
        self,
        batch: RecordBatch,
        rows: Iterable[int] | None = None,
        keys: Sequence[list[int] | None] | None = None,
    ) -> list[CrossTenantHit]:
        """Take the records of ``batch`` (in the order of ``rows``, all by default) and return
        the cross-tenant hits among them, one per (record, storer) in the record's block order.
        ``keys``: the batch's :meth:`~kvlens.records.RecordBatch.prefix_keys` when the caller
        has them."""
        hits: list[CrossTenantHit] = []
        tenants, chains = batch.tenant, batch.prefix_hashes
        if rows is None:
            if tenants.count(None) == len(tenants) or chains.count(None) == len(chains):
                return hits
            rows = range(len(batch))
        block_sizes = np.where(batch.block_size > 0, batch.block_size, DEFAULT_BLOCK_SIZE).tolist()
        cached = batch.cached_tokens.tolist()
        for row in rows:
            tenant, chain = tenants[row], chains[row]
            if tenant is None or not chain:
                continue
            block = block_sizes[row]
            chain_keys = prefix_keys(chain) if keys is None else keys[row]
            assert chain_keys is not None  # a chain has keys
            got = self._one(tenant_key(tenant), chain_keys, cached_blocks(cached[row], block))
            hits.extend(CrossTenantHit(row, storer, blocks * block) for storer, blocks in got.items())
        return hits

    def _one(self, tenant: int, keys: list[int], cached: int) -> dict[int, int]:
        """Blocks of a chain (``keys``) got from other tenants' stores, by storer; the store
        updated. Each step is one pass at C speed (map, comprehension) rather than a Python loop
        per block: a chain is often hundreds of blocks."""
        storers = self._storers
        found = list(map(storers.get, keys))
        got: dict[int, int] = {}
        mine = {None, tenant, _SEVERAL}
        others = [] if mine.issuperset(found) else [i for i, s in enumerate(found) if s not in mine]
        for position in others:
            storer = found[position]
            if storer is None:  # never: None is one of mine
                continue
            if position < cached:
                got[storer] = got.get(storer, 0) + 1
            else:  # this tenant computed its own copy
                storers[keys[position]] = _SEVERAL
        deque(map(storers.move_to_end, [k for k, s in zip(keys, found, strict=True) if s is not None]), 0)
        if None in found:  # blocks never seen: stored by this tenant
            storers.update([(k, tenant) for k, s in zip(keys, found, strict=True) if s is None])
            for _ in range(len(storers) - self.capacity):
                storers.popitem(last=False)
                self.forgotten += 1
        return got
