"""One replica's block-level prefix cache, as vLLM's V1 block pool keeps it.

A block is known by its key, which stands for the block and its whole prefix (chained hashes), so
a request's cached prefix is the longest run of its keys, from the first, that the cache holds.
Blocks a running request holds are never evicted; when it finishes they stay cached and become
evictable, last block first (vLLM frees a request's blocks in reverse order, so a prefix outlives
its tail), and the least recently freed block is evicted first when room is needed. A block for
which there is no room (every cached block held by running requests) is not cached, and nor is
anything after it in that request.

Blocks a request holds outside the prefix cache (the part-filled last block of its prompt, and
the blocks its output fills, which no other request can share) are counted, not keyed:
:meth:`PrefixCache.reserve` takes them from the same memory, evicting cached blocks nobody holds
as it must, and refuses when held blocks fill it (the scheduler then makes the request wait, or
preempts one, as vLLM's does). They are nothing to the cache's contents otherwise.

So the cache is prefix-closed: a block is freed no earlier than the blocks after it (a request
holding a block holds its prefix, and frees its tail first), hence evicted no earlier, and a
cached block's whole prefix is cached. :meth:`PrefixCache.acquire` relies on it; the property
tests check it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from kvlens.simulate.trace import Scope


def hit_limit(prompt_tokens: int, block_size: int) -> int:
    """The most blocks of a prompt a prefix cache serves: vLLM recomputes a prompt's last token
    (to get its logits), so at most ``(n - 1) // B`` blocks hit."""
    return (prompt_tokens - 1) // block_size


class CacheEvents(Protocol):
    """What a cache tells of its contents, as an engine's KV events do (vLLM's ``BlockStored`` and
    ``BlockRemoved``): blocks newly cached, each run after ``parent`` (None: from the first
    block) by a request of ``scope`` (its cache salt and LoRA, which vLLM publishes in the extra
    keys; None: neither), and blocks evicted. Lookups and hits are not events."""

    def stored(self, blocks: Sequence[object], parent: object | None, scope: Scope | None = None) -> None: ...

    def removed(self, blocks: Sequence[object]) -> None: ...


class PrefixCache:
    __slots__ = ("_free", "_held", "capacity", "events", "evictions", "private", "refused")

    def __init__(self, capacity_blocks: int | None, events: CacheEvents | None = None) -> None:
        """``capacity_blocks``: blocks the replica's KV memory holds; None: unbounded. ``events``
        is told every block cached and evicted (the simulated fleet's KV events); it changes
        nothing the cache does."""
        if capacity_blocks is not None and capacity_blocks < 0:
            raise ValueError("capacity must be >= 0 blocks")
        self.capacity = capacity_blocks
        self._held: dict[object, int] = {}  # block -> running requests holding it
        self._free: OrderedDict[object, None] = OrderedDict()  # cached, held by none; LRU first
        self.evictions = 0
        self.refused = 0  # blocks left uncached: no room (every cached block held by a request)
        self.private = 0  # blocks running requests hold outside the cache (reserve)
        self.events = events

    def __len__(self) -> int:
        return len(self._held) + len(self._free)

    def __contains__(self, block: object) -> bool:
        return block in self._held or block in self._free

    @property
    def held_blocks(self) -> int:
        """Blocks running requests hold, in the cache or reserved beside it (the rest of the
        memory is free or could be evicted: vLLM's ``kv_cache_usage_perc`` is this share)."""
        return len(self._held) + self.private

    def available(self) -> int | None:
        """Blocks a request could still take: free ones and evictable cached ones (None:
        unbounded)."""
        return None if self.capacity is None else self.capacity - len(self._held) - self.private

    def held_prefix(self, blocks: Sequence[object], limit: int) -> int:
        """Leading blocks of ``blocks`` (at most ``limit``) that running requests hold: a request
        starting now shares them and needs no memory for them."""
        held = self._held
        count = 0
        for block in blocks:
            if count >= limit or block not in held:
                break
            count += 1
        return count

    def reserve(self, count: int) -> bool:
        """Take ``count`` blocks outside the cache, evicting cached blocks nobody holds (least
        recently freed first) as room requires; False, and nothing taken, when held blocks leave
        too few."""
        if count <= 0:
            return True
        if self.capacity is not None:
            available = self.capacity - len(self._held) - self.private
            if count > available:
                return False
            self._evict(len(self._held) + len(self._free) + self.private + count - self.capacity)
        self.private += count
        return True

    def unreserve(self, count: int) -> None:
        """Blocks taken by :meth:`reserve` go back to the free memory."""
        self.private -= count

    def _evict(self, count: int) -> None:
        free = self._free
        count = min(count, len(free))
        if count <= 0:
            return
        evict_oldest = free.popitem
        if self.events is None:
            for _ in range(count):
                evict_oldest(False)
        else:
            self.events.removed([evict_oldest(False)[0] for _ in range(count)])
        self.evictions += count

    def held(self, block: object) -> int:
        """Running requests holding ``block`` (0: free or not cached)."""
        return self._held.get(block, 0)

    def cached_prefix(self, blocks: Sequence[object], limit: int) -> int:
        """Leading blocks of ``blocks`` that are cached, at most ``limit`` (what a request would
        reuse here now; nothing changes)."""
        held, free = self._held, self._free
        count = 0
        for block in blocks:
            if count >= limit or (block not in held and block not in free):
                break
            count += 1
        return count

    def acquire(self, blocks: Sequence[object], limit: int, scope: Scope | None = None) -> tuple[int, int]:
        """A request starts: it reuses its cached leading blocks (at most ``limit``), and holds
        every block it has until :meth:`release`, the new ones cached where there is room (told to
        ``events`` with the request's ``scope``). Returns (blocks reused, blocks held: a prefix of
        ``blocks``).

        A chain is taken up to its first repeated block: a prefix chain never repeats one (each
        block's id chains its parent's), so a repeat is a cycle sent as ids (a record's
        ``prefix_hashes``, a trace's), and what follows it no prefix of this prompt; held
        twice, it was released twice (a KeyError)."""
        if len(set(blocks)) < len(blocks):
            blocks = blocks[: _first_repeat(blocks)]
        held, free = self._held, self._free
        holders_of = held.get
        count = 0
        for block in blocks:  # the cached leading run
            holders = holders_of(block)
            if holders is not None:
                held[block] = holders + 1
            elif block in free:
                del free[block]
                held[block] = 1
            else:
                break
            count += 1
        reused = min(count, limit)
        if count == len(blocks):
            return reused, count
        # The cache is prefix-closed (a block is freed no earlier than any block after it, so it
        # is evicted no earlier), so past the first block it lacks it holds none of the rest:
        # they are cached at once, as many as there is room for once free blocks are evicted.
        rest = len(blocks) - count
        if self.capacity is not None:
            room = self.capacity - len(held) - len(free) - self.private
            if room < rest:
                evict = min(rest - room, len(free))
                self._evict(evict)
                self.refused += rest - room - evict
                rest = room + evict
        stored = blocks[count : count + rest]
        held.update(dict.fromkeys(stored, 1))
        if self.events is not None and stored:
            self.events.stored(stored, blocks[count - 1] if count else None, scope)
        return reused, count + rest

    def release(self, blocks: Sequence[object], count: int) -> None:
        """The request that acquired ``blocks`` (holding the first ``count``) finished: they stay
        cached, evictable once no running request holds them, its last block first."""
        held, free = self._held, self._free
        release = held.pop
        for block in reversed(blocks if count == len(blocks) else blocks[:count]):
            holders = release(block)
            if holders == 1:
                free[block] = None
            else:
                held[block] = holders - 1

    def drop_free(self) -> int:
        """Forget every cached block no running request holds (vLLM's reset of the prefix cache;
        held blocks stay, as a running request still needs them). Returns how many went."""
        count = len(self._free)
        if self.events is not None and count:
            self.events.removed(list(self._free))
        self._free.clear()
        return count


def _first_repeat(blocks: Sequence[object]) -> int:
    """The position of the first block that came before in ``blocks`` (one is known to)."""
    seen: set[object] = set()
    for position, block in enumerate(blocks):
        if block in seen:
            return position
        seen.add(block)
    return len(blocks)
