"""The fleet index within its limits: every holding under ``max_held_blocks`` (extra copies of a
hash included), every array it holds in ``kvlens_kv_index_memory_bytes``, and its long passes
(a clear, a forgotten replica, a table rebuilt) done a slice at a time, a scrape waiting for the
index's lock let in between slices instead of after the whole pass."""

from __future__ import annotations

import math
import threading
import tracemalloc

import pytest

from kvlens.fleet.index import FleetIndex
from kvlens.fleet.kernels import table
from kvlens.fleet.limits import TIERS
from kvlens.fleet.ordering import Publisher
from kvlens.fleet.subscriber import KVEvents


def test_extra_copies_of_a_hash_are_held_within_the_cap_and_past_it_untracked() -> None:
    index = FleetIndex(max_held_blocks=100)
    hashes = list(range(60))
    index.stored("a", hashes, None, hashes, 1)
    index.stored("a", hashes, None, hashes, 1)  # the engine holds a second block of each hash
    snapshot = index.snapshot()
    assert (snapshot.held, snapshot.untracked_blocks) == ({("a", "GPU"): 100}, 20)
    index.removed("a", hashes)  # the 40 extra copies go first: those blocks stay held
    snapshot = index.snapshot()
    assert (snapshot.held, snapshot.removed, snapshot.distinct_blocks) == (
        {("a", "GPU"): 40},
        {("a", "GPU"): 60},
        40,
    )
    index.cleared("a")
    snapshot = index.snapshot()
    assert (snapshot.held, snapshot.removed, snapshot.distinct_blocks) == (
        {("a", "GPU"): 0},
        {("a", "GPU"): 100},
        0,
    )
    index.stored("a", hashes, None, hashes, 1)  # the cap's room is back
    assert sum(index.snapshot().held.values()) == 60


def test_hashes_stored_twice_in_every_tier_stay_under_the_cap() -> None:
    """The pattern that took blocks_held to 16M past a cap of 10M: held hashes stored again,
    twice in each tier, with no removal in between."""
    index = FleetIndex(max_held_blocks=1_000)
    hashes = list(range(200))
    for tier in TIERS:
        for _ in range(2):
            index.stored("a", hashes, None, hashes, 1, medium=tier)
    snapshot = index.snapshot()
    assert (sum(snapshot.held.values()), snapshot.untracked_blocks) == (1_000, 600)
    assert snapshot.held == {("a", "GPU"): 400, ("a", "CPU"): 400, ("a", "STORAGE"): 200, ("a", "other"): 0}


def test_every_array_the_index_holds_is_in_its_memory_gauge() -> None:
    """tracemalloc sees every numpy array: what the index grew by is what it says it holds, but
    for its few Python objects (the replica's record, dict entries)."""
    FleetIndex()  # the compiled loops loaded before measuring
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index = FleetIndex()
        for tier in TIERS:
            for _ in range(2):
                for first in range(0, 20_000, 500):
                    block = list(range(first, first + 500))
                    index.stored("a", block, None, block, 1, medium=tier)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown > 500_000  # tracemalloc saw the tables
    assert abs(grown - index.memory_bytes()) < 64 * 1024


@pytest.mark.timeout(120)
def test_a_scrape_waiting_during_a_clear_gets_the_lock_at_the_next_slice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The consumer clears a replica of 50,000 blocks under the index's lock, 1,024 rows a slice;
    a scrape (both of its takings of the lock) asks after the third slice and answers with the
    clear half done, not after it."""
    monkeypatch.setattr(table, "SLICE_ROWS", 1024, raising=False)
    index = FleetIndex()
    blocks = list(range(50_000))
    index.stored("a", blocks, None, blocks, 1)
    kv = KVEvents([Publisher("a", "tcp://a:1")], index, in_process=True)
    lock = index.lock
    handing_over = lock.pause
    slices = 0
    third = threading.Event()
    scrape_waits = threading.Event()

    def pause() -> None:
        nonlocal slices
        slices += 1
        if slices == 3:
            third.set()
            assert scrape_waits.wait(30)
            while not lock._waiting:  # the scrape's thread reaches the lock (microseconds)
                threading.Event().wait(0.001)
        handing_over()

    monkeypatch.setattr(lock, "pause", pause)

    def consume() -> None:
        with lock:
            index.cleared("a")

    consumer = threading.Thread(target=consume)
    consumer.start()
    assert third.wait(30), "the clear never paused"
    scrape_waits.set()
    snapshot = kv.snapshot()
    consumer.join(60)
    # taken two slices (of at most 1,024 blocks) after it asked, not after the clear
    assert 50_000 - 5 * 1024 < snapshot.index.held["a", "GPU"] < 50_000
    assert index.snapshot().held == {("a", "GPU"): 0}
    assert slices > math.ceil(50_000 / 1024)  # the rest of the clear went on, a slice at a time


def test_tables_rebuilt_and_replicas_forgotten_pause_between_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(table, "SLICE_ROWS", 1024, raising=False)
    index = FleetIndex()
    pauses: list[None] = []
    monkeypatch.setattr(index.lock, "pause", lambda: pauses.append(None))
    first, more = list(range(30_000)), list(range(30_000, 60_000))
    index.stored("a", first, None, first, 1)
    # the replica's table (with its depths, rebuilt fuller) and the fleet's: their own sizes
    slots = [index._replicas["a"].table.rows.shape[0] - 3, index._fleet.rows.shape[0] - 3]
    index.stored("a", more, None, more, 1)  # both tables rebuilt larger
    assert len(pauses) == sum(math.ceil(n / 1024) - 1 for n in slots)
    pauses.clear()
    rows = [index._replicas["a"].table.rows.shape[0], index._fleet.rows.shape[0]]
    index.forget_replica("a")  # its table cleared, its bit taken off the fleet's two tables
    rows.append(index._remembered.rows.shape[0])
    assert len(pauses) >= sum(math.ceil(n / 1024) for n in rows)
    assert index.snapshot().remembered_blocks == 60_000


def test_a_clear_grows_the_remembered_table_a_slice_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Remembered blocks full, a replica holding as many cleared: the remembered table never
    takes room for both at once (it holds ``remember_blocks`` at most), only for a slice more."""
    monkeypatch.setattr(table, "SLICE_ROWS", 1024, raising=False)
    index = FleetIndex(remember_blocks=20_000)
    for first in (0, 20_000):
        blocks = list(range(first, first + 20_000))
        index.stored("a", blocks, None, blocks, 1)
        index.cleared("a")
    snapshot = index.snapshot()
    assert (snapshot.remembered_blocks, snapshot.forgotten_blocks) == (20_000, 20_000)
    assert index._remembered.rows.shape[0] - 3 <= math.ceil((20_000 + 1024) / table.FILL)


def test_a_churning_table_is_rebuilt_at_its_own_size_when_tombstones_take_its_room(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A replica at its capacity (each store evicts as much): removals leave tombstones, and the
    rebuild that clears them keeps the table's size. Rebuilt at its fill instead (smaller: the
    table had doubled past it), it was rebuilt again after a few hundred removals, every slot
    moved each time (83 rebuilds in bench/kv_events.py's run, 63 of them at one size)."""
    rebuilds: list[tuple[int, int]] = []
    rebuild = table.Table._rebuild

    def counted(self: table.Table, slots: int, pause: table.Pause) -> None:
        if self.depths.size:  # a replica's table
            rebuilds.append((self.rows.shape[0] - 3, slots))
        rebuild(self, slots, pause)

    monkeypatch.setattr(table.Table, "_rebuild", counted)
    index = FleetIndex(hashes_alike=True)
    for first in range(0, 4_900, 50):
        blocks = list(range(first, first + 50))
        index.stored("a", blocks, None, blocks, 1)
    grown = index._replicas["a"].table.rows.shape[0] - 3
    assert grown == 8192  # doubled from 256 (below table.SMALL_SLOTS)
    del rebuilds[:]
    for first in range(4_900, 24_900, 50):  # 20,000 blocks through: the oldest 50 go, 50 come
        gone = list(range(first - 4_900, first - 4_850))
        index.removed("a", gone)
        blocks = list(range(first, first + 50))
        index.stored("a", blocks, None, blocks, 1)
    assert index.snapshot().held == {("a", "GPU"): 4_900}
    assert {size for pair in rebuilds for size in pair} == {grown}
    assert len(rebuilds) <= 20_000 // (int(table.MAX_LOAD * grown) - 4_900 - 50)


@pytest.mark.parametrize("alike", [False, True])
def test_a_hash_removed_again_in_one_event_finds_what_the_event_left(alike: bool) -> None:
    """A removal finds each hash's row once, ahead of its loop: a hash named again in the same
    event (the engine's copies of it, or one more than it holds) sees what the earlier ones
    left, the keys 0 and 1 (kept apart from the probed slots) too."""
    index = FleetIndex(hashes_alike=alike)
    for _ in range(2):  # each hash twice in the GPU (the second an extra copy), a chain each
        for block in (0, 1, 5):
            index.stored("a", [block], None, [block], 1)
    index.stored("a", [5], None, [5], 1, medium="CPU")
    # 0: its copy, its block, then nothing held (unknown); 1: its copy; 5: its copy, its GPU
    # block (still held in the CPU), then nothing held in the GPU (unknown)
    index.removed("a", [0, 0, 0, 1, 5, 5, 5])
    snapshot = index.snapshot()
    assert snapshot.held == {("a", "GPU"): 1, ("a", "CPU"): 1}
    assert snapshot.removed == {("a", "GPU"): 5}
    assert (snapshot.unknown_removed, snapshot.distinct_blocks, snapshot.remembered_blocks) == (2, 2, 1)
    index.stored("a", [0], None, [0], 1)  # held before, here: evicted_here
    assert index.recomputed[("a", "evicted_here")] == 1
