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

The cost: a simulator's replay sends every block of a trace through here, so a block costs two
dict operations (cached, evicted), a request's finish frees its own blocks at once (their
:class:`_Hold` dies), and the free blocks are a list in the order they were freed, in runs (one a
finish), evicted by slicing; a block taken back from a run marks it, and only a marked run is
read entry by entry. The property tests hold it to a plain LRU of the free blocks, event by
event.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Protocol

from kvlens.simulate.trace import Scope

# The most a cached block costs the cache (its dict entry, its entry in the free order, its share
# of a hold), measured at the peak of filling (its dict and its order growing); tested. The keys
# are the caller's.
BLOCK_BYTES = 200


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


class _Hold:
    """What keeps a block held: the request that stored it, or took it back from the free blocks
    (its owner), while it runs. The owner's blocks are ``blocks[start:count]``, the end of what it
    holds (before ``start``, blocks others held when it came); when it finishes, ``live`` goes
    False and every block still kept by it is free at once, freed together (one run of the free
    order). ``touched``: a block freed by it was taken again since (its entry in that run is
    dead: the block is held, or free in a later run)."""

    __slots__ = ("blocks", "count", "live", "start", "touched")

    def __init__(self, blocks: Sequence[object] | None, start: int) -> None:
        self.blocks = blocks
        self.start = start
        self.count = start
        self.live = True
        self.touched = False


# The hold of a block whose owner finished while others still held it (each of them but one
# counted in ``PrefixCache._shared``: the one the pin stands for frees it)
_PINNED = _Hold(None, 0)


class PrefixCache:
    __slots__ = (
        "_anomalies",
        "_cached",
        "_front",
        "_held",
        "_order",
        "_owners",
        "_pinned",
        "_runs",
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
        # evicted), which made this most of a round-robin replay: a block costs two dict
        # operations (cached, evicted), its request's finish one for all of them (its hold dies).
        self._cached: dict[object, _Hold] = {}  # every cached block: what holds it (dead: free)
        self._held = 0  # cached blocks held (their hold live)
        self._shared: dict[object, int] = {}  # held blocks: their holders beyond the one their hold is
        self._owners: set[_Hold] = set()  # the live holds of running requests
        self._pinned: set[object] = set()  # blocks held by _PINNED
        # The free blocks, least recently freed first, from ``_front`` on (a request's blocks are
        # freed last block first), in runs: each what one finish freed, ``_runs`` their ends and
        # the hold that freed them. A free block taken again (a hit) leaves a dead entry in its
        # run, and marks the run's hold touched: an entry is live while its block still has its
        # run's hold, and a run untouched is live whole (eviction slices it, no block looked up).
        self._order: list[object] = []
        self._front = 0
        self._runs: deque[tuple[int, _Hold]] = deque()
        # Requests whose ids were no prefix chain (a block repeated, cached after one that is not,
        # held after one that is free): after the first, every request's new blocks are checked
        # before they are cached
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
        return self._held + self.private

    def available(self) -> int | None:
        """Blocks a request could still take: free ones and evictable cached ones (None:
        unbounded)."""
        return None if self.capacity is None else self.capacity - self._held - self.private

    def held_prefix(self, blocks: Sequence[object], limit: int) -> int:
        """Leading blocks of ``blocks`` (at most ``limit``) that running requests hold: a request
        starting now shares them and needs no memory for them."""
        cached = self._cached
        count = 0
        for block in blocks:
            if count >= limit or block not in cached or not cached[block].live:
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
            available = self.capacity - self._held - self.private
            if count > available:
                return False
            cached = len(self._cached)
            evict = min(cached + self.private + count - self.capacity, cached - self._held)
            if evict > 0:
                self._evict(evict)
        self.private += count
        return True

    def unreserve(self, count: int) -> None:
        """Blocks taken by :meth:`reserve` go back to the free memory."""
        self.private -= count

    def held(self, block: object) -> int:
        """Running requests holding ``block`` (0: free or not cached)."""
        hold = self._cached.get(block)
        return 1 + self._shared.get(block, 0) if hold is not None and hold.live else 0

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
        evicted no earlier), and so is what running requests hold: past the first block a chain
        lacks, the cache holds none of its rest, and past the first free one, none of its
        cached blocks is held. Ids that are no prefix chain (a record's ``prefix_hashes``, a
        trace's ``hash_ids``: a sender can send anything) are taken up to the first block that
        breaks the rule (:meth:`_chain_end`): one that came before (a cycle), one cached after
        one that is not, or one held after one that is free; what follows it is no prefix of
        what this prompt shares."""
        cached = self._cached
        count = 0
        for block in blocks:  # the cached leading run
            if block not in cached:
                break
            count += 1
        start = count  # where the blocks this request will keep (take back, or store) begin
        if count:
            run = blocks[:count] if count < len(blocks) else blocks
            if count > 1 and len(set(run)) < count:
                return self.acquire(blocks[: self._chain_end(blocks)], limit, scope)
            start = 0
            for block in run:  # others hold it: the request shares it
                if not cached[block].live:
                    break
                start += 1
            if start < count and any(cached[block].live for block in run[start:]):
                return self.acquire(blocks[: self._chain_end(blocks)], limit, scope)
            new = blocks[count:]
        else:
            new = blocks
        hold = None
        if new:
            hold = _Hold(blocks, start)
            before = len(cached)
            if self._anomalies and not cached.keys().isdisjoint(new):
                self._anomalies += 1
                return self.acquire(blocks[: self._chain_end(blocks)], limit, scope)
            for block in new:
                cached[block] = hold
            if len(cached) - before < len(new):  # a block repeats, or was cached: no chain
                self._uncache(new)
                return self.acquire(blocks[: self._chain_end(blocks)], limit, scope)
        if count:
            shared = self._shared
            for block in run[:start] if start < count else run:
                shared[block] = shared.get(block, 0) + 1
            if start < count:  # free: taken back, its entry in its run of the free order dead (run marked)
                if hold is None:
                    hold = _Hold(blocks, start)
                for block in run[start:] if start else run:
                    cached[block].touched = True
                    cached[block] = hold
                self._held += count - start
        if not new:
            if hold is not None:
                hold.count = count
                self._owners.add(hold)
            return count if count < limit else limit, count
        assert hold is not None
        rest = len(new)
        if self.capacity is not None:
            room = self.capacity - before - self.private
            if room < rest:
                # conditionals, not min() and max(): a request pays for each call
                evict = rest - room
                free = before - self._held
                if evict > free:
                    evict = free
                if evict > 0:
                    self._evict(evict)
                else:
                    evict = 0
                keep = room + evict if room + evict > 0 else 0
                self.refused += rest - keep
                if keep < rest:
                    for block in new[keep:]:
                        del cached[block]
                    new = new[:keep]
                    rest = keep
        hold.count = count + rest
        if hold.count > start:
            self._owners.add(hold)
        if rest:
            self._held += rest
            if self.events is not None:
                self.events.stored(new, blocks[count - 1] if count else None, scope)
        return count if count < limit else limit, count + rest

    def _chain_end(self, blocks: Sequence[object]) -> int:
        """How many leading ``blocks`` :meth:`acquire` takes: up to the first that came before, is
        cached after one that is not, or is held after one that is free."""
        cached = self._cached
        seen: set[object] = set()
        missed = freed = False
        for position, block in enumerate(blocks):
            hold = cached.get(block)
            if block in seen or (missed and hold is not None) or (freed and hold is not None and hold.live):
                return position
            missed = missed or hold is None
            freed = freed or (hold is not None and not hold.live)
            seen.add(block)
        return len(blocks)

    def _uncache(self, new: Sequence[object]) -> None:
        """Undo the caching of ``new`` (each set to a request's hold): the blocks that were cached
        before get their holds back (a running request's, found among the owners'; pinned; or free,
        found in the free order), the others go. This reads the whole cache, once: from then
        on each request's new blocks are checked before they are cached (``_anomalies``), a pass
        over them that chains never need."""
        cached = self._cached
        fresh = set(new)
        was: dict[object, _Hold] = {}
        free: dict[object, _Hold] = {}
        if not self._anomalies:
            for owner in self._owners:
                assert owner.blocks is not None
                for block in owner.blocks[owner.start : owner.count]:
                    if block in fresh:
                        was[block] = owner
            position = self._front
            for end, freer in self._runs:  # a free block's live entry is its last
                for block in self._order[position:end] if end > position else ():
                    if block in fresh and block not in was:
                        free[block] = freer
                position = max(position, end)
            for block, freer in free.items():
                was.setdefault(block, freer)
            for block in fresh.intersection(self._pinned):
                was.setdefault(block, _PINNED)
        for block in fresh:
            if block in was:
                cached[block] = was[block]
            else:
                cached.pop(block, None)
        self._anomalies += 1

    def release(self, blocks: Sequence[object], count: int) -> None:
        """The request that acquired ``blocks`` (holding the first ``count``) finished: they stay
        cached, evictable once no running request holds them, its last block first."""
        if count <= 0:
            return
        run = blocks if count == len(blocks) else blocks[:count]
        cached = self._cached
        hold = cached[run[-1]]
        if hold.count != count or (
            hold.blocks is not blocks and (hold.blocks is None or list(hold.blocks[:count]) != list(run))
        ):  # it kept no block of its own (another request holds its last): it shared them all
            hold = _Hold(None, 0)
            hold.live = False
            freed: Sequence[object] = self._unshare(run, hold)
        else:  # its own blocks are free at once, but for those others hold too
            self._owners.discard(hold)
            start = hold.start
            freed = self._unshare(run[:start], hold) if start else []
            own = run[start:] if start else run
            shared = self._shared
            if shared:
                kept = 0
                for block in own:  # others hold its leading ones, if any (a chain's prefix)
                    if block not in shared:
                        break
                    self._pin(block)
                    kept += 1
                if kept:
                    own = own[kept:]
                if not shared.keys().isdisjoint(own):  # ids that are no chain: any of them
                    rest: list[object] = []
                    for block in own:
                        if block in shared:
                            self._pin(block)
                        else:
                            rest.append(block)
                    own = rest
            hold.live = False
            hold.blocks = None  # its free blocks keep the hold: not the request's ids
            freed = [*freed, *own] if freed else own
        if not freed:
            return
        self._held -= len(freed)
        order = self._order
        order += freed[::-1]
        self._runs.append((len(order), hold))
        # Dead entries cost memory until eviction passes them (never, unbounded): past twice the
        # cached blocks, the free order keeps its live entries alone.
        if len(order) > 2 * len(cached) + 4096 + self._front:
            self._compact()

    def _pin(self, block: object) -> None:
        """The owner of ``block`` finished while others hold it: it stays held, by one of them
        (the pin) and the rest (``_shared``)."""
        self._cached[block] = _PINNED
        self._pinned.add(block)
        holders = self._shared[block]
        if holders == 1:
            del self._shared[block]
        else:
            self._shared[block] = holders - 1

    def _unshare(self, run: Sequence[object], hold: _Hold) -> list[object]:
        """A request that shared ``run`` (each block held by others when it came) lets go of it:
        each block one holder fewer. Returns those it was the last holder of, now kept by ``hold``
        (its own, dead once it finished)."""
        cached, shared = self._cached, self._shared
        freed = []
        for block in run:
            holders = shared.get(block)
            if holders is None:  # it was the holder its pin stood for
                cached[block] = hold
                self._pinned.discard(block)
                freed.append(block)
            elif holders == 1:
                del shared[block]
            else:
                shared[block] = holders - 1
        return freed

    def _live_entries(self, front: int, count: int) -> tuple[list[object], int]:
        """The first ``count`` live entries of the free order from ``front`` on (fewer if it has
        fewer), and the position after the last."""
        live: list[object] = []
        position = front
        if count <= 0:
            return live, position
        for end, hold in self._runs:
            if end > position:
                taken, position = self._live_in_run(position, end, hold, count - len(live))
                live += taken
                if len(live) == count:
                    break
        return live, position

    def _live_in_run(self, position: int, end: int, hold: _Hold, count: int) -> tuple[list[object], int]:
        """The first ``count`` live entries of a run from ``position`` until its ``end``, and the
        position after the last (``end`` if fewer): untouched, all are live; touched, those whose
        block still has the run's hold."""
        order = self._order
        if not hold.touched:
            stop = min(end, position + count)
            return order[position:stop], stop
        cached = self._cached
        at = [i for i in range(position, end) if cached.get(order[i]) is hold][:count]
        return [order[i] for i in at], (at[-1] + 1 if len(at) == count else end)

    def _compact(self) -> None:
        """The free order with its live entries alone, each run untouched again."""
        order: list[object] = []
        runs: deque[tuple[int, _Hold]] = deque()
        position = self._front
        for end, hold in self._runs:
            if end > position:
                live, position = self._live_in_run(position, end, hold, end - position)
                if live:
                    order += live
                    hold.touched = False
                    runs.append((len(order), hold))
        self._order, self._front, self._runs = order, 0, runs

    def _evict(self, count: int) -> None:
        """Evict the ``count`` least recently freed blocks (at most the free ones: the caller
        checks)."""
        order, runs = self._order, self._runs
        front = self._front
        end = front + count
        while runs[0][0] <= front:  # runs evicted whole
            runs.popleft()
        for run_end, hold in runs:  # the runs the slice reaches: untouched, it is all live
            if hold.touched:
                victims, end = self._live_entries(front, count)
                break
            if run_end >= end:
                victims = order[front:end]
                break
        else:
            victims, end = self._live_entries(front, count)
        if end > 4096 and end * 2 > len(order):  # the evicted entries go, a half at a time
            del order[:end]
            self._runs = deque((run_end - end, hold) for run_end, hold in runs if run_end > end)
            end = 0
        self._front = end
        cached = self._cached
        for block in victims:
            del cached[block]
        if self.events is not None:
            self.events.removed(victims)
        self.evictions += count

    def drop_free(self) -> int:
        """Forget every cached block no running request holds (vLLM's reset of the prefix cache;
        held blocks stay, as a running request still needs them). Returns how many went."""
        free = self._live_entries(self._front, len(self._cached) - self._held)[0]
        self._order = []
        self._front = 0
        self._runs.clear()
        for block in free:
            del self._cached[block]
        if self.events is not None and free:
            self.events.removed(free)
        return len(free)
