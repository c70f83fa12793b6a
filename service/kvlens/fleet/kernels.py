"""The fleet index's inner loops, compiled (numba; the ``kv-events`` extra).

Every table is an open-addressing hash table of 64-bit keys and 64-bit values in one numpy array
of rows ``[key, value]`` (16 bytes a slot), linear probing from a multiplicative hash, deleted
slots left as tombstones that inserts reuse. Keys 0 and 1 mark empty and deleted slots, so those
two keys live in two extra rows after the ``size`` probed ones (``[PRESENT, value]`` when held);
the last row is ``[live entries, used slots]`` (used: live or tombstone, in the probed part). The
caller keeps ``used`` under :data:`MAX_LOAD` of the slots (:class:`Table`), so a probe always
ends. One array a table, and the counters in arrays the loops add to, because a compiled call
costs about 0.3 microseconds an argument.

Why compiled: the memory goal (48 bytes a held block) needs the tables in arrays, not dicts of
Python ints (about 100 bytes an entry); walked from Python, an array costs more per element than
a dict, and numpy vectorised per event pays its call overhead a dozen times a table for vLLM's
one-to-forty-block events. A compiled loop keeps the rules sequential, so exact (a block stored
twice in one event, a removal then a store in one batch), at the cost of the table look-ups
themselves (cache misses on a large table) and a fixed cost a call (numba's argument checks).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Final

import numpy as np
from numba import njit

from kvlens.fleet.limits import MAX_BLOCK_SIZE, MEDIUM_TIERS, OTHER_TIER

EMPTY: Final = np.uint64(0)
TOMB: Final = np.uint64(1)
PRESENT: Final = np.uint64(2)
TIER_SHIFT: Final = np.uint64(60)
MASK60: Final = np.uint64((1 << 60) - 1)
_GOLDEN: Final = np.uint64(0x9E3779B97F4A7C15)
_C1: Final = np.uint64(0xFF51AFD7ED558CCD)
_C2: Final = np.uint64(0xC4CEB9FE1A85EC53)
_TOKEN: Final = np.uint64(0x100000001B3)  # FNV-1a's 64-bit prime
_SEED: Final = np.uint64(0xCBF29CE484222325)
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

# A replica's row of counters (``stats[replica]``): blocks per cause (kvlens.fleet.index.CAUSES's
# order), tokens per cause, then per tier (GPU, CPU, STORAGE, other) blocks stored, removed, held.
C_NEW, C_EVICTED_HERE, C_HELD_ELSEWHERE, C_EVICTED_ELSEWHERE, C_HELD_HERE, C_UNKNOWN = range(6)
TOKENS, STORED, REMOVED, HELD = 6, 12, 16, 20
STATS = 24
# The fleet's counters (``fleet_counts``)
HELD_ENTRIES, DUPLICATED, UNTRACKED, UNKNOWN_REMOVED, FORGOTTEN = range(5)
FLEET_COUNTS = 5
# store()'s parameters (``params``, uint64)
P_BLOCK_SIZE, P_PARENT, P_HAS_PARENT, P_ALIKE, P_TIER, P_REPLICA, P_SHARDS, P_SHARD, P_MAX_HELD, P_CAP = (
    range(10)
)
P_TOUCHED = 10  # where _touch's loads go (so that the compiler keeps them)
PARAMS = 11
# what store() and remove() answer besides their counts
GROW = -2  # a table needs room first (nothing was changed)
GROW_COPIES = -3  # the replica's table of extra copies needs room first (nothing was changed)
SHRINK_REPLICA, SHRINK_FLEET, SHRINK_COPIES = 1, 2, 4
# A replica's extra copies (an engine may hold two blocks of one hash in one tier: each is stored,
# and removed, on its own): engine hash -> a 16-bit count a tier (TIERS' order), in their own
# table, kept within the held cap like any holding; a count past COPY_MAX is not kept (untracked).
COPY_BITS: Final = 16
COPY_MAX: Final = (1 << COPY_BITS) - 1
# The O(entries) passes (a rebuild, a clear, a forgotten replica's bit) go a slice of rows at a
# time, the caller's pause between slices (the index lets a waiting scrape take its lock): a slice
# is a few milliseconds (each row a cache miss or three on a large table), a whole 10M-entry
# table seconds.
SLICE_ROWS: Final = 1 << 15
_PAGE_VALUES: Final = 4096 // 8  # a page of uint64
_FAULT_PAGES: Final = 2048  # pages mapped a slice (8 MiB, a few ms)


@njit(cache=True, nogil=True)
def _mix(h: Any) -> Any:
    """MurmurHash3's 64-bit finalizer: a bijection, every input bit reaches every output bit."""
    h ^= h >> _S33
    h *= _C1
    h ^= h >> _S33
    h *= _C2
    h ^= h >> _S33
    return h


@njit(cache=True, nogil=True)
def _home(key: Any, size: int) -> Any:
    """The slot a key's probe starts at: Lemire's range reduction of a multiplicative hash."""
    return np.int64((((key * _GOLDEN) >> _S32) * np.uint64(size)) >> _S32)


@njit(cache=True, nogil=True)
def _find(table: Any, key: Any) -> tuple[int, bool]:
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


@njit(cache=True, nogil=True)
def _touch(table: Any, key: Any) -> Any:
    """The first slot ``key``'s probe reads (its value is nothing): the loops read these for
    every block of an event first, so that the cache misses of a large table overlap (independent
    loads) instead of each waiting alone in the loop that uses them."""
    return table[_home(key, table.shape[0] - 3), 0]


@njit(cache=True, nogil=True)
def _insert(table: Any, row: int, key: Any, val: Any) -> None:
    last = table.shape[0] - 1
    if row >= last - 2:
        table[row, 0] = PRESENT
    else:
        if table[row, 0] == EMPTY:
            table[last, 1] += np.uint64(1)
        table[row, 0] = key
    table[row, 1] = val
    table[last, 0] += np.uint64(1)


@njit(cache=True, nogil=True)
def _delete(table: Any, row: int) -> None:
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


@njit(cache=True, nogil=True)
def _room(table: Any, inserts: int) -> bool:
    """Whether ``inserts`` more keys keep the used slots under :data:`MAX_LOAD` (else the caller
    rebuilds the table first: :meth:`Table.reserve`, the same rule)."""
    last = table.shape[0] - 1
    return bool(np.int64(table[last, 1]) + inserts <= np.int64(MAX_LOAD * (last - 2)))


@njit(cache=True, nogil=True)
def _sparse(table: Any) -> bool:
    """Mostly empty: :meth:`Table.shrink` gives memory back (the same rule)."""
    last = table.shape[0] - 1
    limit = np.int64(MAX_LOAD * (last - 2))
    return bool(limit > MIN_SLOTS * MAX_LOAD and np.int64(table[last, 0]) < limit // 4)


@njit(cache=True, nogil=True)
def lookup(table: Any, key: Any) -> tuple[bool, Any]:
    row, found = _find(table, key)
    return found, table[row, 1] if found else np.uint64(0)


@njit(cache=True, nogil=True)
def _rebuild_rows(table: Any, new: Any, start: int, stop: int) -> None:
    """The live keys of rows ``start`` to ``stop`` of ``table`` into ``new`` (a table as large as
    it must be, counters included), in the old table's slot order, each at the first empty slot
    from its home: what :func:`_find` answers in a table without tombstones for a key not in it
    (each key is there once). The two spare rows come with the last slice."""
    size = table.shape[0] - 3
    slots = new.shape[0] - 3
    last = slots + 2
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
            new[last, 0] += np.uint64(1)
            new[last, 1] += np.uint64(1)
    if stop >= size:
        for spare in range(2):
            if table[size + spare, 0] == PRESENT:
                new[slots + spare, 0] = PRESENT
                new[slots + spare, 1] = table[size + spare, 1]
                new[last, 0] += np.uint64(1)


def new_table(slots: int) -> np.ndarray[Any, np.dtype[np.uint64]]:
    return np.zeros((slots + 3, 2), np.uint64)


Pause = Callable[[], None]


def _no_pause() -> None:
    pass


class Table:
    """One hash table (``rows``, what the kernels take), grown and shrunk here; ``pause`` is
    called between the slices of a rebuild. While one is under way, the new table (``building``)
    is counted in :attr:`nbytes` beside the old: both are held."""

    __slots__ = ("building", "rows")

    def __init__(self, slots: int = MIN_SLOTS) -> None:
        self.rows = new_table(slots)
        self.building: Any = None

    @property
    def live(self) -> int:
        return int(self.rows[-1, 0])

    @property
    def nbytes(self) -> int:
        building = self.building
        return int(self.rows.nbytes) + (0 if building is None else int(building.nbytes))

    def reserve(self, inserts: int, pause: Pause = _no_pause) -> None:
        """Room for ``inserts`` more keys under :data:`MAX_LOAD`: rebuilt at :data:`FILL` (the
        same size when tombstones took the room), or at least doubled when it grows below
        :data:`SMALL_SLOTS`."""
        if not _room(self.rows, inserts):
            slots, need = self.rows.shape[0] - 3, _slots(self.live + inserts)
            self._rebuild(max(need, min(2 * slots, SMALL_SLOTS)) if need > slots else need, pause)

    def shrink(self, pause: Pause = _no_pause) -> None:
        """Give memory back once most entries are gone (a replica cleared, a cap lowered)."""
        if _sparse(self.rows):
            self._rebuild(_slots(self.live), pause)

    def _rebuild(self, slots: int, pause: Pause) -> None:
        self.building = new_table(slots)
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
                _rebuild_rows(self.rows, self.building, start, start + SLICE_ROWS)
            self.rows = self.building
        finally:
            self.building = None


def _slots(entries: int) -> int:
    return max(MIN_SLOTS, math.ceil(entries / FILL))


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


@njit(cache=True, nogil=True)
def content_keys(tokens: Any, block_size: int, parent: Any, extras: Any, out: Any) -> None:
    """Each block's content key, chained from its parent's: 60 bits (the top 4 of a replica
    table's value say which tiers hold the block). Tokens are hashed FNV-1a-like a token at a time,
    then mixed with the block's extra keys digest and the parent's key."""
    key = parent
    for i in range(out.size):
        h = _SEED
        base = i * block_size
        for j in range(block_size):
            h = (h ^ tokens[base + j]) * _TOKEN
        h = _mix(h ^ extras[i])
        key = _mix(key * _GOLDEN + h) & MASK60
        out[i] = key


@njit(cache=True, nogil=True)
def _array_head(buf: Any, pos: int, end: int) -> tuple[int, int]:
    """(element count, position after the head) of a msgpack array at ``pos``; count -1 when
    there is none (another type, or cut short)."""
    if pos >= end:
        return -1, pos
    first = buf[pos]
    if 0x90 <= first <= 0x9F:
        return np.int64(first & 0x0F), pos + 1
    if first == 0xDC and pos + 3 <= end:
        return (np.int64(buf[pos + 1]) << 8) | np.int64(buf[pos + 2]), pos + 3
    if first == 0xDD and pos + 5 <= end:
        count = (
            (np.int64(buf[pos + 1]) << 24)
            | (np.int64(buf[pos + 2]) << 16)
            | (np.int64(buf[pos + 3]) << 8)
            | np.int64(buf[pos + 4])
        )
        return count, pos + 5
    return -1, pos


@njit(cache=True, nogil=True)
def _read_int(buf: Any, pos: int, end: int) -> tuple[int, Any, int]:
    """A msgpack integer at ``pos``: (1 when >= 0, 2 when negative, 0 when no integer), its
    value as uint64 (two's complement), the position after it."""
    if pos >= end:
        return 0, np.uint64(0), pos
    tag = buf[pos]
    if tag <= 0x7F:
        return 1, np.uint64(tag), pos + 1
    if tag >= 0xE0:  # negative fixint
        return 2, np.uint64(np.int64(tag) - 256), pos + 1
    if 0xCC <= tag <= 0xCF:
        width = 1 << (tag - 0xCC)
        signed = False
    elif 0xD0 <= tag <= 0xD3:
        width = 1 << (tag - 0xD0)
        signed = True
    else:
        return 0, np.uint64(0), pos
    if pos + 1 + width > end:
        return 0, np.uint64(0), pos
    value = np.uint64(0)
    for k in range(width):
        value = (value << np.uint64(8)) | np.uint64(buf[pos + 1 + k])
    negative = signed and value >> np.uint64(8 * width - 1) != 0
    if negative and width < 8:
        value -= np.uint64(1) << np.uint64(8 * width)  # sign-extend, wrapping
    return 2 if negative else 1, value, pos + 1 + width


@njit(cache=True, nogil=True)
def _read_ints(buf: Any, pos: int, end: int, out: Any, at: int) -> tuple[int, int]:
    """A msgpack array of integers at ``pos`` into ``out[at:]`` (room checked by the caller: an
    integer takes a byte at least): (how many, the position after), how many -1 when it is
    anything else."""
    count, pos = _array_head(buf, pos, end)
    if count < 0 or count > end - pos:
        return -1, pos
    for i in range(count):
        # the usual forms first (token ids: fixint, uint16, uint32; vLLM's hashes: uint64),
        # each a few instructions; the rest through _read_int
        tag = buf[pos] if pos < end else 0xC1
        if tag <= 0x7F:
            out[at + i] = tag
            pos += 1
            continue
        if tag == 0xCD and pos + 3 <= end:
            out[at + i] = (np.uint64(buf[pos + 1]) << np.uint64(8)) | np.uint64(buf[pos + 2])
            pos += 3
            continue
        if tag == 0xCE and pos + 5 <= end:
            value = np.uint64(0)
            for k in range(1, 5):
                value = (value << np.uint64(8)) | np.uint64(buf[pos + k])
            out[at + i] = value
            pos += 5
            continue
        if tag == 0xCF and pos + 9 <= end:
            value = np.uint64(0)
            for k in range(1, 9):
                value = (value << np.uint64(8)) | np.uint64(buf[pos + k])
            out[at + i] = value
            pos += 9
            continue
        kind, value, pos = _read_int(buf, pos, end)
        if kind == 0:
            return -1, pos
        out[at + i] = value
    return count, pos


@njit(cache=True, nogil=True)
def msgpack_ints(buf: Any) -> tuple[bool, Any]:
    """A msgpack array of integers (as ``token_ids`` arrive) as uint64, negative ones in two's
    complement: (True, the array), or (False, nothing) when ``buf`` is anything else."""
    out = np.empty(buf.size, np.uint64)
    count, pos = _read_ints(buf, 0, buf.size, out, 0)
    if count < 0 or pos != buf.size:
        return False, np.empty(0, np.uint64)
    return True, out[:count]


@njit(cache=True, nogil=True)
def _remember(key: Any, bit: Any, cap: int, remembered: Any, ring: Any, fleet_counts: Any) -> None:
    row, found = _find(remembered, key)
    if found:
        remembered[row, 1] |= bit
        return
    if cap == 0:
        fleet_counts[FORGOTTEN] += 1
        return
    size = ring.size - 2
    head, count = np.int64(ring[0]), np.int64(ring[1])
    if count == cap:  # the oldest goes first: the same state as adding, then forgetting
        old, _ = _find(remembered, ring[2 + head])
        _delete(remembered, old)
        head = (head + 1) % size
        count -= 1
        fleet_counts[FORGOTTEN] += 1
        row, _ = _find(remembered, key)
    ring[2 + (head + count) % size] = key
    ring[0] = head
    ring[1] = count + 1
    _insert(remembered, row, key, bit)


@njit(cache=True, nogil=True)
def _release(key: Any, bit: Any, cap: int, fleet: Any, remembered: Any, ring: Any, fleet_counts: Any) -> None:
    """The replica no longer holds ``key`` in any tier: off its holders, remembered."""
    row, found = _find(fleet, key)
    mask = fleet[row, 1] if found else np.uint64(0)
    if mask & bit:
        mask &= ~bit
        if mask:
            fleet[row, 1] = mask
            fleet_counts[DUPLICATED] -= 1
        else:
            _delete(fleet, row)
    _remember(key, bit, cap, remembered, ring, fleet_counts)


@njit(cache=True, nogil=True)
def store(
    hashes: Any,
    raw: Any,
    tokens: Any,
    extras: Any,
    params: Any,
    replica: Any,
    fleet: Any,
    remembered: Any,
    stats: Any,
    fleet_counts: Any,
    copies: Any,
) -> int:
    """One ``BlockStored`` into ``replica``'s table (and ``copies``, its extra copies): classify
    each block and hold it (see :meth:`FleetIndex.stored`). Tokens come as msgpack bytes
    (``raw``, when not empty) or as ``tokens``; -1 (and nothing changed) when they are not
    ``block_size`` integers a block, :data:`GROW` or :data:`GROW_COPIES` (nothing changed) when
    a table needs room first, else 0; ``extras`` is empty or a digest a block."""
    if raw.size:
        ok, tokens = msgpack_ints(raw)
        if not ok:
            return -1
    return _store(hashes, tokens, extras, params, replica, fleet, remembered, stats, fleet_counts, copies)


@njit(cache=True, nogil=True)
def _store(
    hashes: Any,
    tokens: Any,
    extras: Any,
    params: Any,
    replica: Any,
    fleet: Any,
    remembered: Any,
    stats: Any,
    fleet_counts: Any,
    copies: Any,
) -> int:
    count = hashes.size
    block_size = np.int64(params[P_BLOCK_SIZE])
    if block_size < 1 or tokens.size != count * block_size:
        return -1
    if not (_room(replica, count) and _room(fleet, count)):
        return GROW
    alike = params[P_ALIKE] != 0
    tier = np.int64(params[P_TIER])
    tier_bits = np.uint64(1) << (np.uint64(tier) + TIER_SHIFT)
    if not _room(copies, count):  # rare (a small table, a large event): room if copies come
        repeats = 0
        for b in range(count):
            row, found = _find(replica, hashes[b])
            if found and replica[row, 1] & tier_bits:
                repeats += 1
        if repeats and not _room(copies, repeats):
            return GROW_COPIES
    copy_shift = np.uint64(COPY_BITS * tier)
    classify = tier == 0
    mine_row = stats[np.int64(params[P_REPLICA])]
    bit = np.uint64(1) << params[P_REPLICA]
    shards, shard = params[P_SHARDS], params[P_SHARD]
    whole = shards == np.uint64(1)
    room = np.int64(params[P_MAX_HELD]) - fleet_counts[HELD_ENTRIES]
    chained = True
    if alike:
        keys = hashes
    else:
        parent = np.uint64(0)
        if params[P_HAS_PARENT]:
            row, chained = _find(replica, params[P_PARENT])
            if chained:
                parent = replica[row, 1] & MASK60
        keys = np.empty(count, np.uint64)
        content_keys(tokens, block_size, parent, extras if extras.size else np.zeros(count, np.uint64), keys)
    touched = np.uint64(0)
    for b in range(count):
        touched ^= _touch(replica, hashes[b]) ^ _touch(fleet, keys[b]) ^ _touch(remembered, keys[b])
    params[P_TOUCHED] = touched
    added = 0
    held = 0
    stored = 0
    for b in range(count):
        engine_hash = hashes[b]
        key = keys[b]
        mine = whole or key % shards == shard
        mask = np.uint64(0)
        fleet_row = -1
        fleet_found = False
        if mine:
            fleet_row, fleet_found = _find(fleet, key)
            if fleet_found:
                mask = fleet[fleet_row, 1]
            stored += 1
            if classify:
                if not chained:
                    cause = C_UNKNOWN
                elif mask & bit:
                    cause = C_HELD_HERE
                elif mask:
                    cause = C_HELD_ELSEWHERE
                else:
                    row, found = _find(remembered, key)
                    before = remembered[row, 1] if found else np.uint64(0)
                    # found with no bits: held before by replicas since forgotten (forget())
                    cause = C_NEW if not found else C_EVICTED_HERE if before & bit else C_EVICTED_ELSEWHERE
                mine_row[cause] += 1
                mine_row[TOKENS + cause] += block_size
        row, found = _find(replica, engine_hash)
        if found and replica[row, 1] & tier_bits:  # an extra copy: held, within the cap
            if added >= room:
                fleet_counts[UNTRACKED] += 1
                continue
            copy_row, copy_found = _find(copies, engine_hash)
            counts = copies[copy_row, 1] if copy_found else np.uint64(0)
            if (counts >> copy_shift) & np.uint64(COPY_MAX) == np.uint64(COPY_MAX) or not (
                copy_found or _room(copies, 1)  # the same hash again in this event: rare
            ):
                fleet_counts[UNTRACKED] += 1
                continue
            if copy_found:
                copies[copy_row, 1] = counts + (np.uint64(1) << copy_shift)
            else:
                _insert(copies, copy_row, engine_hash, np.uint64(1) << copy_shift)
            added += 1
            if mine:
                held += 1
            continue
        if not mine and alike:
            continue  # nothing chains from it: out of this shard, it is not kept at all
        if added >= room:
            fleet_counts[UNTRACKED] += 1
            continue
        if found:
            replica[row, 1] |= tier_bits
        else:
            _insert(replica, row, engine_hash, (np.uint64(0) if alike else key) | tier_bits)
        added += 1
        if mine:
            held += 1
            if not mask & bit:
                if mask:
                    fleet_counts[DUPLICATED] += 1
                if fleet_found:
                    fleet[fleet_row, 1] = mask | bit
                else:
                    _insert(fleet, fleet_row, key, bit)
    fleet_counts[HELD_ENTRIES] += added
    mine_row[STORED + tier] += stored
    mine_row[HELD + tier] += held
    return 0


@njit(cache=True, nogil=True)
def remove(
    hashes: Any,
    params: Any,
    replica: Any,
    copies: Any,
    fleet: Any,
    remembered: Any,
    ring: Any,
    stats: Any,
    fleet_counts: Any,
) -> int:
    """One ``BlockRemoved``: an extra copy of a block goes first (the block stays held).
    :data:`GROW` (nothing changed) when the remembered table or ring needs room first; else
    :data:`SHRINK_REPLICA`, :data:`SHRINK_FLEET` and :data:`SHRINK_COPIES` set for the tables
    now mostly empty."""
    return _remove(hashes, params, replica, copies, fleet, remembered, ring, stats, fleet_counts)


@njit(cache=True, nogil=True)
def _remove(
    hashes: Any,
    params: Any,
    replica: Any,
    copies: Any,
    fleet: Any,
    remembered: Any,
    ring: Any,
    stats: Any,
    fleet_counts: Any,
) -> int:
    cap = np.int64(params[P_CAP])
    if not (_room(remembered, hashes.size) and ring.size - 2 >= min(cap, np.int64(ring[1]) + hashes.size)):
        return GROW
    alike = params[P_ALIKE] != 0
    tier = np.int64(params[P_TIER])
    mine_row = stats[np.int64(params[P_REPLICA])]
    bit = np.uint64(1) << params[P_REPLICA]
    shards, shard = params[P_SHARDS], params[P_SHARD]
    whole = shards == np.uint64(1)
    tier_bits = np.uint64(1) << (np.uint64(tier) + TIER_SHIFT)
    copy_shift = np.uint64(COPY_BITS * tier)
    touched = np.uint64(0)
    for b in range(hashes.size):
        touched ^= _touch(replica, hashes[b])
    for b in range(hashes.size):  # then the fleet's lines of the blocks held
        row, found = _find(replica, hashes[b])
        if found:
            key = hashes[b] if alike else replica[row, 1] & MASK60
            touched ^= _touch(fleet, key) ^ _touch(remembered, key)
    params[P_TOUCHED] = touched
    for b in range(hashes.size):
        engine_hash = hashes[b]
        row, found = _find(replica, engine_hash)
        if not found or not replica[row, 1] & tier_bits:
            # its store was missed (or not kept); without hashes alike its shard is unknown, so
            # shard 0 counts it
            if (whole or engine_hash % shards == shard) if alike else shard == np.uint64(0):
                fleet_counts[UNKNOWN_REMOVED] += 1
            continue
        val = replica[row, 1]
        key = engine_hash if alike else val & MASK60
        fleet_counts[HELD_ENTRIES] -= 1
        mine = whole or key % shards == shard
        if mine:
            mine_row[REMOVED + tier] += 1
            mine_row[HELD + tier] -= 1
        if copies[-1, 0]:  # some extra copies: one of this block in this tier goes first
            copy_row, copy_found = _find(copies, engine_hash)
            counts = copies[copy_row, 1] if copy_found else np.uint64(0)
            if (counts >> copy_shift) & np.uint64(COPY_MAX):
                counts -= np.uint64(1) << copy_shift
                if counts:
                    copies[copy_row, 1] = counts
                else:
                    _delete(copies, copy_row)
                continue
        left = val & ~tier_bits
        if left >> TIER_SHIFT:
            replica[row, 1] = left  # still held in another tier: still a holder
            continue
        _delete(replica, row)
        if mine:
            _release(key, bit, cap, fleet, remembered, ring, fleet_counts)
    return (
        (SHRINK_REPLICA if _sparse(replica) else 0)
        | (SHRINK_FLEET if _sparse(fleet) else 0)
        | (SHRINK_COPIES if _sparse(copies) else 0)
    )


@njit(cache=True, nogil=True)
def clear(
    params: Any,
    replica: Any,
    copies: Any,
    start: int,
    stop: int,
    fleet: Any,
    remembered: Any,
    ring: Any,
    stats: Any,
    fleet_counts: Any,
) -> None:
    """The blocks in rows ``start`` to ``stop`` of one replica's table (its two spare rows
    after the ``size`` probed ones), with their extra copies, removed: the caller goes through
    the table a slice at a time (the remembered table and ring given room for a slice's blocks
    first), then drops both tables, which this leaves as they were."""
    alike = params[P_ALIKE] != 0
    mine_row = stats[np.int64(params[P_REPLICA])]
    bit = np.uint64(1) << params[P_REPLICA]
    shards, shard = params[P_SHARDS], params[P_SHARD]
    whole = shards == np.uint64(1)
    cap = np.int64(params[P_CAP])
    size = replica.shape[0] - 3
    some_copies = copies[-1, 0] != 0
    for row in range(start, min(stop, size + 2)):
        stored_key = replica[row, 0]
        if row < size:
            if stored_key <= TOMB:
                continue
            engine_hash = stored_key
        else:
            if stored_key != PRESENT:
                continue
            engine_hash = np.uint64(row - size)
        val = replica[row, 1]
        key = engine_hash if alike else val & MASK60
        mine = whole or key % shards == shard
        held = val >> TIER_SHIFT
        counts = np.uint64(0)
        if some_copies:
            copy_row, copy_found = _find(copies, engine_hash)
            if copy_found:
                counts = copies[copy_row, 1]
        for t in range(4):
            if held & (np.uint64(1) << np.uint64(t)):
                entries = 1 + np.int64((counts >> np.uint64(COPY_BITS * t)) & np.uint64(COPY_MAX))
                fleet_counts[HELD_ENTRIES] -= entries
                if mine:
                    mine_row[REMOVED + t] += entries
                    mine_row[HELD + t] -= entries
        if mine:
            _release(key, bit, cap, fleet, remembered, ring, fleet_counts)


@njit(cache=True, nogil=True)
def drop_bit(table: Any, bit: Any, holders: bool, fleet_counts: Any, start: int, stop: int) -> None:
    """``bit`` off the entries in rows ``start`` to ``stop`` (see :func:`forget`); ``holders``:
    the fleet's table (an entry left with no bit goes; a remembered one stays)."""
    size = table.shape[0] - 3
    for row in range(start, min(stop, size + 2)):
        key = table[row, 0]
        if (key <= TOMB) if row < size else (key != PRESENT):
            continue
        mask = table[row, 1]
        if not mask & bit:
            continue
        mask &= ~bit
        if mask or not holders:
            table[row, 1] = mask
            if holders:
                fleet_counts[DUPLICATED] -= 1
        else:
            _delete(table, row)


@njit(cache=True, nogil=True)
def forget(number: Any, fleet: Any, remembered: Any, fleet_counts: Any) -> bool:
    """Replica ``number``'s bit off every entry of both fleet tables, in one pass each, so that a
    replica given the slot next inherits nothing. A block it was the last holder of leaves the
    fleet table (none is left once its blocks are cleared); a remembered block keeps its entry,
    with no bits when the replica was its only remover: still remembered as held before, by some
    replica (a later store is ``evicted_elsewhere``, not ``new``). True when the fleet table is
    now mostly empty (the caller shrinks it)."""
    bit = np.uint64(1) << np.uint64(number)
    drop_bit(fleet, bit, True, fleet_counts, 0, fleet.shape[0])
    drop_bit(remembered, bit, False, fleet_counts, 0, remembered.shape[0])
    return _sparse(fleet)


# --- a whole EventBatch read in place (read_batch), then applied in one call (apply_events) -----
# What kvlens.fleet.wire.decode_batch and wire.apply decide, for the usual payloads only: any
# payload this reader is not sure of (another msgpack type where one is expected, bytes hashes,
# lora_name or extra keys, a text that is not ASCII, an unknown field or event type, a field
# twice, the tag not first) is left to them (read_batch answers False), so that the two paths
# count alike; a test holds them equal on random batches.
E_TYPE, E_OUTCOME, E_TIER, E_BLOCK_SIZE, E_HAS_PARENT = range(5)
E_HASHES, E_HASHES_END, E_TOKENS, E_TOKENS_END = range(5, 9)  # its slices of hashes and tokens
E_EXTRA, E_GROUP = 9, 10  # the extra keys given (-1: none), a KV cache group past the first
EVENT_FIELDS = 11
STORED_EVENT, REMOVED_EVENT, CLEARED_EVENT = range(3)  # E_TYPE
APPLY, MALFORMED_EVENT, OTHER_GROUP_EVENT = range(3)  # E_OUTCOME
# apply_events' tally: events of each type, then events malformed and of other groups
TALLY = 5
T_MALFORMED, T_OTHER_GROUP = 3, 4
# why apply_events stopped: done, or the caller's turn (tables to grow or shrink, an event it
# applies itself) before calling again from the position it answered
DONE, STOP_GROW, STOP_SHRINK, STOP_CALLER, UNREAD = range(5)

# The reader's arrays are as large as the payload (an integer takes a byte at least): a larger
# payload is left to msgspec (a vLLM step's batch is well under it; source.MAX_MESSAGE_BYTES is 64)
MAX_READ_BYTES: Final = 1 << 20
_MIN_EVENT_BYTES = 13  # the shortest event read: ["BlockStored", ...] (fixarray, fixstr tag)
EVENT_TYPES: Final = ("BlockStored", "BlockRemoved", "AllBlocksCleared")
# BlockStored's fields in vLLM's order (the first eight are also SGLang's array order), then the tag
STORED_FIELDS: Final = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
    "cache_salt",
)
REMOVED_FIELDS: Final = ("block_hashes", "medium", "group_idx", "locality", "ownership")
(
    F_HASHES,
    F_PARENT,
    F_TOKENS,
    F_SIZE,
    F_LORA_ID,
    F_MEDIUM,
    F_LORA_NAME,
    F_EXTRA,
    F_GROUP,
    F_SPEC_KIND,
    F_WINDOW,
    F_LOCALITY,
    F_OWNERSHIP,
    F_SESSION,
    F_LOOKAHEAD,
    F_CACHE_SALT,
) = range(16)
_STORED_REQUIRED = (1 << F_HASHES) | (1 << F_PARENT) | (1 << F_TOKENS) | (1 << F_SIZE)
_REMOVED_ALLOWED = sum(1 << STORED_FIELDS.index(name) for name in REMOVED_FIELDS)


def _strings(names: tuple[str, ...]) -> tuple[Any, Any]:
    """Names as one byte array and their end offsets (constants in the compiled loops)."""
    encoded = [name.encode() for name in names]
    ends = np.cumsum([len(name) for name in encoded]).astype(np.int64)
    return np.frombuffer(b"".join(encoded), np.uint8).copy(), ends


_FIELD_BYTES, _FIELD_ENDS = _strings(STORED_FIELDS)
_TYPE_BYTES, _TYPE_ENDS = _strings(EVENT_TYPES)
_MEDIUM_BYTES, _MEDIUM_ENDS = _strings(tuple(MEDIUM_TIERS))
_MEDIUM_TIER = np.array(list(MEDIUM_TIERS.values()), np.int64)  # a name's tier; not named: OTHER_TIER
_TAG_BYTES, _TAG_ENDS = _strings(("type",))


@njit(cache=True, nogil=True)
def _read_str(buf: Any, pos: int, end: int) -> tuple[int, int, int]:
    """(start, length, position after) of a msgpack str at ``pos``; start -1 when none."""
    if pos >= end:
        return -1, 0, pos
    tag = buf[pos]
    if 0xA0 <= tag <= 0xBF:
        length, start = np.int64(tag & 0x1F), pos + 1
    elif tag == 0xD9 and pos + 2 <= end:
        length, start = np.int64(buf[pos + 1]), pos + 2
    elif tag == 0xDA and pos + 3 <= end:
        length, start = (np.int64(buf[pos + 1]) << 8) | np.int64(buf[pos + 2]), pos + 3
    elif tag == 0xDB and pos + 5 <= end:
        length = (
            (np.int64(buf[pos + 1]) << 24)
            | (np.int64(buf[pos + 2]) << 16)
            | (np.int64(buf[pos + 3]) << 8)
            | np.int64(buf[pos + 4])
        )
        start = pos + 5
    else:
        return -1, 0, pos
    if start + length > end:
        return -1, 0, pos
    return start, length, start + length


@njit(cache=True, nogil=True)
def _name(buf: Any, start: int, length: int, names: Any, ends: Any) -> int:
    """Which of ``names`` the bytes are, or -1."""
    begin = 0
    for i in range(ends.size):
        if ends[i] - begin == length:
            same = True
            for j in range(length):
                if buf[start + j] != names[begin + j]:
                    same = False
                    break
            if same:
                return i
        begin = ends[i]
    return -1


@njit(cache=True, nogil=True)
def _ascii(buf: Any, start: int, length: int) -> bool:
    """ASCII is valid UTF-8 (msgspec checks str): other texts are left to msgspec."""
    for j in range(length):  # noqa: SIM110 - a loop numba compiles, not a generator
        if buf[start + j] >= 0x80:
            return False
    return True


@njit(cache=True, nogil=True)
def _text_or_nil(buf: Any, pos: int, end: int) -> tuple[int, int]:
    """A ``str | None`` field: (-2 for nil, -1 when unsure, else its tier: index.MEDIUM_TIERS's,
    OTHER_TIER for another text), the position after."""
    if pos < end and buf[pos] == 0xC0:
        return -2, pos + 1
    start, length, after = _read_str(buf, pos, end)
    if start < 0 or not _ascii(buf, start, length):
        return -1, pos
    found = _name(buf, start, length, _MEDIUM_BYTES, _MEDIUM_ENDS)
    return (OTHER_TIER if found < 0 else _MEDIUM_TIER[found]), after


@njit(cache=True, nogil=True)
def _int_or_nil(buf: Any, pos: int, end: int) -> tuple[int, Any, int]:
    """An ``int | None`` field: (0 none read, 1 >= 0, 2 negative, 3 nil), value, position after."""
    if pos < end and buf[pos] == 0xC0:
        return 3, np.uint64(0), pos + 1
    return _read_int(buf, pos, end)


@njit(cache=True, nogil=True)
def _field(
    field: int,
    buf: Any,
    pos: int,
    end: int,
    row: Any,
    parents: Any,
    e: int,
    hashes: Any,
    tokens: Any,
    nh: int,
    nt: int,
) -> tuple[bool, int, int, int]:
    """One field's value into the event's row: (read, position after, hashes used, tokens used)."""
    if field == F_HASHES:
        count, pos = _read_ints(buf, pos, end, hashes, nh)
        if count < 0:
            return False, pos, nh, nt
        row[E_HASHES], row[E_HASHES_END] = nh, nh + count
        return True, pos, nh + count, nt
    if field == F_TOKENS:
        count, pos = _read_ints(buf, pos, end, tokens, nt)
        if count < 0:
            return False, pos, nh, nt
        row[E_TOKENS], row[E_TOKENS_END] = nt, nt + count
        return True, pos, nh, nt + count
    if field == F_LOOKAHEAD:  # read to check it, not kept (written where tokens go next)
        if pos < end and buf[pos] == 0xC0:
            return True, pos + 1, nh, nt
        count, pos = _read_ints(buf, pos, end, tokens, nt)
        return count >= 0, pos, nh, nt
    if field == F_PARENT or field == F_SIZE or field == F_LORA_ID or field == F_GROUP or field == F_WINDOW:  # noqa: SIM109
        kind, value, pos = _int_or_nil(buf, pos, end)
        if kind == 0 or (kind == 3 and field == F_SIZE):
            return False, pos, nh, nt
        if field == F_PARENT:
            row[E_HAS_PARENT] = kind != 3
            parents[e] = value
        elif field == F_SIZE:  # out of range: 0, a malformed event
            in_range = kind == 1 and value >= np.uint64(1) and value <= np.uint64(MAX_BLOCK_SIZE)
            row[E_BLOCK_SIZE] = np.int64(value) if in_range else 0
        elif field == F_GROUP:
            row[E_GROUP] = kind != 3 and value != np.uint64(0)
        return True, pos, nh, nt
    if field == F_EXTRA:  # nil, or no extra key for any block (a digest of 0, as none)
        if pos < end and buf[pos] == 0xC0:
            return True, pos + 1, nh, nt
        count, pos = _array_head(buf, pos, end)
        if count < 0 or count > end - pos:
            return False, pos, nh, nt
        for _ in range(count):
            if buf[pos] != 0xC0:
                return False, pos, nh, nt
            pos += 1
        row[E_EXTRA] = count
        return True, pos, nh, nt
    if field == F_LORA_NAME or field == F_CACHE_SALT:  # noqa: SIM109 (as above: numba) a name or salt: msgspec's path
        if pos < end and buf[pos] == 0xC0:
            return True, pos + 1, nh, nt
        return False, pos, nh, nt
    tier, pos = _text_or_nil(buf, pos, end)  # medium and the other texts
    if tier == -1:
        return False, pos, nh, nt
    if field == F_MEDIUM:
        row[E_TIER] = 0 if tier == -2 else tier
    return True, pos, nh, nt


@njit(cache=True, nogil=True)
def _event(
    buf: Any, pos: int, end: int, row: Any, parents: Any, e: int, hashes: Any, tokens: Any, nh: int, nt: int
) -> tuple[bool, int, int, int]:
    """One event, a map (vLLM) or an array (SGLang, vLLM up to 0.10), into ``row``."""
    row[E_EXTRA] = -1
    if pos >= end:
        return False, pos, nh, nt
    first = buf[pos]
    as_map = 0x80 <= first <= 0x8F or first == 0xDE
    if as_map:
        if first == 0xDE:
            if pos + 3 > end:
                return False, pos, nh, nt
            fields, pos = (np.int64(buf[pos + 1]) << 8) | np.int64(buf[pos + 2]), pos + 3
        else:
            fields, pos = np.int64(first & 0x0F), pos + 1
        start, length, pos = _read_str(buf, pos, end)
        if fields < 1 or start < 0 or _name(buf, start, length, _TAG_BYTES, _TAG_ENDS) != 0:
            return False, pos, nh, nt
        fields -= 1
    else:
        fields, pos = _array_head(buf, pos, end)
        if fields < 1:
            return False, pos, nh, nt
        fields -= 1
    start, length, pos = _read_str(buf, pos, end)
    kind = -1 if start < 0 else _name(buf, start, length, _TYPE_BYTES, _TYPE_ENDS)
    if kind < 0:
        return False, pos, nh, nt
    row[E_TYPE] = kind
    if not as_map:  # positional: BlockStored's first eight fields, BlockRemoved's hashes and medium
        most = 8 if kind == STORED_EVENT else 2 if kind == REMOVED_EVENT else 0
        least = 4 if kind == STORED_EVENT else 1 if kind == REMOVED_EVENT else 0
        if not least <= fields <= most:
            return False, pos, nh, nt
    seen = 0
    for i in range(fields):
        if as_map:
            start, length, pos = _read_str(buf, pos, end)
            field = -1 if start < 0 else _name(buf, start, length, _FIELD_BYTES, _FIELD_ENDS)
        else:
            field = i if kind == STORED_EVENT else F_HASHES if i == 0 else F_MEDIUM
        if field < 0 or seen >> field & 1:
            return False, pos, nh, nt
        if kind == CLEARED_EVENT or (kind == REMOVED_EVENT and not _REMOVED_ALLOWED >> field & 1):
            return False, pos, nh, nt
        seen |= 1 << field
        ok, pos, nh, nt = _field(field, buf, pos, end, row, parents, e, hashes, tokens, nh, nt)
        if not ok:
            return False, pos, nh, nt
    if kind == STORED_EVENT and seen & _STORED_REQUIRED != _STORED_REQUIRED:
        return False, pos, nh, nt
    if kind == REMOVED_EVENT and not seen & 1:
        return False, pos, nh, nt
    # wire.apply's order: another group first, then what makes a BlockStored malformed
    if row[E_GROUP]:
        row[E_OUTCOME] = OTHER_GROUP_EVENT
    elif kind == STORED_EVENT and (
        row[E_BLOCK_SIZE] == 0 or (row[E_EXTRA] >= 0 and row[E_EXTRA] != row[E_HASHES_END] - row[E_HASHES])
    ):
        row[E_OUTCOME] = MALFORMED_EVENT
    return True, pos, nh, nt


@njit(cache=True, nogil=True)
def read_batch(buf: Any) -> tuple[bool, Any, Any, Any, Any]:
    """An ``EventBatch`` payload ``[ts, events(, data_parallel_rank)]``: (True, a row a event
    (``E_*``), each BlockStored's parent hash, every event's block hashes, every BlockStored's
    token ids), or (False, ...) for anything it is not sure of (then msgspec reads it). ``buf``:
    the payload's bytes (or an array of them)."""
    end = len(buf)
    events = np.zeros((0, EVENT_FIELDS), np.int64)
    parents = np.zeros(0, np.uint64)
    hashes = np.zeros(0, np.uint64)
    tokens = np.zeros(0, np.uint64)
    count, pos = _array_head(buf, 0, end)
    if (count != 2 and count != 3) or pos >= end or end > MAX_READ_BYTES:
        return False, events, parents, hashes, tokens
    if buf[pos] == 0xCB:  # ts: float64 (vLLM) or float32
        pos += 9
    elif buf[pos] == 0xCA:
        pos += 5
    else:
        return False, events, parents, hashes, tokens
    n, pos = _array_head(buf, pos, end)
    if n < 0 or n * _MIN_EVENT_BYTES > end - pos:  # a row an event: not more than can be read
        return False, events, parents, hashes, tokens
    events = np.zeros((n, EVENT_FIELDS), np.int64)
    parents = np.zeros(n, np.uint64)
    hashes = np.empty(end, np.uint64)  # an integer takes a byte at least
    tokens = np.empty(end, np.uint64)
    nh = nt = 0
    for e in range(n):
        ok, pos, nh, nt = _event(buf, pos, end, events[e], parents, e, hashes, tokens, nh, nt)
        if not ok:
            return False, events, parents, hashes, tokens
    if count == 3:
        kind, _, pos = _int_or_nil(buf, pos, end)
        if kind == 0:
            return False, events, parents, hashes, tokens
    if pos != end:
        return False, events, parents, hashes, tokens
    return True, events, parents, hashes[:nh], tokens[:nt]


@njit(cache=True, nogil=True)
def _apply_events(
    start: int,
    events: Any,
    parents: Any,
    hashes: Any,
    tokens: Any,
    params: Any,
    replica: Any,
    copies: Any,
    fleet: Any,
    remembered: Any,
    ring: Any,
    stats: Any,
    fleet_counts: Any,
    tally: Any,
) -> tuple[int, int, int]:
    """The events :func:`read_batch` read, from ``start``, as :func:`store` and :func:`remove` one
    by one would (see :func:`apply_payload`)."""
    no_extras = np.zeros(0, np.uint64)
    n = events.shape[0]
    for e in range(start, n):
        row = events[e]
        if row[E_OUTCOME] != APPLY:
            continue
        params[P_TIER] = row[E_TIER]
        kind = row[E_TYPE]
        if kind == STORED_EVENT:
            params[P_BLOCK_SIZE] = row[E_BLOCK_SIZE]
            params[P_HAS_PARENT] = row[E_HAS_PARENT]
            params[P_PARENT] = parents[e]
            done = _store(
                hashes[row[E_HASHES] : row[E_HASHES_END]],
                tokens[row[E_TOKENS] : row[E_TOKENS_END]],
                no_extras,
                params,
                replica,
                fleet,
                remembered,
                stats,
                fleet_counts,
                copies,
            )
            if done == GROW or done == GROW_COPIES:  # noqa: SIM109 - a tuple's `in`: not in numba
                return e, STOP_GROW, done
            if done < 0:  # the token ids do not fill its blocks (counted now: a call after a
                tally[T_MALFORMED] += 1  # stop reads the payload anew)
        elif kind == REMOVED_EVENT:
            done = _remove(
                hashes[row[E_HASHES] : row[E_HASHES_END]],
                params,
                replica,
                copies,
                fleet,
                remembered,
                ring,
                stats,
                fleet_counts,
            )
            if done == GROW:
                return e, STOP_GROW, GROW
            if done:
                return e + 1, STOP_SHRINK, done
        else:
            return e, STOP_CALLER, 0
    for e in range(n):
        outcome = events[e, E_OUTCOME]
        tally[events[e, E_TYPE]] += 1
        if outcome == MALFORMED_EVENT:
            tally[T_MALFORMED] += 1
        elif outcome == OTHER_GROUP_EVENT:
            tally[T_OTHER_GROUP] += 1
    return n, DONE, 0


@njit(cache=True, nogil=True)
def apply_payload(
    buf: Any,
    start: int,
    params: Any,
    replica: Any,
    copies: Any,
    fleet: Any,
    remembered: Any,
    ring: Any,
    stats: Any,
    fleet_counts: Any,
) -> tuple[int, int, int, int, int, int, int, int]:
    """A payload's events, from event ``start``, into ``replica``'s table (``params``' replica):
    read (:func:`read_batch`, :data:`UNREAD` when it is not sure of the payload: nothing changed),
    then applied as :func:`store` and :func:`remove` one by one would. Answers (position, why it
    stopped, a value, then the tally: events of each type, malformed, of other groups). Done:
    (events, :data:`DONE`, 0, tally). Else it is the caller's turn, then call again from the
    position: :data:`STOP_GROW` (grow the tables for the event at the position: the value is
    :data:`GROW` or :data:`GROW_COPIES`, as :func:`store` answers), :data:`STOP_SHRINK` (the
    event before it left tables mostly empty: the value's flags), :data:`STOP_CALLER` (the
    caller applies the event at the position: an ``AllBlocksCleared``)."""
    ok, events, parents, hashes, tokens = read_batch(buf)
    if not ok:
        return 0, UNREAD, 0, 0, 0, 0, 0, 0
    tally = np.zeros(TALLY, np.int64)
    position, stop, value = _apply_events(  # the tally: events malformed in this call, all at DONE
        start,
        events,
        parents,
        hashes,
        tokens,
        params,
        replica,
        copies,
        fleet,
        remembered,
        ring,
        stats,
        fleet_counts,
        tally,
    )
    return position, stop, value, tally[0], tally[1], tally[2], tally[3], tally[4]


_warm = False


def warm() -> None:
    """Compile (or load from numba's cache) every loop now, once a process: at startup rather
    than on the first event, and before any memory is measured."""
    global _warm
    if _warm:
        return
    table, ring = new_table(MIN_SLOTS), Ring(1)
    stats, counts = np.zeros((1, STATS), np.int64), np.zeros(FLEET_COUNTS, np.int64)
    params = np.zeros(PARAMS, np.uint64)
    params[P_SHARDS], params[P_BLOCK_SIZE], params[P_MAX_HELD] = 1, 1, 1
    hashes, tokens = np.ones(1, np.uint64), np.ones(1, np.uint64)
    raw = np.frombuffer(b"\x91\x01", np.uint8)  # token ids left as msgpack: a read-only array
    store(hashes, raw, tokens, tokens, params, table, table, table, stats, counts, table)
    store(hashes, np.zeros(0, np.uint8), tokens, tokens, params, table, table, table, stats, counts, table)
    remove(hashes, params, table, table, table, table, ring.keys, stats, counts)
    clear(params, table, table, 0, SLICE_ROWS, table, table, ring.keys, stats, counts)
    forget(np.uint64(0), table, table, counts)
    drop_bit(table, np.uint64(1), True, counts, 0, SLICE_ROWS)
    lookup(table, hashes[0])
    payload = b"\x92\xcb" + bytes(8) + b"\x91\x81\xa4type\xb0AllBlocksCleared"
    read_batch(payload)
    apply_payload(payload, 0, params, table, table, table, table, ring.keys, stats, counts)
    msgpack_ints(np.zeros(1, np.uint8))
    _rebuild_rows(table, new_table(MIN_SLOTS), 0, SLICE_ROWS)
    _room(table, 1)
    _sparse(table)
    _warm = True
