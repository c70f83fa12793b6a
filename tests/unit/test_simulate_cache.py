"""The replica's prefix cache, by hand and by property: LRU of free blocks, tail first, blocks in
use never evicted, prefix-closed, never over capacity; and LRU's inclusion (more capacity never
reuses less) on whole traces."""

from __future__ import annotations

import tracemalloc
from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from kvlens.simulate.cache import PrefixCache
from kvlens.simulate.run import walk
from kvlens.simulate.trace import TraceRequest, chain


def test_free_blocks_are_evicted_least_recently_freed_first_tail_before_prefix() -> None:
    cache = PrefixCache(3)
    a = ("a1", "a2")
    assert cache.acquire(a, limit=2) == (0, 2)
    cache.release(a, 2)  # freed tail first: a2 is now the least recently freed
    b = ("b1", "b2")
    assert cache.acquire(b, limit=2) == (0, 2)  # b1 takes the free room, b2 evicts a2
    assert "a2" not in cache and "a1" in cache and cache.evictions == 1
    cache.release(b, 2)  # free, oldest first: a1, b2, b1
    assert cache.acquire(a, limit=2) == (1, 2)  # a1 reused; a2 back, evicting b2 (a1 is held now)
    assert "b2" not in cache and "b1" in cache and len(cache) == 3


def test_blocks_in_use_are_never_evicted() -> None:
    cache = PrefixCache(2)
    running = ("x1", "x2")
    cache.acquire(running, limit=2)
    assert cache.acquire(("z1",), limit=1) == (0, 0)  # no room: every cached block is in use
    assert "x1" in cache and "x2" in cache and "z1" not in cache
    cache.release(running, 2)
    assert cache.acquire(("z1",), limit=1) == (0, 1)
    assert "x2" not in cache and "x1" in cache  # the tail went first


def test_a_hit_stops_at_the_limit_but_every_cached_block_is_held() -> None:
    cache = PrefixCache(None)
    blocks = ("p1", "p2")
    cache.release(blocks, cache.acquire(blocks, limit=1)[1])
    assert cache.acquire(blocks, limit=1) == (1, 2)  # the last-token rule caps the reuse, not the hold
    assert cache.held("p2") == 1


def test_unbounded_and_zero_capacity() -> None:
    unbounded, none = PrefixCache(None), PrefixCache(0)
    many = tuple(range(10_000))
    assert unbounded.acquire(many, limit=10_000) == (0, 10_000)
    assert none.acquire(many, limit=10_000) == (0, 0)


# --- properties -----------------------------------------------------------------------------

# Prompts as paths in a small tree of blocks: chained keys (a key stands for its prefix), so
# requests share prefixes as real traffic does.
paths = st.lists(st.integers(0, 2), min_size=1, max_size=6).map(lambda ids: chain(tuple(ids)))
operations = st.lists(st.tuples(st.booleans(), paths), min_size=1, max_size=60)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 8), operations)
def test_the_cache_keeps_its_invariants(capacity: int, steps: list[tuple[bool, tuple[int, ...]]]) -> None:
    cache = PrefixCache(capacity)
    parents = {}
    running: list[tuple[tuple[int, ...], int]] = []
    for start, blocks in steps:
        parents |= {key: (blocks[i - 1] if i else None) for i, key in enumerate(blocks)}
        if start or not running:
            limit = len(blocks) - 1
            reused, held = cache.acquire(blocks, limit)
            assert 0 <= reused <= min(held, limit)
            assert all(block in cache for block in blocks[:held])
            running.append((blocks, held))
        else:
            blocks, held = running.pop(0)
            cache.release(blocks, held)
        assert len(cache) <= capacity
        for blocks, held in running:  # a block in use is never evicted
            assert all(block in cache for block in blocks[:held])
        for key, parent in parents.items():  # prefix-closed
            if key in cache and parent is not None:
                assert parent in cache


traces = st.lists(st.tuples(st.integers(1, 6 * 16), paths), min_size=1, max_size=40)


def requests(trace: list[tuple[int, tuple[int, ...]]]) -> list[TraceRequest]:
    made = []
    for index, (tokens, blocks) in enumerate(trace):
        full = min(tokens // 16, len(blocks))
        made.append(TraceRequest(index, float(index), max(tokens, 16 * full), 1, blocks[:full]))
    return made


@settings(max_examples=200, deadline=None)
@given(traces, st.integers(0, 12), st.integers(0, 12))
def test_more_capacity_never_reuses_less(
    trace: list[tuple[int, tuple[int, ...]]], small: int, more: int
) -> None:
    """LRU is a stack algorithm: one request at a time, each request reuses at least as much in
    a larger cache."""
    played = requests(trace)
    low = walk(played, small, 16, "low").totals
    high = walk(played, small + more, 16, "high").totals
    unbounded = walk(played, None, 16, "reachable").totals
    assert low.cached_tokens <= high.cached_tokens <= unbounded.cached_tokens
    assert low.hit_requests <= high.hit_requests <= unbounded.hit_requests


class _Removed:
    def __init__(self) -> None:
        self.blocks: list[object] = []

    def stored(self, blocks: object, parent: object, scope: object = None) -> None:
        pass

    def removed(self, blocks: list[object]) -> None:
        self.blocks.extend(blocks)


class _ModelLRU:
    """The documented rule, spelled the plain way (an OrderedDict of the free blocks): the cache
    keeps its free blocks in a dict and evicts its first keys, which must come to the same."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.held: dict[object, int] = {}
        self.free: OrderedDict[object, None] = OrderedDict()
        self.removed: list[object] = []

    def acquire(self, blocks: tuple[int, ...], limit: int) -> tuple[int, int]:
        count = 0
        for block in blocks:
            if block in self.held:
                self.held[block] += 1
            elif block in self.free:
                del self.free[block]
                self.held[block] = 1
            else:
                break
            count += 1
        stored = 0
        for block in blocks[count:]:
            if len(self.held) + len(self.free) >= self.capacity:
                if not self.free:
                    break
                self.removed.append(self.free.popitem(last=False)[0])
            self.held[block] = 1
            stored += 1
        return min(count, limit), count + stored

    def release(self, blocks: tuple[int, ...], count: int) -> None:
        for block in reversed(blocks[:count]):
            self.held[block] -= 1
            if not self.held[block]:
                del self.held[block]
                self.free[block] = None


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 8), operations)
def test_free_blocks_go_in_the_order_of_a_plain_lru(
    capacity: int, steps: list[tuple[bool, tuple[int, ...]]]
) -> None:
    events = _Removed()
    cache, model = PrefixCache(capacity, events), _ModelLRU(capacity)
    running: list[tuple[tuple[int, ...], int]] = []
    for start, blocks in steps:
        if start or not running:
            got = cache.acquire(blocks, len(blocks) - 1)
            assert got == model.acquire(blocks, len(blocks) - 1)
            running.append((blocks, got[1]))
        else:
            blocks, held = running.pop(0)
            cache.release(blocks, held)
            model.release(blocks, held)
        assert events.blocks == model.removed
        assert cache.evictions == len(model.removed)


class _Events:
    """Checks each event against the blocks cached so far: a block is stored once, while it is not
    cached, and removed once, while it is."""

    def __init__(self) -> None:
        self.cached: set[object] = set()
        self.removed_in_order: list[object] = []

    def stored(self, blocks: list[object], parent: object, scope: object = None) -> None:
        assert self.cached.isdisjoint(blocks) and len(set(blocks)) == len(blocks)
        self.cached.update(blocks)

    def removed(self, blocks: list[object]) -> None:
        assert set(blocks) <= self.cached and len(set(blocks)) == len(blocks)
        self.cached.difference_update(blocks)
        self.removed_in_order.extend(blocks)


# Ids as a sender may send them: repeats, and blocks under other parents than before
loose_ids = st.lists(st.integers(0, 5), min_size=0, max_size=7).map(tuple)
loose_steps = st.lists(st.tuples(st.integers(0, 2), loose_ids), min_size=1, max_size=60)


@settings(max_examples=400, deadline=None)
@given(st.integers(0, 8), loose_steps)
def test_ids_that_are_no_prefix_chain_leave_the_cache_whole(
    capacity: int, steps: list[tuple[int, tuple[int, ...]]]
) -> None:
    """Whatever the ids: what the events say is cached is what the cache holds, a block is held
    by exactly the running requests that took it, nothing held is evicted, and everything comes
    back free. (Before: a block cached after one that was not was stored a second time, counted
    twice in the cache's size, and evictable while held.)"""
    events = _Events()
    cache = PrefixCache(capacity, events)
    running: list[tuple[tuple[int, ...], int]] = []
    for action, blocks in steps:
        if action == 0 or not running:
            reused, held = cache.acquire(blocks, max(len(blocks) - 1, 0))
            assert 0 <= reused <= held <= len(blocks) and len(set(blocks[:held])) == held
            running.append((blocks, held))
        elif action == 1:
            blocks, held = running.pop(0)
            cache.release(blocks, held)
        else:
            cache.drop_free()
        holders: dict[int, int] = {}
        for taken, held in running:
            for block in taken[:held]:
                holders[block] = holders.get(block, 0) + 1
        assert all(cache.held(block) == count for block, count in holders.items())
        assert set(holders) <= events.cached
        assert len(cache) == len(events.cached) and all(block in cache for block in events.cached)
        assert capacity >= len(cache) and cache.held_blocks == len(holders)
    for blocks, held in running:
        cache.release(blocks, held)
    cached = len(events.cached)
    assert cache.held_blocks == 0 and cache.drop_free() == cached and not events.cached


def test_a_block_cached_after_one_that_is_not_is_not_stored_again() -> None:
    events = _Events()
    cache = PrefixCache(3, events)
    cache.release((6,), cache.acquire((6,), 0)[1])
    assert cache.acquire((5, 6), 1) == (0, 1)  # 6 is no block after 5 here: the request holds 5
    assert len(cache) == 2 and cache.held(6) == 0 and cache.held(5) == 1


steps_with_resets = st.lists(st.tuples(st.integers(0, 2), paths), min_size=1, max_size=60)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 8), steps_with_resets)
def test_a_reset_forgets_the_free_blocks_least_recently_freed_first(
    capacity: int, steps: list[tuple[int, tuple[int, ...]]]
) -> None:
    events = _Events()
    cache, model = PrefixCache(capacity, events), _ModelLRU(capacity)
    running: list[tuple[tuple[int, ...], int]] = []
    for action, blocks in steps:
        if action == 0 or not running:
            got = cache.acquire(blocks, len(blocks) - 1)
            assert got == model.acquire(blocks, len(blocks) - 1)
            running.append((blocks, got[1]))
        elif action == 1:
            blocks, held = running.pop(0)
            cache.release(blocks, held)
            model.release(blocks, held)
        else:
            assert cache.drop_free() == len(model.free)
            model.removed.extend(model.free)
            model.free.clear()
        assert events.removed_in_order == model.removed


def test_blocks_taken_again_and_again_leave_bounded_memory() -> None:
    """A free block taken again leaves a dead entry in the free order until eviction passes it;
    unbounded, eviction never does: the order is compacted instead (before, 200,000 hits of one
    prefix kept 1.6 million entries)."""
    cache = PrefixCache(None)
    prefix = tuple(range(8))
    tracemalloc.start()
    try:
        for _ in range(200_000):
            cache.release(prefix, cache.acquire(prefix, 8)[1])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    assert len(cache) == 8 and cache.held_blocks == 0


def test_a_cached_block_costs_at_most_block_bytes() -> None:
    """BLOCK_BYTES (the modelled caches' memory bound) against the cache filled to its capacity by
    16-block requests, at the peak (its dict and free order growing); the keys are the caller's."""
    from kvlens.simulate.cache import BLOCK_BYTES

    capacity = 100_000
    requests = [tuple(range(start, start + 16)) for start in range(10**12, 10**12 + 3 * capacity, 16)]
    tracemalloc.start()
    try:
        cache = PrefixCache(capacity)
        for blocks in requests:
            cache.release(blocks, cache.acquire(blocks, 15)[1])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(cache) == capacity
    assert 80 < peak / capacity <= BLOCK_BYTES
