"""The fleet index's inner loops, compiled (numba; the ``kv-events`` extra).

Every table is an open-addressing hash table of 64-bit keys and 64-bit values in two numpy
arrays (16 bytes a slot), linear probing from a multiplicative hash, deleted slots left as
tombstones that inserts reuse. Keys 0 and 1 mark empty and deleted slots, so those two keys live
in two extra slots at the end (``keys[size + key]`` is ``PRESENT`` when held). ``counts`` is
``[live entries, used slots]`` (used: live or tombstone, in the probed part); the caller keeps
``used`` under :data:`MAX_LOAD` of the slots (:class:`Table`), so a probe always ends.

Why compiled: per block the index does a few table look-ups; as Python bytecode that costs
about a microsecond a block (the parse alone, msgspec's, is 0.4), and numpy per event pays its
call overhead a dozen times for vLLM's one-to-forty-block events. A loop compiled once costs tens
of nanoseconds a block, and the tables hold 16 bytes a slot instead of about 100 bytes a dict
entry with its int objects.
"""

from __future__ import annotations

import math
from typing import Any, Final

import numpy as np
from numba import njit  # type: ignore[import-untyped]

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

# The cause indices of store()'s counts: kvlens.fleet.index.CAUSES is in this order.
C_NEW, C_EVICTED_HERE, C_HELD_ELSEWHERE, C_EVICTED_ELSEWHERE, C_HELD_HERE, C_UNKNOWN = range(6)
# store()'s other counts
O_STORED, O_HELD, O_ADDED, O_DUPLICATED, O_UNTRACKED, O_COPIES = range(6, 12)
# remove() / clear() counts
R_DROPPED, R_MINE, R_UNKNOWN, R_UNDUPLICATED, R_FORGOTTEN = range(5)


@njit(cache=True, nogil=True)  # type: ignore[misc]
def _mix(h: Any) -> Any:
    """MurmurHash3's 64-bit finalizer: a bijection, every input bit reaches every output bit."""
    h ^= h >> _S33
    h *= _C1
    h ^= h >> _S33
    h *= _C2
    h ^= h >> _S33
    return h


@njit(cache=True, nogil=True)  # type: ignore[misc]
def _find(keys: Any, key: Any) -> tuple[int, bool]:
    """(slot of ``key``, True), or (where to insert it, False)."""
    size = keys.size - 2
    if key < PRESENT:
        spare = size + np.int64(key)
        return spare, keys[spare] == PRESENT
    home = np.int64((((key * _GOLDEN) >> _S32) * np.uint64(size)) >> _S32)
    pos = home
    tomb = -1
    while True:
        found = keys[pos]
        if found == key:
            return pos, True
        if found == EMPTY:
            return (tomb if tomb >= 0 else pos), False
        if found == TOMB and tomb < 0:
            tomb = pos
        pos += 1
        if pos == size:
            pos = 0


@njit(cache=True, nogil=True)  # type: ignore[misc]
def _insert(keys: Any, vals: Any, counts: Any, slot: int, key: Any, val: Any) -> None:
    if slot >= keys.size - 2:
        keys[slot] = PRESENT
    else:
        if keys[slot] == EMPTY:
            counts[1] += 1
        keys[slot] = key
    vals[slot] = val
    counts[0] += 1


@njit(cache=True, nogil=True)  # type: ignore[misc]
def _delete(keys: Any, vals: Any, counts: Any, slot: int) -> None:
    keys[slot] = EMPTY if slot >= keys.size - 2 else TOMB
    vals[slot] = 0
    counts[0] -= 1


@njit(cache=True, nogil=True)  # type: ignore[misc]
def lookup(keys: Any, vals: Any, key: Any) -> tuple[bool, Any]:
    slot, found = _find(keys, key)
    return found, vals[slot] if found else np.uint64(0)


@njit(cache=True, nogil=True)  # type: ignore[misc]
def _rebuild(keys: Any, vals: Any, slots: int) -> tuple[Any, Any, Any]:
    new_keys = np.zeros(slots + 2, np.uint64)
    new_vals = np.zeros(slots + 2, np.uint64)
    counts = np.zeros(2, np.int64)
    size = keys.size - 2
    for i in range(size):
        key = keys[i]
        if key > TOMB:
            slot, _ = _find(new_keys, key)
            _insert(new_keys, new_vals, counts, slot, key, vals[i])
    for spare in range(2):
        if keys[size + spare] == PRESENT:
            new_keys[slots + spare] = PRESENT
            new_vals[slots + spare] = vals[size + spare]
            counts[0] += 1
    return new_keys, new_vals, counts


class Table:
    """One hash table: ``keys``, ``vals``, ``counts`` (the arrays the kernels take)."""

    __slots__ = ("keys", "vals", "counts")

    def __init__(self, slots: int = MIN_SLOTS) -> None:
        self.keys = np.zeros(slots + 2, np.uint64)
        self.vals = np.zeros(slots + 2, np.uint64)
        self.counts = np.zeros(2, np.int64)

    @property
    def live(self) -> int:
        return int(self.counts[0])

    @property
    def nbytes(self) -> int:
        return int(self.keys.nbytes + self.vals.nbytes + self.counts.nbytes)

    def reserve(self, inserts: int) -> None:
        """Room for ``inserts`` more keys under :data:`MAX_LOAD` (rebuilt at :data:`FILL`)."""
        slots = self.keys.size - 2
        if self.counts[1] + inserts > MAX_LOAD * slots:
            self._rebuild(self.live + inserts)

    def shrink(self) -> None:
        """Give memory back once most entries are gone (a replica cleared, a cap lowered)."""
        slots = self.keys.size - 2
        if slots > MIN_SLOTS and self.counts[0] < 0.2 * slots:
            self._rebuild(self.live)

    def _rebuild(self, entries: int) -> None:
        slots = max(MIN_SLOTS, math.ceil(entries / FILL))
        self.keys, self.vals, self.counts = _rebuild(self.keys, self.vals, slots)


class Ring:
    """The remembered blocks' keys, oldest first (``meta`` = [head, count]); grown to ``cap``."""

    __slots__ = ("cap", "keys", "meta")

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.keys = np.zeros(min(cap, MIN_SLOTS), np.uint64)
        self.meta = np.zeros(2, np.int64)

    def reserve(self, appends: int) -> None:
        head, count = int(self.meta[0]), int(self.meta[1])
        need = min(self.cap, count + appends)
        if need <= self.keys.size:
            return
        grown = np.zeros(min(self.cap, max(need, 2 * self.keys.size)), np.uint64)
        ordered = np.concatenate((self.keys[head:], self.keys[:head]))[:count]
        grown[:count] = ordered
        self.keys = grown
        self.meta[0] = 0


@njit(cache=True, nogil=True)  # type: ignore[misc]
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


@njit(cache=True, nogil=True)  # type: ignore[misc]
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
        count = (np.int64(buf[1]) << 24) | (np.int64(buf[2]) << 16) | (np.int64(buf[3]) << 8) | np.int64(buf[4])
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


@njit(cache=True, nogil=True)  # type: ignore[misc]
def _remember(
    key: Any, bit: Any, cap: int, mk: Any, mv: Any, mc: Any, ring: Any, meta: Any, out: Any
) -> None:
    slot, found = _find(mk, key)
    if found:
        mv[slot] |= bit
        return
    if cap == 0:
        out[R_FORGOTTEN] += 1
        return
    head, count = meta[0], meta[1]
    if count == cap:  # the oldest goes first: the same state as adding, then forgetting
        old, _ = _find(mk, ring[head])
        _delete(mk, mv, mc, old)
        head = (head + 1) % ring.size
        count -= 1
        out[R_FORGOTTEN] += 1
        slot, _ = _find(mk, key)
    ring[(head + count) % ring.size] = key
    meta[0] = head
    meta[1] = count + 1
    _insert(mk, mv, mc, slot, key, bit)


@njit(cache=True, nogil=True)  # type: ignore[misc]
def _release(
    key: Any, bit: Any, cap: int, fk: Any, fv: Any, fc: Any, mk: Any, mv: Any, mc: Any, ring: Any, meta: Any, out: Any
) -> None:
    """The replica no longer holds ``key`` in any tier: off its holders, remembered."""
    slot, found = _find(fk, key)
    mask = fv[slot] if found else np.uint64(0)
    if mask & bit:
        mask &= ~bit
        if mask:
            fv[slot] = mask
            out[R_UNDUPLICATED] += 1
        else:
            _delete(fk, fv, fc, slot)
    _remember(key, bit, cap, mk, mv, mc, ring, meta, out)


@njit(cache=True, nogil=True)  # type: ignore[misc]
def store(
    hashes: Any,
    keys: Any,
    alike: bool,
    bit: Any,
    tier: Any,
    classify: bool,
    chained: bool,
    shard_n: Any,
    shard_i: Any,
    room: int,
    rk: Any,
    rv: Any,
    rc: Any,
    fk: Any,
    fv: Any,
    fc: Any,
    mk: Any,
    mv: Any,
    out: Any,
    copies: Any,
) -> None:
    """One ``BlockStored``: classify each block and hold it (see :meth:`FleetIndex.stored`).
    ``copies[b]`` is set for a block the tier holds already (counted by the caller)."""
    whole = shard_n == np.uint64(1)
    tier_bits = tier << TIER_SHIFT
    added = 0
    for b in range(hashes.size):
        engine_hash = hashes[b]
        key = keys[b]
        mine = whole or key % shard_n == shard_i
        mask = np.uint64(0)
        fleet_slot = -1
        fleet_found = False
        if mine:
            fleet_slot, fleet_found = _find(fk, key)
            if fleet_found:
                mask = fv[fleet_slot]
            out[O_STORED] += 1
            if classify:
                if not chained:
                    cause = C_UNKNOWN
                elif mask & bit:
                    cause = C_HELD_HERE
                elif mask:
                    cause = C_HELD_ELSEWHERE
                else:
                    slot, found = _find(mk, key)
                    before = mv[slot] if found else np.uint64(0)
                    cause = C_NEW if not before else C_EVICTED_HERE if before & bit else C_EVICTED_ELSEWHERE
                out[cause] += 1
        slot, found = _find(rk, engine_hash)
        if found and rv[slot] & tier_bits:
            copies[b] = 1
            out[O_COPIES] += 1
            if mine:
                out[O_HELD] += 1
            continue
        if not mine and alike:
            continue  # nothing chains from it: out of this shard, it is not kept at all
        if added >= room:
            out[O_UNTRACKED] += 1
            continue
        if found:
            rv[slot] |= tier_bits
        else:
            _insert(rk, rv, rc, slot, engine_hash, (np.uint64(0) if alike else key) | tier_bits)
        added += 1
        if mine:
            out[O_HELD] += 1
            if not mask & bit:
                if mask:
                    out[O_DUPLICATED] += 1
                if fleet_found:
                    fv[fleet_slot] = mask | bit
                else:
                    _insert(fk, fv, fc, fleet_slot, key, bit)
    out[O_ADDED] = added


@njit(cache=True, nogil=True)  # type: ignore[misc]
def remove(
    hashes: Any,
    alike: bool,
    bit: Any,
    tier: Any,
    shard_n: Any,
    shard_i: Any,
    cap: int,
    rk: Any,
    rv: Any,
    rc: Any,
    fk: Any,
    fv: Any,
    fc: Any,
    mk: Any,
    mv: Any,
    mc: Any,
    ring: Any,
    meta: Any,
    out: Any,
) -> None:
    """One ``BlockRemoved`` (its blocks held as extra copies already taken off by the caller)."""
    whole = shard_n == np.uint64(1)
    tier_bits = tier << TIER_SHIFT
    for b in range(hashes.size):
        engine_hash = hashes[b]
        slot, found = _find(rk, engine_hash)
        if not found or not rv[slot] & tier_bits:
            # its store was missed (or not kept); without hashes alike its shard is unknown, so
            # shard 0 counts it
            if (whole or engine_hash % shard_n == shard_i) if alike else shard_i == np.uint64(0):
                out[R_UNKNOWN] += 1
            continue
        val = rv[slot]
        key = engine_hash if alike else val & MASK60
        out[R_DROPPED] += 1
        mine = whole or key % shard_n == shard_i
        if mine:
            out[R_MINE] += 1
        left = val & ~tier_bits
        if left >> TIER_SHIFT:
            rv[slot] = left  # still held in another tier: still a holder
            continue
        _delete(rk, rv, rc, slot)
        if mine:
            _release(key, bit, cap, fk, fv, fc, mk, mv, mc, ring, meta, out)


@njit(cache=True, nogil=True)  # type: ignore[misc]
def clear(
    alike: bool,
    bit: Any,
    shard_n: Any,
    shard_i: Any,
    cap: int,
    rk: Any,
    rv: Any,
    fk: Any,
    fv: Any,
    fc: Any,
    mk: Any,
    mv: Any,
    mc: Any,
    ring: Any,
    meta: Any,
    out: Any,
    tiers: Any,
) -> None:
    """Every block of one replica removed (``tiers[t]``: this shard's blocks removed from tier t;
    the caller drops the replica's table afterwards)."""
    whole = shard_n == np.uint64(1)
    size = rk.size - 2
    for slot in range(rk.size):
        stored_key = rk[slot]
        if slot < size:
            if stored_key <= TOMB:
                continue
            engine_hash = stored_key
        else:
            if stored_key != PRESENT:
                continue
            engine_hash = np.uint64(slot - size)
        val = rv[slot]
        key = engine_hash if alike else val & MASK60
        mine = whole or key % shard_n == shard_i
        held = val >> TIER_SHIFT
        for t in range(4):
            if held & (np.uint64(1) << np.uint64(t)):
                out[R_DROPPED] += 1
                if mine:
                    tiers[t] += 1
        if mine:
            _release(key, bit, cap, fk, fv, fc, mk, mv, mc, ring, meta, out)
