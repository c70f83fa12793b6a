"""The fleet index's rules, compiled (numba; the ``kv-events`` extra): each stored block's content
key and cause, holding and removing it, clearing a replica, forgetting one, and a payload read by
:func:`kvlens.fleet.kernels.msgpack.read_batch` applied in one call.

One table an array (:mod:`.table`), and the counters in arrays the loops add to, because a
compiled call costs about 0.3 microseconds an argument; the index hands its arrays over as one
tuple (:data:`Arrays`).

Why compiled: the memory goal (48 bytes a held block) needs the tables in arrays, not dicts of
Python ints (about 100 bytes an entry); walked from Python, an array costs more per element than
a dict, and numpy vectorised per event pays its call overhead a dozen times a table for vLLM's
one-to-forty-block events. A compiled loop keeps the rules sequential, so exact (a block stored
twice in one event, a removal then a store in one batch), at the cost of the table look-ups
themselves (cache misses on a large table) and a fixed cost a call (numba's argument checks).
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np
from numba import njit

from kvlens.fleet.kernels.cache import CACHE
from kvlens.fleet.kernels.msgpack import (
    APPLY,
    E_BLOCK_SIZE,
    E_HAS_PARENT,
    E_HASHES,
    E_HASHES_END,
    E_OUTCOME,
    E_TIER,
    E_TOKENS,
    E_TOKENS_END,
    E_TYPE,
    MALFORMED_EVENT,
    REMOVED_EVENT,
    STORED_EVENT,
    msgpack_ints,
    read_batch,
)
from kvlens.fleet.kernels.stamp import BUILT_FROM
from kvlens.fleet.kernels.table import (
    DEPTH_UNKNOWN,
    GOLDEN,
    MASK60,
    MAX_DEPTH,
    PRESENT,
    TIER_SHIFT,
    TOMB,
    delete_at,
    find_slot,
    has_room,
    insert_at,
    is_sparse,
    mix,
    touch_home,
    touch_home_depth,
)
from kvlens.fleet.limits import TIERS

_TOKEN: Final = np.uint64(0x100000001B3)  # FNV-1a's 64-bit prime
_SEED: Final = np.uint64(0xCBF29CE484222325)
# A replica's row of counters (``stats[replica]``): blocks per cause (kvlens.fleet.causes.CAUSES's
# order), tokens per cause, then per tier (kvlens.fleet.limits.TIERS) blocks stored, removed, held,
# then per cause the causal pairs of the tokens whose depth is known (a token at position p, 1 the
# first of its chain, attends to p tokens: C(n)'s b term summed a token, so a cause's modelled work
# is a*tokens + b*pairs, exact in integers whatever the cost model) and the tokens whose depth is
# not (their chain's start never seen: no work is modelled for them, never a guessed depth).
C_NEW, C_EVICTED_HERE, C_HELD_ELSEWHERE, C_EVICTED_ELSEWHERE, C_HELD_HERE, C_UNKNOWN = range(6)
_TIERS: Final = len(TIERS)  # each a bit of a replica table's value above TIER_SHIFT (4 at most)
TOKENS = 6
STORED, REMOVED, HELD = 2 * TOKENS, 2 * TOKENS + _TIERS, 2 * TOKENS + 2 * _TIERS
PAIRS = 2 * TOKENS + 3 * _TIERS
DEPTHLESS = PAIRS + TOKENS
STATS = DEPTHLESS + TOKENS
# The fleet's counters (``fleet_counts``)
HELD_ENTRIES, DUPLICATED, UNTRACKED, UNKNOWN_REMOVED, FORGOTTEN = range(5)
FLEET_COUNTS = 5
# store()'s parameters (``params``, uint64)
P_BLOCK_SIZE, P_PARENT, P_HAS_PARENT, P_ALIKE, P_TIER, P_REPLICA, P_SHARDS, P_SHARD, P_MAX_HELD, P_CAP = (
    range(10)
)
P_TOUCHED = 10  # where touch_home's loads go (so that the compiler keeps them)
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
# The index's arrays, handed to every loop as one plain tuple in this order (each loop unpacks it
# first). Not a NamedTuple: numba's dispatcher types a named tuple in Python, about a microsecond
# a call more than a plain tuple's fingerprint (measured), and a payload is one call.
Arrays = tuple[Any, Any, Any, Any, Any, Any, Any, Any, Any]  # params, replica, copies, fleet,
# remembered, ring, stats, fleet_counts, depths: the replica's table and its extra copies, the
# fleet's holders and remembered blocks (kernels.table), the remembered keys' ring, the counters
# (above), the depth of each block in the replica's table (kernels.table.Table.depths)
# apply_events' tally of each type, then events malformed (none of other KV cache groups: the
# reader leaves their payloads to msgspec)
TALLY = 4
T_MALFORMED = 3
# why apply_events stopped: done, or the caller's turn (tables to grow or shrink, an event it
# applies itself) before calling again from the position it answered; a table to grow for the
# event at the position (the value: its blocks): the replica's and the fleet's (a store's GROW),
# the replica's extra copies (GROW_COPIES), the remembered table and ring (a removal's GROW)
DONE, STOP_GROW, STOP_SHRINK, STOP_CALLER, UNREAD, STOP_GROW_COPIES, STOP_GROW_REMEMBERED = range(7)


@njit(cache=CACHE, nogil=True)
def built_from() -> int:
    """The sources this file's loops were compiled from (:mod:`.stamp`)."""
    return BUILT_FROM


@njit(cache=CACHE, nogil=True)
def content_keys(tokens: Any, block_size: int, parent: Any, extras: Any, out: Any) -> None:
    """Each block's content key, chained from its parent's: 60 bits (the top 4 of a replica
    table's value say which tiers hold the block). Tokens are hashed FNV-1a-like a token at a time,
    then mixed with the block's extra keys digest (``extras`` empty: none) and the parent's key.
    Four blocks' token hashes at a time: each is a chain of dependent multiplies, and four
    independent chains overlap in the processor where one waits on each multiply (measured:
    the hashing was a fifth of the compiled call's time on vLLM's 16-token blocks)."""
    key = parent
    count = out.size
    some_extras = extras.size != 0
    i = 0
    while i + 4 <= count:
        h0 = h1 = h2 = h3 = _SEED
        base = i * block_size
        for j in range(base, base + block_size):
            h0 = (h0 ^ tokens[j]) * _TOKEN
            h1 = (h1 ^ tokens[j + block_size]) * _TOKEN
            h2 = (h2 ^ tokens[j + 2 * block_size]) * _TOKEN
            h3 = (h3 ^ tokens[j + 3 * block_size]) * _TOKEN
        if some_extras:
            h0, h1, h2, h3 = h0 ^ extras[i], h1 ^ extras[i + 1], h2 ^ extras[i + 2], h3 ^ extras[i + 3]
        key = mix(key * GOLDEN + mix(h0)) & MASK60
        out[i] = key
        key = mix(key * GOLDEN + mix(h1)) & MASK60
        out[i + 1] = key
        key = mix(key * GOLDEN + mix(h2)) & MASK60
        out[i + 2] = key
        key = mix(key * GOLDEN + mix(h3)) & MASK60
        out[i + 3] = key
        i += 4
    for b in range(i, count):
        h = _SEED
        base = b * block_size
        for j in range(base, base + block_size):
            h = (h ^ tokens[j]) * _TOKEN
        if some_extras:
            h ^= extras[b]
        key = mix(key * GOLDEN + mix(h)) & MASK60
        out[b] = key


@njit(cache=CACHE, nogil=True)
def _remember(key: Any, bit: Any, cap: int, remembered: Any, ring: Any, fleet_counts: Any) -> None:
    row, found = find_slot(remembered, key)
    if found:
        remembered[row, 1] |= bit
        return
    if cap == 0:
        fleet_counts[FORGOTTEN] += 1
        return
    size = ring.size - 2
    head, count = np.int64(ring[0]), np.int64(ring[1])
    if count == cap:  # the oldest goes first: the same state as adding, then forgetting
        old, _ = find_slot(remembered, ring[2 + head])
        delete_at(remembered, old)
        head = (head + 1) % size
        count -= 1
        fleet_counts[FORGOTTEN] += 1
        row, _ = find_slot(remembered, key)
    ring[2 + (head + count) % size] = key
    ring[0] = head
    ring[1] = count + 1
    insert_at(remembered, row, key, bit)


@njit(cache=CACHE, nogil=True)
def _release(key: Any, bit: Any, cap: int, fleet: Any, remembered: Any, ring: Any, fleet_counts: Any) -> None:
    """The replica no longer holds ``key`` in any tier: off its holders, remembered."""
    row, found = find_slot(fleet, key)
    mask = fleet[row, 1] if found else np.uint64(0)
    if mask & bit:
        mask &= ~bit
        if mask:
            fleet[row, 1] = mask
            fleet_counts[DUPLICATED] -= 1
        else:
            delete_at(fleet, row)
    _remember(key, bit, cap, remembered, ring, fleet_counts)


@njit(cache=CACHE, nogil=True)
def _store(hashes: Any, tokens: Any, extras: Any, arrays: Arrays) -> int:
    params, replica, copies, fleet, remembered, _, stats, fleet_counts, depths = arrays
    count = hashes.size
    block_size = np.int64(params[P_BLOCK_SIZE])
    if block_size < 1 or tokens.size != count * block_size:
        return -1
    if not (has_room(replica, count) and has_room(fleet, count)):
        return GROW
    alike = params[P_ALIKE] != 0
    tier = np.int64(params[P_TIER])
    tier_bits = np.uint64(1) << (np.uint64(tier) + TIER_SHIFT)
    if not has_room(copies, count):  # rare (a small table, a large event): room if copies come
        repeats = 0
        for b in range(count):
            row, found = find_slot(replica, hashes[b])
            if found and replica[row, 1] & tier_bits:
                repeats += 1
        if repeats and not has_room(copies, repeats):
            return GROW_COPIES
    copy_shift = np.uint64(COPY_BITS * tier)
    classify = tier == 0
    mine_row = stats[np.int64(params[P_REPLICA])]
    bit = np.uint64(1) << params[P_REPLICA]
    shards, shard = params[P_SHARDS], params[P_SHARD]
    whole = shards == np.uint64(1)
    room = np.int64(params[P_MAX_HELD]) - fleet_counts[HELD_ENTRIES]
    # the first block's depth + 1 (0: unknown): its parent's + 1, 1 without a parent
    first_depth = np.int64(1)
    parent = np.uint64(0)
    chained = True
    if params[P_HAS_PARENT]:
        row, chained = find_slot(replica, params[P_PARENT])
        if chained:
            parent = replica[row, 1] & MASK60
            first_depth = np.int64(depths[row]) + 1 if depths[row] != DEPTH_UNKNOWN else 0
        else:
            first_depth = 0
    if alike:
        keys = hashes
        chained = True  # a block's key needs no parent
    else:
        keys = np.empty(count, np.uint64)
        content_keys(tokens, block_size, parent, extras, keys)
    touched = np.uint64(0)
    for b in range(count):
        touched ^= (
            touch_home_depth(replica, depths, hashes[b])
            ^ touch_home(fleet, keys[b])
            ^ touch_home(remembered, keys[b])
        )
    params[P_TOUCHED] = touched
    added = 0
    held = 0
    stored = 0
    for b in range(count):
        engine_hash = hashes[b]
        key = keys[b]
        depth = first_depth + b if first_depth != DEPTH_UNKNOWN and first_depth + b <= MAX_DEPTH + 1 else 0
        mine = whole or key % shards == shard
        mask = np.uint64(0)
        fleet_row = -1
        fleet_found = False
        if mine:
            fleet_row, fleet_found = find_slot(fleet, key)
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
                    row, found = find_slot(remembered, key)
                    before = remembered[row, 1] if found else np.uint64(0)
                    # found with no bits: held before by replicas since forgotten (drop_bit())
                    cause = C_NEW if not found else C_EVICTED_HERE if before & bit else C_EVICTED_ELSEWHERE
                mine_row[cause] += 1
                mine_row[TOKENS + cause] += block_size
                if depth == DEPTH_UNKNOWN:
                    mine_row[DEPTHLESS + cause] += block_size
                else:  # the tokens at positions p = before + 1 .. before + block_size
                    before = (depth - 1) * block_size
                    mine_row[PAIRS + cause] += block_size * before + block_size * (block_size + 1) // 2
        row, found = find_slot(replica, engine_hash)
        if found and replica[row, 1] & tier_bits:  # an extra copy: held, within the cap
            if added >= room:
                fleet_counts[UNTRACKED] += 1
                continue
            copy_row, copy_found = find_slot(copies, engine_hash)
            counts = copies[copy_row, 1] if copy_found else np.uint64(0)
            if (counts >> copy_shift) & np.uint64(COPY_MAX) == np.uint64(COPY_MAX) or not (
                copy_found or has_room(copies, 1)  # the same hash again in this event: rare
            ):
                fleet_counts[UNTRACKED] += 1
                continue
            if copy_found:
                copies[copy_row, 1] = counts + (np.uint64(1) << copy_shift)
            else:
                insert_at(copies, copy_row, engine_hash, np.uint64(1) << copy_shift)
            added += 1
            if mine:
                held += 1
            continue
        if added >= room:
            fleet_counts[UNTRACKED] += 1
            continue
        if found:
            replica[row, 1] |= tier_bits
            if depths[row] == DEPTH_UNKNOWN:
                depths[row] = depth
        else:  # kept out of this shard too: a child's depth (and content key) chains from it
            insert_at(replica, row, engine_hash, (np.uint64(0) if alike else key) | tier_bits)
            depths[row] = depth
        added += 1
        if mine:
            held += 1
            if not mask & bit:
                if mask:
                    fleet_counts[DUPLICATED] += 1
                if fleet_found:
                    fleet[fleet_row, 1] = mask | bit
                else:
                    insert_at(fleet, fleet_row, key, bit)
    fleet_counts[HELD_ENTRIES] += added
    mine_row[STORED + tier] += stored
    mine_row[HELD + tier] += held
    return 0


@njit(cache=CACHE, nogil=True)
def store(hashes: Any, raw: Any, tokens: Any, extras: Any, arrays: Arrays) -> int:
    """One ``BlockStored`` into ``replica``'s table (and ``copies``, its extra copies): classify
    each block and hold it (see :meth:`FleetIndex.stored`). Tokens come as msgpack bytes
    (``raw``, when not empty) or as ``tokens``; -1 (and nothing changed) when they are not
    ``block_size`` integers a block, :data:`GROW` or :data:`GROW_COPIES` (nothing changed) when
    a table needs room first, else 0; ``extras`` is empty or a digest a block."""
    if raw.size:
        ok, tokens = msgpack_ints(raw)
        if not ok:
            return -1
    return _store(hashes, tokens, extras, arrays)


@njit(cache=CACHE, nogil=True)
def _remove(hashes: Any, arrays: Arrays) -> int:
    params, replica, copies, fleet, remembered, ring, stats, fleet_counts, _ = arrays
    cap = np.int64(params[P_CAP])
    if not (has_room(remembered, hashes.size) and ring.size - 2 >= min(cap, np.int64(ring[1]) + hashes.size)):
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
        touched ^= touch_home(replica, hashes[b])
    # each hash's row, found once: a removal inserts nothing, so a hash not held now is not
    # held below, and one held is where it was found unless this event removed it already
    rows = np.empty(hashes.size, np.int64)
    for b in range(hashes.size):  # then the fleet's lines of the blocks held
        row, found = find_slot(replica, hashes[b])
        rows[b] = row if found else -1
        if found:
            key = hashes[b] if alike else replica[row, 1] & MASK60
            touched ^= touch_home(fleet, key) ^ touch_home(remembered, key)
    params[P_TOUCHED] = touched
    for b in range(hashes.size):
        engine_hash = hashes[b]
        row = rows[b]
        found = row >= 0 and replica[row, 0] == (engine_hash if engine_hash >= PRESENT else PRESENT)
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
            copy_row, copy_found = find_slot(copies, engine_hash)
            counts = copies[copy_row, 1] if copy_found else np.uint64(0)
            if (counts >> copy_shift) & np.uint64(COPY_MAX):
                counts -= np.uint64(1) << copy_shift
                if counts:
                    copies[copy_row, 1] = counts
                else:
                    delete_at(copies, copy_row)
                continue
        left = val & ~tier_bits
        if left >> TIER_SHIFT:
            replica[row, 1] = left  # still held in another tier: still a holder
            continue
        delete_at(replica, row)
        if mine:
            _release(key, bit, cap, fleet, remembered, ring, fleet_counts)
    return (
        (SHRINK_REPLICA if is_sparse(replica) else 0)
        | (SHRINK_FLEET if is_sparse(fleet) else 0)
        | (SHRINK_COPIES if is_sparse(copies) else 0)
    )


@njit(cache=CACHE, nogil=True)
def remove(hashes: Any, arrays: Arrays) -> int:
    """One ``BlockRemoved``: an extra copy of a block goes first (the block stays held).
    :data:`GROW` (nothing changed) when the remembered table or ring needs room first; else
    :data:`SHRINK_REPLICA`, :data:`SHRINK_FLEET` and :data:`SHRINK_COPIES` set for the tables
    now mostly empty."""
    return _remove(hashes, arrays)


@njit(cache=CACHE, nogil=True)
def clear(arrays: Arrays, start: int, stop: int) -> None:
    """The blocks in rows ``start`` to ``stop`` of one replica's table (its two spare rows
    after the ``size`` probed ones), with their extra copies, removed: the caller goes through
    the table a slice at a time (the remembered table and ring given room for a slice's blocks
    first), then drops both tables, which this leaves as they were."""
    params, replica, copies, fleet, remembered, ring, stats, fleet_counts, _ = arrays
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
            copy_row, copy_found = find_slot(copies, engine_hash)
            if copy_found:
                counts = copies[copy_row, 1]
        for t in range(_TIERS):
            if held & (np.uint64(1) << np.uint64(t)):
                entries = 1 + np.int64((counts >> np.uint64(COPY_BITS * t)) & np.uint64(COPY_MAX))
                fleet_counts[HELD_ENTRIES] -= entries
                if mine:
                    mine_row[REMOVED + t] += entries
                    mine_row[HELD + t] -= entries
        if mine:
            _release(key, bit, cap, fleet, remembered, ring, fleet_counts)


@njit(cache=CACHE, nogil=True)
def drop_bit(table: Any, bit: Any, holders: bool, fleet_counts: Any, start: int, stop: int) -> None:
    """``bit`` off the entries in rows ``start`` to ``stop``, a slice of a forgotten replica's
    pass over both fleet tables (:meth:`~kvlens.fleet.index.FleetIndex.forget_replica`), so that
    a replica given the slot next inherits nothing; ``holders``: the fleet's table (an entry left
    with no bit goes; a remembered one stays, with no bits when the replica was its only remover:
    still remembered as held before, by some replica, so a later store is ``evicted_elsewhere``)."""
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
            delete_at(table, row)


@njit(cache=CACHE, nogil=True)
def _apply_events(
    start: int,
    events: Any,
    parents: Any,
    hashes: Any,
    tokens: Any,
    arrays: Arrays,
    tally: Any,
) -> tuple[int, int, int]:
    """The events :func:`read_batch` read, from ``start``, as :func:`store` and :func:`remove` one
    by one would (see :func:`apply_payload`)."""
    params = arrays[0]
    no_extras = parents[:0]  # a view: no allocation
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
                arrays,
            )
            if done == GROW:
                return e, STOP_GROW, row[E_HASHES_END] - row[E_HASHES]
            if done == GROW_COPIES:
                return e, STOP_GROW_COPIES, row[E_HASHES_END] - row[E_HASHES]
            if done < 0:  # the token ids do not fill its blocks (counted now: a call after a
                tally[T_MALFORMED] += 1  # stop reads the payload anew)
        elif kind == REMOVED_EVENT:
            done = _remove(hashes[row[E_HASHES] : row[E_HASHES_END]], arrays)
            if done == GROW:
                return e, STOP_GROW_REMEMBERED, row[E_HASHES_END] - row[E_HASHES]
            if done:
                return e + 1, STOP_SHRINK, done
        else:
            return e, STOP_CALLER, 0
    for e in range(n):
        outcome = events[e, E_OUTCOME]
        tally[events[e, E_TYPE]] += 1
        if outcome == MALFORMED_EVENT:
            tally[T_MALFORMED] += 1
    return n, DONE, 0


@njit(cache=CACHE, nogil=True)
def apply_payload(buf: Any, start: int, arrays: Arrays) -> tuple[int, int, int, int, int, int, int]:
    """A payload's events, from event ``start``, into ``replica``'s table (``params``' replica):
    read (:func:`read_batch`, :data:`UNREAD` when it is not sure of the payload: nothing changed),
    then applied as :func:`store` and :func:`remove` one by one would. Answers (position, why it
    stopped, a value, then the tally: events of each type, malformed). Done:
    (events, :data:`DONE`, 0, tally). Else it is the caller's turn, then call again from the
    position: :data:`STOP_GROW`, :data:`STOP_GROW_COPIES` or :data:`STOP_GROW_REMEMBERED` (grow
    those tables for the event at the position: the value is its blocks), :data:`STOP_SHRINK` (the
    event before it left tables mostly empty: the value's flags), :data:`STOP_CALLER` (the
    caller applies the event at the position: an ``AllBlocksCleared``)."""
    ok, events, parents, hashes, tokens = read_batch(buf)
    if not ok:
        return 0, UNREAD, 0, 0, 0, 0, 0
    tally = np.zeros(TALLY, np.int64)
    # the tally: events malformed in this call, all at DONE
    position, stop, value = _apply_events(start, events, parents, hashes, tokens, arrays, tally)
    return position, stop, value, tally[0], tally[1], tally[2], tally[3]
