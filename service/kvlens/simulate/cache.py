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
    __slots__ = (
        "_anomalies",
        "_cached",
        "_front",
        "_held",
        "_order",
        "_revived",
        "_shared",
        "capacity",
        "events",
        "evictions",
        "private",
        "refused",
    )

    def __init__(self, capacity_blocks: int | None, events: CacheEvents | None = None) -> None:
        """``capacity_blocks``: blocks the replica's KV memory holds; None: unbounded. ``events``
        is told every block cached and evicted (the simulated fleet's KV events); it changes
        nothing the cache does."""
        if capacity_blocks is not None and capacity_blocks < 0:
            raise ValueError("capacity must be >= 0 blocks")
        self.capacity = capacity_blocks
        # The simulator's blocks go through here two to three times each (cached and held, freed,
        # evicted), which made this most of a round-robin replay: the cache keeps them in sets
        # and lists changed a run of a request's blocks at a time (one C loop each), never block
        # by block in Python.
        self._cached: set[object] = set()  # every cached block, held or free
        self._held: set[object] = set()  # cached blocks running requests hold
        self._shared: dict[object, int] = {}  # held blocks: their holders beyond the first
        # The free blocks, least recently freed first, from ``_front`` on (a request's blocks are
        # freed last block first). A free block taken again (a hit) leaves a dead entry behind,
        # counted in ``_revived``: a block's first entries are its dead ones (its live entry, if
        # it is free, is its last), and eviction skips them.
        self._order: list[object] = []
        self._front = 0
        self._revived: dict[object, int] = {}
        # Requests whose ids were no prefix chain (a block repeated, or cached after one that is
        # not): after the first, every request's new blocks are checked before they are cached
        self._anomalies = 0
        self.evictions = 0
        self.refused = 0  # blocks left uncached: no room (every cached block held by a request)
        self.private = 0  # blocks running requests hold outside the cache (reserve)
        self.events = events

    def __len__(self) -> int:
        return len(self._cached)

    def __contains__(self, block: object) -> bool:
        return block in self._cached

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
            cached = len(self._cached)
            evict = min(cached + self.private + count - self.capacity, cached - len(self._held))
            if evict > 0:
                self._evict(evict)
        self.private += count
        return True

    def unreserve(self, count: int) -> None:
        """Blocks taken by :meth:`reserve` go back to the free memory."""
        self.private -= count

    def held(self, block: object) -> int:
        """Running requests holding ``block`` (0: free or not cached)."""
        return 1 + self._shared.get(block, 0) if block in self._held else 0

    def cached_prefix(self, blocks: Sequence[object], limit: int) -> int:
        """Leading blocks of ``blocks`` that are cached, at most ``limit`` (what a request would
        reuse here now; nothing changes)."""
        cached = self._cached
        count = 0
        for block in blocks:
            if count >= limit or block not in cached:
                break
            count += 1
        return count

    def acquire(self, blocks: Sequence[object], limit: int, scope: Scope | None = None) -> tuple[int, int]:
        """A request starts: it reuses its cached leading blocks (at most ``limit``), and holds
        every block it has until :meth:`release`, the new ones cached where there is room (told to
        ``events`` with the request's ``scope``). Returns (blocks reused, blocks held: a prefix of
        ``blocks``).

        The cache is prefix-closed (a block is freed no earlier than any block after it, so it is
        evicted no earlier), so past the first block it lacks it holds none of a chain's rest.
        Ids that are no prefix chain (a record's ``prefix_hashes``, a trace's ``hash_ids``: a
        sender can send anything) are taken up to the first block that breaks the rule
        (:func:`_chain_end`): one that came before (a cycle), or one cached after one that is not;
        what follows it is no prefix of what this prompt shares."""
        cached = self._cached
        count = 0
        for block in blocks:  # the cached leading run
            if block not in cached:
                break
            count += 1
        if count:
            if count > 1 and len(set(blocks[:count])) < count:
                return self.acquire(blocks[: _chain_end(blocks, cached)], limit, scope)
            new = blocks[count:]
        else:
            new = blocks
        if new:
            before = len(cached)
            if self._anomalies and not cached.isdisjoint(new):
                self._anomalies += 1
                return self.acquire(blocks[: _chain_end(blocks, cached)], limit, scope)
            cached.update(new)
            if len(cached) - before < len(new):  # a block repeats, or was cached: no chain
                self._uncache(new)
                return self.acquire(blocks[: _chain_end(blocks, cached)], limit, scope)
        held = self._held
        if count:
            shared, revived = self._shared, self._revived
            for block in blocks[:count] if new else blocks:
                if block in held:
                    shared[block] = shared.get(block, 0) + 1
                else:  # free: held again, its entry in the free order dead
                    held.add(block)
                    revived[block] = revived.get(block, 0) + 1
        if not new:
            return min(count, limit), count
        rest = len(new)
        if self.capacity is not None:
            room = self.capacity - before - self.private
            if room < rest:
                evict = min(rest - room, before - len(held))
                if evict > 0:
                    self._evict(evict)
                else:
                    evict = 0
                keep = max(room + evict, 0)
                self.refused += rest - keep
                if keep < rest:
                    cached.difference_update(new[keep:])
                    new = new[:keep]
                    rest = keep
        if rest:
            held.update(new)
            if self.events is not None:
                self.events.stored(new, blocks[count - 1] if count else None, scope)
        return min(count, limit), count + rest

    def _uncache(self, new: Sequence[object]) -> None:
        """Undo ``_cached.update(new)``: the blocks of ``new`` that were cached before are those
        held or with an entry in the free order (every block with one is cached). The free order
        is read whole, once per cache: from then on each request's new blocks are checked before
        they are cached (``_anomalies``), which costs a pass over them that chains never need."""
        fresh = set(new)
        if self._anomalies:  # checked: none was cached, some repeat
            kept: set[object] = set()
        else:
            kept = fresh.intersection(self._order[self._front :]) | fresh.intersection(self._held)
        self._cached.difference_update(fresh - kept)
        self._anomalies += 1

    def release(self, blocks: Sequence[object], count: int) -> None:
        """The request that acquired ``blocks`` (holding the first ``count``) finished: they stay
        cached, evictable once no running request holds them, its last block first."""
        if count <= 0:
            return
        run = blocks if count == len(blocks) else blocks[:count]
        shared = self._shared
        if shared:
            # Blocks others hold too: a leading run, as requests hold their chains' prefixes
            # (checked after: ids that are no chain can share any block)
            others = 0
            for block in run:
                holders = shared.get(block)
                if holders is None:
                    break
                if holders == 1:
                    del shared[block]
                else:
                    shared[block] = holders - 1
                others += 1
            if others:
                run = run[others:]
            if not shared.keys().isdisjoint(run):
                self._release_each(run)
                return
        self._held.difference_update(run)
        order = self._order
        order += run[::-1]
        # Dead entries cost memory until eviction passes them (never, unbounded): past twice the
        # cached blocks, the free order keeps its live entries alone.
        if len(order) > 2 * len(self._cached) + 4096 + self._front:
            self._compact()

    def _release_each(self, run: Sequence[object]) -> None:
        shared, freed = self._shared, []
        for block in reversed(run):
            holders = shared.get(block)
            if holders is None:
                freed.append(block)
            elif holders == 1:
                del shared[block]
            else:
                shared[block] = holders - 1
        self._held.difference_update(freed)
        self._order += freed
        if len(self._order) > 2 * len(self._cached) + 4096 + self._front:
            self._compact()

    def _compact(self) -> None:
        self._order = self._live()
        self._front = 0
        self._revived.clear()

    def _live(self) -> list[object]:
        """The free blocks, least recently freed first (the free order without its dead entries;
        nothing changes)."""
        revived = dict(self._revived)
        live = []
        for block in self._order[self._front :]:
            dead = revived.get(block)
            if dead is None:
                live.append(block)
            elif dead == 1:
                del revived[block]
            else:
                revived[block] = dead - 1
        return live

    def _evict(self, count: int) -> None:
        """Evict the ``count`` least recently freed blocks (at most the free ones: the caller
        checks)."""
        order, revived = self._order, self._revived
        front = self._front
        end = front + count
        victims = order[front:end]
        if revived and not revived.keys().isdisjoint(victims):
            victims = []
            end = front
            while len(victims) < count:
                block = order[end]
                end += 1
                dead = revived.get(block)
                if dead is None:
                    victims.append(block)
                elif dead == 1:
                    del revived[block]
                else:
                    revived[block] = dead - 1
        if end > 4096 and end * 2 > len(order):  # the evicted entries go, a half at a time
            del order[:end]
            end = 0
        self._front = end
        self._cached.difference_update(victims)
        if self.events is not None:
            self.events.removed(victims)
        self.evictions += count

    def drop_free(self) -> int:
        """Forget every cached block no running request holds (vLLM's reset of the prefix cache;
        held blocks stay, as a running request still needs them). Returns how many went."""
        free = self._live()
        self._order = []
        self._front = 0
        self._revived.clear()
        self._cached.difference_update(free)
        if self.events is not None and free:
            self.events.removed(free)
        return len(free)


def _chain_end(blocks: Sequence[object], cached: set[object]) -> int:
    """How many leading ``blocks`` :meth:`PrefixCache.acquire` takes: up to the first that came
    before in ``blocks``, or that ``cached`` holds after one it does not."""
    seen: set[object] = set()
    missed = False
    for position, block in enumerate(blocks):
        if block in seen or (missed and block in cached):
            return position
        missed = missed or block not in cached
        seen.add(block)
    return len(blocks)
