"""The fleet index's hash tables, compiled (numba; the ``kv-events`` extra).

Every table is an open-addressing hash table of 64-bit keys and 64-bit values in one numpy array
of rows ``[key, value]`` (16 bytes a slot), linear probing from a multiplicative hash, deleted
slots left as tombstones that inserts reuse. Keys 0 and 1 mark empty and deleted slots, so those
two keys live in two extra rows after the ``size`` probed ones (``[PRESENT, value]`` when held);
the last row is ``[live entries, used slots]`` (used: live or tombstone, in the probed part). The
caller keeps ``used`` under :data:`MAX_LOAD` of the slots (:class:`Table`), so a probe always
ends. A replica's table also keeps a block's depth in its chain, in a ``uint16`` array beside the
rows (``depths[row]``; :data:`DEPTH_UNKNOWN` when its chain's start was never seen): 2 bytes a
slot, where a third column would cost 8 (the held block's 48-byte budget has 2 to spare).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Final

import numpy as np
from numba import njit

from kvlens.fleet.kernels.cache import CACHE
from kvlens.fleet.kernels.stamp import BUILT_FROM

EMPTY: Final = np.uint64(0)
TOMB: Final = np.uint64(1)
PRESENT: Final = np.uint64(2)
TIER_SHIFT: Final = np.uint64(60)
MASK60: Final = np.uint64((1 << 60) - 1)
GOLDEN: Final = np.uint64(0x9E3779B97F4A7C15)
_C1: Final = np.uint64(0xFF51AFD7ED558CCD)
_C2: Final = np.uint64(0xC4CEB9FE1A85EC53)
_S33: Final = np.uint64(33)
_S32: Final = np.uint64(32)
# A table grows (or is rebuilt without its tombstones) when used slots would pass MAX_LOAD, to
# FILL: between rebuilds each entry costs 16 / 0.85 to 16 / 0.70 bytes (19 to 23). Below
# SMALL_SLOTS (256 KiB) a growing table at least doubles instead: a new replica's table or an
# empty index reaches a few thousand entries in a few rebuilds, not twenty (a rebuild reads
# every slot).
MAX_LOAD: Final = 0.85
FILL: Final = 0.70
MIN_SLOTS: Final = 256
SMALL_SLOTS: Final = 1 << 14
# The O(entries) passes (a rebuild, a clear, a forgotten replica's bit) go a slice of rows at a
# time, the caller's pause between slices (the index lets a waiting scrape take its lock): a slice
# is a few milliseconds (each row a cache miss or three on a large table), a whole 10M-entry
# table seconds.
SLICE_ROWS: Final = 1 << 15
# A block's depth (blocks before it in its chain) is kept as depth + 1, 0 meaning unknown (its
# chain's start never seen, or deeper than a uint16 holds: 65,534 blocks, a million tokens at
# vLLM's 16-token blocks)
DEPTH_UNKNOWN: Final = 0
MAX_DEPTH: Final = (1 << 16) - 2
# A table with depths is rebuilt a little fuller, so that its 18 bytes a slot and the fleet
# table's 16 stay within a held block's 48 bytes with the counters' share (18 / 0.77 + 16 / 0.70 = 46.2)
DEPTH_FILL: Final = 0.77
_PAGE_VALUES: Final = 4096 // 8  # a page of uint64
_FAULT_PAGES: Final = 2048  # pages mapped a slice (8 MiB, a few ms)


@njit(cache=CACHE, nogil=True)
def built_from() -> int:
    """The sources this file's loops were compiled from (:mod:`.stamp`)."""
    return BUILT_FROM


@njit(cache=CACHE, nogil=True)
def mix(h: Any) -> Any:
    """MurmurHash3's 64-bit finalizer: a bijection, every input bit reaches every output bit."""
    h ^= h >> _S33
    h *= _C1
    h ^= h >> _S33
    h *= _C2
    h ^= h >> _S33
    return h


@njit(cache=CACHE, nogil=True)
def _home(key: Any, size: int) -> Any:
    """The slot a key's probe starts at: Lemire's range reduction of a multiplicative hash."""
    return np.int64((((key * GOLDEN) >> _S32) * np.uint64(size)) >> _S32)


@njit(cache=CACHE, nogil=True)
def find_slot(table: Any, key: Any) -> tuple[int, bool]:
    """(row of ``key``, True), or (where to insert it, False)."""
    size = table.shape[0] - 3
    if key < PRESENT:
        spare = size + np.int64(key)
        return spare, table[spare, 0] == PRESENT
    pos = _home(key, size)
    tomb = -1
    while True:
        found = table[pos, 0]
        if found == key:
            return pos, True
        if found == EMPTY:
            return (tomb if tomb >= 0 else pos), False
        if found == TOMB and tomb < 0:
            tomb = pos
        pos += 1
        if pos == size:
            pos = 0


@njit(cache=CACHE, nogil=True)
def touch_home(table: Any, key: Any) -> Any:
    """The first slot ``key``'s probe reads (its value is nothing): the loops read these for
    every block of an event first, so that the cache misses of a large table overlap (independent
    loads) instead of each waiting alone in the loop that uses them."""
    return table[_home(key, table.shape[0] - 3), 0]


@njit(cache=CACHE, nogil=True)
def touch_home_depth(table: Any, depths: Any, key: Any) -> Any:
    """:func:`touch_home` and the depth beside that slot (a replica's table): its own line."""
    home = _home(key, table.shape[0] - 3)
    return table[home, 0] ^ depths[home]


@njit(cache=CACHE, nogil=True)
def insert_at(table: Any, row: int, key: Any, val: Any) -> None:
    last = table.shape[0] - 1
    if row >= last - 2:
        table[row, 0] = PRESENT
    else:
        if table[row, 0] == EMPTY:
            table[last, 1] += np.uint64(1)
        table[row, 0] = key
    table[row, 1] = val
    table[last, 0] += np.uint64(1)


@njit(cache=CACHE, nogil=True)
def delete_at(table: Any, row: int) -> None:
    """Leaves a tombstone (no key moves: shifting the keys after it back costs a scan of the
    rest of its run, several times a tombstone on a large table), except where the slot after it
    is empty: no probe passes an empty slot, so that slot and the tombstones just before it end
    no probe's path and are emptied (fewer rebuilds to clear tombstones)."""
    last = table.shape[0] - 1
    size = last - 2
    table[row, 1] = 0
    table[last, 0] -= np.uint64(1)
    if row >= size:
        table[row, 0] = EMPTY
        return
    if table[row + 1 if row + 1 < size else 0, 0] != EMPTY:
        table[row, 0] = TOMB
        return
    table[row, 0] = EMPTY
    table[last, 1] -= np.uint64(1)
    before = row - 1 if row > 0 else size - 1
    while table[before, 0] == TOMB:
        table[before, 0] = EMPTY
        table[last, 1] -= np.uint64(1)
        before = before - 1 if before > 0 else size - 1


@njit(cache=CACHE, nogil=True)
def has_room(table: Any, inserts: int) -> bool:
    """Whether ``inserts`` more keys keep the used slots under :data:`MAX_LOAD` (else the caller
    rebuilds the table first: :meth:`Table.reserve`, the same rule)."""
    last = table.shape[0] - 1
    return bool(np.int64(table[last, 1]) + inserts <= np.int64(MAX_LOAD * (last - 2)))


@njit(cache=CACHE, nogil=True)
def is_sparse(table: Any) -> bool:
    """Mostly empty: :meth:`Table.shrink` gives memory back (the same rule)."""
    last = table.shape[0] - 1
    limit = np.int64(MAX_LOAD * (last - 2))
    return bool(limit > MIN_SLOTS * MAX_LOAD and np.int64(table[last, 0]) < limit // 4)


@njit(cache=CACHE, nogil=True)
def lookup(table: Any, key: Any) -> tuple[bool, Any]:
    row, found = find_slot(table, key)
    return found, table[row, 1] if found else np.uint64(0)


@njit(cache=CACHE, nogil=True)
def rebuild_rows(table: Any, new: Any, depths: Any, new_depths: Any, start: int, stop: int) -> None:
    """The live keys of rows ``start`` to ``stop`` of ``table`` into ``new`` (a table as large as
    it must be, counters included), in the old table's slot order, each at the first empty slot
    from its home: what :func:`find_slot` answers in a table without tombstones for a key not in it
    (each key is there once). The two spare rows come with the last slice. ``depths`` (empty for
    a table without them) move with their rows into ``new_depths``."""
    size = table.shape[0] - 3
    slots = new.shape[0] - 3
    last = slots + 2
    moving = depths.size != 0
    moved = np.uint64(0)  # added to the counters once: a row's += would wait on the previous one's
    for i in range(start, min(stop, size)):
        key = table[i, 0]
        if key > TOMB:
            pos = _home(key, slots)
            while new[pos, 0] != EMPTY:
                pos += 1
                if pos == slots:
                    pos = 0
            new[pos, 0] = key
            new[pos, 1] = table[i, 1]
            if moving:
                new_depths[pos] = depths[i]
            moved += np.uint64(1)
    new[last, 0] += moved
    new[last, 1] += moved
    if stop >= size:
        for spare in range(2):
            if table[size + spare, 0] == PRESENT:
                new[slots + spare, 0] = PRESENT
                new[slots + spare, 1] = table[size + spare, 1]
                if moving:
                    new_depths[slots + spare] = depths[size + spare]
                new[last, 0] += np.uint64(1)


def new_table(slots: int) -> np.ndarray[Any, np.dtype[np.uint64]]:
    return np.zeros((slots + 3, 2), np.uint64)


Pause = Callable[[], None]


def _no_pause() -> None:
    pass


_NO_DEPTHS: Final = np.zeros(0, np.uint16)


class Table:
    """One hash table (``rows``, what the kernels take), grown and shrunk here; ``pause`` is
    called between the slices of a rebuild. While one is under way, the new table (``building``)
    is counted in :attr:`nbytes` beside the old: both are held. ``depths``: a depth a slot
    (a replica's table), else an empty array."""

    __slots__ = ("building", "building_depths", "depths", "fill", "rows")

    def __init__(self, slots: int = MIN_SLOTS, *, depths: bool = False) -> None:
        self.rows = new_table(slots)
        self.depths = np.zeros(slots + 3, np.uint16) if depths else _NO_DEPTHS
        self.fill = DEPTH_FILL if depths else FILL
        self.building: Any = None
        self.building_depths: Any = None

    @property
    def live(self) -> int:
        return int(self.rows[-1, 0])

    @property
    def nbytes(self) -> int:
        total = int(self.rows.nbytes) + int(self.depths.nbytes)
        for building in (self.building, self.building_depths):
            total += 0 if building is None else int(building.nbytes)
        return total

    def reserve(self, inserts: int, pause: Pause = _no_pause) -> None:
        """Room for ``inserts`` more keys under :data:`MAX_LOAD`: rebuilt at :attr:`fill`, or at
        least doubled when it grows below :data:`SMALL_SLOTS`; at the same size when tombstones
        took the room (never smaller: a churning table sized at its fill would be rebuilt again
        after a few removals' tombstones, every slot moved each time; memory is given back by
        :meth:`shrink` once it is mostly empty, as for any table past its most held)."""
        if not has_room(self.rows, inserts):
            slots, need = self.rows.shape[0] - 3, _slots(self.live + inserts, self.fill)
            self._rebuild(max(need, min(2 * slots, SMALL_SLOTS)) if need > slots else slots, pause)

    def shrink(self, pause: Pause = _no_pause) -> None:
        """Give memory back once most entries are gone (a replica cleared, a cap lowered)."""
        if is_sparse(self.rows):
            self._rebuild(_slots(self.live, self.fill), pause)

    def _rebuild(self, slots: int, pause: Pause) -> None:
        self.building = new_table(slots)
        new_depths = np.zeros(slots + 3, np.uint16) if self.depths.size else _NO_DEPTHS
        self.building_depths = new_depths
        try:
            # the kernel maps a new array's pages at their first write: 229 MB of table is 56k
            # page faults, which the first slices would take in one go (hundreds of ms), so a
            # write a page first, a slice at a time
            flat, step = self.building.reshape(-1), _FAULT_PAGES * _PAGE_VALUES
            for start in range(0, flat.size, step):
                if start:
                    pause()
                flat[start : start + step : _PAGE_VALUES] = 0
            size = self.rows.shape[0] - 3
            for start in range(0, max(size, 1), SLICE_ROWS):
                if start:
                    pause()
                rebuild_rows(self.rows, self.building, self.depths, new_depths, start, start + SLICE_ROWS)
            self.rows, self.depths = self.building, new_depths
        finally:
            self.building = self.building_depths = None


def _slots(entries: int, fill: float = FILL) -> int:
    return max(MIN_SLOTS, math.ceil(entries / fill))


class Ring:
    """The remembered blocks' keys, oldest first: ``keys[0]`` is the head, ``keys[1]`` the count,
    the ring after them; grown to ``cap``."""

    __slots__ = ("cap", "keys")

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.keys = np.zeros(2 + min(cap, MIN_SLOTS), np.uint64)

    def reserve(self, appends: int) -> None:
        head, count = int(self.keys[0]), int(self.keys[1])
        size = self.keys.size - 2
        need = min(self.cap, count + appends)
        if need <= size:
            return
        ring = self.keys[2:]
        # by a quarter: the ring's slack is part of a remembered block's cost
        grown = np.zeros(2 + min(self.cap, max(need, size + size // 4)), np.uint64)
        grown[2 : 2 + count] = np.concatenate((ring[head:], ring[:head]))[:count]
        grown[1] = count
        self.keys = grown
