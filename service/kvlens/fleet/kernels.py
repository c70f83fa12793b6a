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
from typing import Any, Final

import numpy as np
from numba import njit

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
# FILL: between rebuilds each entry costs 16 / 0.85 to 16 / 0.70 bytes (19 to 23).
MAX_LOAD: Final = 0.85
FILL: Final = 0.70
MIN_SLOTS: Final = 256

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
PARAMS = 10
# what store() and remove() answer besides their counts
GROW = -2  # a table needs room first (nothing was changed)
SHRINK_REPLICA, SHRINK_FLEET = 1, 2


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
def _find(table: Any, key: Any) -> tuple[int, bool]:
    """(row of ``key``, True), or (where to insert it, False)."""
    size = table.shape[0] - 3
    if key < PRESENT:
        spare = size + np.int64(key)
        return spare, table[spare, 0] == PRESENT
    pos = np.int64((((key * _GOLDEN) >> _S32) * np.uint64(size)) >> _S32)
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
    last = table.shape[0] - 1
    table[row, 0] = EMPTY if row >= last - 2 else TOMB
    table[row, 1] = 0
    table[last, 0] -= np.uint64(1)


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
def _rebuild(table: Any, slots: int) -> Any:
    new = np.zeros((slots + 3, 2), np.uint64)
    size = table.shape[0] - 3
    for i in range(size):
        key = table[i, 0]
        if key > TOMB:
            row, _ = _find(new, key)
            _insert(new, row, key, table[i, 1])
    for spare in range(2):
        if table[size + spare, 0] == PRESENT:
            _insert(new, slots + spare, np.uint64(spare), table[size + spare, 1])
    return new


def new_table(slots: int) -> np.ndarray[Any, np.dtype[np.uint64]]:
    return np.zeros((slots + 3, 2), np.uint64)


class Table:
    """One hash table (``rows``, what the kernels take), grown and shrunk here."""

    __slots__ = ("rows",)

    def __init__(self, slots: int = MIN_SLOTS) -> None:
        self.rows = new_table(slots)

    @property
    def live(self) -> int:
        return int(self.rows[-1, 0])

    @property
    def nbytes(self) -> int:
        return int(self.rows.nbytes)

    def reserve(self, inserts: int) -> None:
        """Room for ``inserts`` more keys under :data:`MAX_LOAD` (rebuilt at :data:`FILL`)."""
        if not _room(self.rows, inserts):
            self._rebuild(self.live + inserts)

    def shrink(self) -> None:
        """Give memory back once most entries are gone (a replica cleared, a cap lowered)."""
        if _sparse(self.rows):
            self._rebuild(self.live)

    def _rebuild(self, entries: int) -> None:
        slots = max(MIN_SLOTS, math.ceil(entries / FILL))
        self.rows = _rebuild(self.rows, slots)


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
def msgpack_ints(buf: Any) -> tuple[bool, Any]:
    """A msgpack array of integers (as ``token_ids`` arrive) as uint64, negative ones in two's
    complement: (True, the array), or (False, nothing) when ``buf`` is anything else."""
    nothing = np.empty(0, np.uint64)
    end = buf.size
    if end == 0:
        return False, nothing
    first = buf[0]
    if 0x90 <= first <= 0x9F:
        count = np.int64(first & 0x0F)
        pos = 1
    elif first == 0xDC and end >= 3:
        count = (np.int64(buf[1]) << 8) | np.int64(buf[2])
        pos = 3
    elif first == 0xDD and end >= 5:
        count = (
            (np.int64(buf[1]) << 24) | (np.int64(buf[2]) << 16) | (np.int64(buf[3]) << 8) | np.int64(buf[4])
        )
        pos = 5
    else:
        return False, nothing
    if count > end - pos:  # every integer takes a byte at least
        return False, nothing
    out = np.empty(count, np.uint64)
    for i in range(count):
        if pos >= end:
            return False, nothing
        tag = buf[pos]
        if tag <= 0x7F:
            out[i] = np.uint64(tag)
            pos += 1
            continue
        if tag >= 0xE0:  # negative fixint
            out[i] = np.uint64(np.int64(tag) - 256)
            pos += 1
            continue
        if 0xCC <= tag <= 0xCF:
            width = 1 << (tag - 0xCC)
            signed = False
        elif 0xD0 <= tag <= 0xD3:
            width = 1 << (tag - 0xD0)
            signed = True
        else:
            return False, nothing
        if pos + 1 + width > end:
            return False, nothing
        value = np.uint64(0)
        for k in range(width):
            value = (value << np.uint64(8)) | np.uint64(buf[pos + 1 + k])
        if signed and width < 8 and value >> np.uint64(8 * width - 1):
            value -= np.uint64(1) << np.uint64(8 * width)  # sign-extend, wrapping
        out[i] = value
        pos += 1 + width
    if pos != end:
        return False, nothing
    return True, out


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
    """One ``BlockStored`` into ``replica``'s table: classify each block and hold it (see
    :meth:`FleetIndex.stored`). Tokens come as msgpack bytes (``raw``, when not empty) or as
    ``tokens``; -1 (and nothing changed) when they are not ``block_size`` integers a block. Else
    the number of blocks the tier held already, marked in ``copies`` (the caller counts them);
    ``extras`` is empty or a digest a block."""
    count = hashes.size
    block_size = np.int64(params[P_BLOCK_SIZE])
    if raw.size:
        ok, tokens = msgpack_ints(raw)
        if not ok:
            return -1
    if block_size < 1 or tokens.size != count * block_size:
        return -1
    if not (_room(replica, count) and _room(fleet, count)):
        return GROW
    alike = params[P_ALIKE] != 0
    tier = np.int64(params[P_TIER])
    classify = tier == 0
    mine_row = stats[np.int64(params[P_REPLICA])]
    bit = np.uint64(1) << params[P_REPLICA]
    shards, shard = params[P_SHARDS], params[P_SHARD]
    whole = shards == np.uint64(1)
    room = np.int64(params[P_MAX_HELD]) - fleet_counts[HELD_ENTRIES]
    tier_bits = np.uint64(1) << (np.uint64(tier) + TIER_SHIFT)
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
    added = 0
    held = 0
    copied = 0
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
        copies[b] = 0
        if found and replica[row, 1] & tier_bits:
            copies[b] = 1
            copied += 1
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
    return copied


@njit(cache=True, nogil=True)
def remove(
    hashes: Any,
    params: Any,
    replica: Any,
    fleet: Any,
    remembered: Any,
    ring: Any,
    stats: Any,
    fleet_counts: Any,
) -> int:
    """One ``BlockRemoved`` (its blocks held as extra copies already taken off by the caller).
    :data:`GROW` (nothing changed) when the remembered table or ring needs room first; else
    :data:`SHRINK_REPLICA` and :data:`SHRINK_FLEET` set for the tables now mostly empty."""
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
        left = val & ~tier_bits
        if left >> TIER_SHIFT:
            replica[row, 1] = left  # still held in another tier: still a holder
            continue
        _delete(replica, row)
        if mine:
            _release(key, bit, cap, fleet, remembered, ring, fleet_counts)
    return (SHRINK_REPLICA if _sparse(replica) else 0) | (SHRINK_FLEET if _sparse(fleet) else 0)


@njit(cache=True, nogil=True)
def clear(
    params: Any, replica: Any, fleet: Any, remembered: Any, ring: Any, stats: Any, fleet_counts: Any
) -> None:
    """Every block of one replica removed (the caller drops the replica's table afterwards)."""
    alike = params[P_ALIKE] != 0
    mine_row = stats[np.int64(params[P_REPLICA])]
    bit = np.uint64(1) << params[P_REPLICA]
    shards, shard = params[P_SHARDS], params[P_SHARD]
    whole = shards == np.uint64(1)
    cap = np.int64(params[P_CAP])
    size = replica.shape[0] - 3
    for row in range(size + 2):
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
        for t in range(4):
            if held & (np.uint64(1) << np.uint64(t)):
                fleet_counts[HELD_ENTRIES] -= 1
                if mine:
                    mine_row[REMOVED + t] += 1
                    mine_row[HELD + t] -= 1
        if mine:
            _release(key, bit, cap, fleet, remembered, ring, fleet_counts)


@njit(cache=True, nogil=True)
def _drop_bit(table: Any, bit: Any, holders: bool, fleet_counts: Any) -> None:
    size = table.shape[0] - 3
    for row in range(size + 2):
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
    _drop_bit(fleet, bit, True, fleet_counts)
    _drop_bit(remembered, bit, False, fleet_counts)
    return _sparse(fleet)


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
    store(
        hashes,
        np.zeros(0, np.uint8),
        tokens,
        tokens,
        params,
        table,
        table,
        table,
        stats,
        counts,
        np.zeros(1, np.uint8),
    )
    remove(hashes, params, table, table, table, ring.keys, stats, counts)
    clear(params, table, table, table, ring.keys, stats, counts)
    forget(np.uint64(0), table, table, counts)
    lookup(table, hashes[0])
    msgpack_ints(np.zeros(1, np.uint8))
    _rebuild(table, MIN_SLOTS)
    _room(table, 1)
    _sparse(table)
    _warm = True
