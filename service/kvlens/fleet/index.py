"""Which replica holds which block, by content, and why each stored block had to be computed.

The fleet's engines announce every block they cache and evict (KV events). A block is known by a
**content key**: a 60-bit hash of its parent's content key, its token ids and its extra keys
(LoRA, multimodal, cache salt: whatever the engine folds into its own hash), the same in every
process and on every machine (a collision among 10M blocks has a chance of about 4e-5). The engines' own
hashes cannot serve across replicas in general (a different ``PYTHONHASHSEED``, xxhash's random
seed or another ``--prefix-caching-hash-algo`` give other hashes for the same content), so each
replica keeps a map from its engine hash to the content key, and a child's key is chained from its
parent's. When every replica is known to hash alike (``hashes_alike``), the engine hash is the key.

A block a replica **stores** in its primary tier (``GPU``; a ``medium`` of None is the GPU) is
work the replica just did (prefill, or decode filling a block), and gets one cause, the first
that applies (:mod:`kvlens.fleet.causes`: held here, held elsewhere, evicted here, evicted
elsewhere, new, or unknown when its parent's content is unknown and its key cannot be chained).

Each classified block's **depth** (the blocks before it in its chain: its parent's depth + 1, 0
without a parent) is kept beside it in the replica's table, so that its tokens' positions are
known: a token at position ``p`` (1-based) attends to ``p`` tokens, and a cause's causal pairs,
summed in integers, give its modelled prefill work by any cost model, ``a*tokens + b*pairs``
(:meth:`kvlens.fleet.snapshot.IndexSnapshot.recomputed_work`: the same ``C(n) - C(h)`` as
compute saved, so a block lost at depth 100 weighs what recomputing it there costs). A block
whose parent this replica does not hold (its chain's start never seen), a child of one, or one
past 65,534 blocks deep has no depth: its tokens are counted apart (``depth_unknown_tokens``),
and no work is modelled for them.

Stores into other tiers (``CPU``, ``STORAGE``: offload copies) are counted, and make the replica a
holder, but are not work and get no cause. ``AllBlocksCleared`` and a publisher restart remove
every block the replica holds (it held them, and lost them: a later store is ``evicted_here``).

Replicas: each one followed has a slot, its bit in the fleet's 64-bit masks, so at most
:data:`MAX_REPLICAS` at once. A replica that left the fleet for good (a pod's address gone from
the DNS answer) is forgotten (:meth:`FleetIndex.forget_replica`): its blocks are cleared, its bit
taken off every held and remembered entry, and its slot given to the next new replica, which
inherits nothing. A block that only forgotten replicas removed stays remembered, with no remover:
"held before, by the fleet", so a later store is ``evicted_elsewhere`` (by any replica, one of
the same name included: a name that comes back is a new replica); it is ``new`` only once the
block itself is forgotten past ``remember_blocks``. A forgotten replica's counters are kept by
name (a few hundred bytes each), so what is exported never goes back, until the caller drops them
(:meth:`FleetIndex.drop_forgotten`: the series go, and a name that comes back later counts from
zero, a new series). Past
:data:`MAX_REPLICAS` live replicas :meth:`FleetIndex.replica` raises and :meth:`FleetIndex.admit`
says no (the caller drops that replica's events, counted).

Memory (the tables are :class:`kvlens.fleet.kernels.table.Table`, 16 bytes a slot, 70-85 % full past
16,384 slots; a smaller one, at most 256 KiB, doubles when it grows): per
replica, a table of the blocks it holds (engine hash -> content key and the tiers holding it);
for the fleet, a table of the blocks some replica holds (content key -> bits of the replicas
holding it: at most :data:`MAX_REPLICAS` replicas) and one of the blocks remembered to have been
held (content key -> bits of the replicas that removed it) with their keys in a ring, oldest
first; per replica, a table of its extra copies (a hash stored again into a tier that holds it,
no removal between: the engine keeps two blocks of it; the next removal takes a copy first):
engine hash -> a 16-bit count a tier. A replica's table keeps a block's depth in 2 bytes a slot
beside it, and is rebuilt fuller (:data:`~kvlens.fleet.kernels.table.DEPTH_FILL`) so that a
holding stays within its bytes. A holding is a (block, replica, tier) or an extra copy; it
costs at most :data:`HELD_ENTRY_BYTES`, a remembered block at most
:data:`REMEMBERED_ENTRY_BYTES` (tested); every array is in :meth:`FleetIndex.memory_bytes`
(tested against tracemalloc). The remembered ones are capped (``remember_blocks``), the oldest
forgotten first and counted; holdings past ``max_held_blocks`` (and a 65,536th copy) are
classified but not kept (counted untracked), so the blocks held, copies included, never pass
it. ``AllBlocksCleared`` remembers the replica's blocks in its table's order, not the order they
were stored; it, a forgotten replica and a table's rebuild go a slice of rows at a time, a
scrape waiting for the lock let in between slices (:class:`IndexLock`). With
``shard=(i, n)`` only blocks whose content key is ``i`` mod ``n`` are classified and kept in the
fleet's tables, so ``n`` processes on the same events split the counts exactly; each replica's
engine-hash map is still kept whole (a child's key, without ``hashes_alike``, and its depth need
its parent's, whatever the parent's shard).
"""

from __future__ import annotations

import importlib.util
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, cast

import msgspec
import numpy as np

from kvlens.errors import MissingExtra
from kvlens.fleet.causes import CAUSES
from kvlens.fleet.groups import KVCacheGroups
from kvlens.fleet.keys import EngineHash, engine_key, extra_digest, hash_array, token_array
from kvlens.fleet.limits import (
    MAX_BLOCK_SIZE,
    MAX_HELD_BLOCKS,
    MAX_REPLICAS,
    PRIMARY,
    REMEMBER_BLOCKS,
    TIERS,
    tier_number,
)
from kvlens.fleet.lock import IndexLock
from kvlens.fleet.sessions import SessionLedger
from kvlens.fleet.snapshot import IndexSnapshot

if TYPE_CHECKING:
    from kvlens.fleet.kernels import table as tables
    from kvlens.fleet.kernels.rules import Arrays


@dataclass
class _Replica:
    name: str
    number: int  # its bit in the fleet's masks, its row of counters
    table: tables.Table  # engine hash -> content key | the tiers holding it << 60
    copies: tables.Table  # engine hash -> its extra copies, kernels.rules.COPY_BITS a tier


_NO_TOKENS: Final = np.zeros(0, np.uint64)
_NO_BYTES: Final = np.zeros(0, np.uint8)


def compiled_loops_available() -> bool:
    """Whether the index's compiled loops can run here (numba, of the ``kv-events`` extra)."""
    return importlib.util.find_spec("numba") is not None


class FleetIndex:
    """The index is fed from one thread at a time (its lock makes that so) and read at scrape
    time through :meth:`snapshot`. Needs numba (the ``kv-events`` extra)."""

    def __init__(
        self,
        *,
        hashes_alike: bool = False,
        remember_blocks: int = REMEMBER_BLOCKS,
        max_held_blocks: int = MAX_HELD_BLOCKS,
        shard: tuple[int, int] = (0, 1),
        require_cache_salt: bool = False,
        sessions: int = 0,
        group_kinds: Sequence[str] = (),
    ) -> None:
        """``group_kinds``: the fleet's model's KV cache groups' kinds, by group number, when its
        events do not say them (vLLM 0.33's GPU pool: :mod:`kvlens.fleet.groups`)."""
        if not compiled_loops_available():  # before serving, not at the first event
            raise MissingExtra("the fleet index", "kv-events")
        from kvlens.fleet import kernels  # numba: only where KV events are followed
        from kvlens.fleet.kernels import msgpack, rules, table

        kernels.warm()
        if remember_blocks < 0 or max_held_blocks < 0:
            raise ValueError("remember_blocks and max_held_blocks must be >= 0")
        index, count = shard
        if count < 1 or not 0 <= index < count:
            raise ValueError(f"shard {index}/{count}: need 0 <= i < N")
        self._k, self._tables, self._reader = rules, table, msgpack
        self.hashes_alike = hashes_alike
        self.remember_cap = remember_blocks
        self.max_held = max_held_blocks
        self.shard_index, self.shard_count = shard
        self.lock = IndexLock()
        self._replicas: dict[str, _Replica] = {}
        self._fleet = table.Table()  # content key -> bits of the replicas holding it
        self._remembered = table.Table()  # content key -> bits of replicas that removed it
        self._ring = table.Ring(remember_blocks)  # remembered keys, oldest first
        self._stats = np.zeros((MAX_REPLICAS, rules.STATS), np.int64)  # a row per replica
        self._counts = np.zeros(rules.FLEET_COUNTS, np.int64)
        self._params = np.zeros(rules.PARAMS, np.uint64)
        params = self._params
        params[rules.P_ALIKE] = hashes_alike
        params[rules.P_SHARDS], params[rules.P_SHARD] = count, index
        params[rules.P_MAX_HELD], params[rules.P_CAP] = max_held_blocks, remember_blocks
        self._free = list(range(MAX_REPLICAS - 1, -1, -1))  # slots, the lowest taken first
        # the counters of forgotten replicas, by name: exported counters never go back
        self._retired: dict[str, np.ndarray[Any, np.dtype[np.int64]]] = {}
        # with it, blocks stored at the start of a chain without a salt are counted (note_chain_start)
        self.require_cache_salt = require_cache_salt
        self._unsalted: Counter[str] = Counter()  # replica -> blocks; kept when it is forgotten
        self.groups = KVCacheGroups(group_kinds)
        # the last ``sessions`` sessions' stores by cause (vLLM's session_id; kvlens.fleet.sessions)
        self.sessions = (
            SessionLedger(sessions, CAUSES) if sessions > 0 else None
        )  # a hybrid model's KV cache groups, per replica (kvlens.fleet.groups)

    # --- feeding ---------------------------------------------------------------------------

    def replica(self, name: str) -> _Replica:
        state = self._replicas.get(name)
        if state is None:
            if not self._free:
                raise ValueError(f"replica {name!r}: the index follows at most {MAX_REPLICAS} replicas")
            state = self._replicas[name] = _Replica(
                name, self._free.pop(), self._tables.Table(depths=True), self._tables.Table()
            )
        return state

    def admit(self, name: str) -> bool:
        """Whether ``name`` has a slot, taking a free one: False when all :data:`MAX_REPLICAS`
        are in use by other replicas (until one is forgotten)."""
        if name not in self._replicas:
            if not self._free:
                return False
            self.replica(name)
        return True

    def forget_replica(self, name: str) -> None:
        """The replica left the fleet for good (its address left the DNS answer): its blocks are
        cleared (counted removed, remembered as held before), its bit taken off every entry of the
        fleet's tables in one compiled pass, and its slot freed for the next replica, which
        inherits nothing. A block only it removed stays remembered, without a remover: stored
        later by any replica, even one of the same name, it is ``evicted_elsewhere`` (the fleet
        held it; nobody here did). Its counters stay, by name, added to by a replica of the same
        name later: the exported counters never go back."""
        state = self._replicas.get(name)
        if state is None:
            return
        if state.table.live:
            self.cleared(name)
        bit, pause = np.uint64(1) << np.uint64(state.number), self.lock.pause
        for table, holders in ((self._fleet, True), (self._remembered, False)):
            for start in range(0, table.rows.shape[0], self._tables.SLICE_ROWS):
                pause()
                self._k.drop_bit(
                    table.rows, bit, holders, self._counts, start, start + self._tables.SLICE_ROWS
                )
        self._fleet.shrink(pause)
        row = self._stats[state.number]
        earlier = self._retired.get(name)
        self._retired[name] = row.copy() if earlier is None else earlier + row
        row[:] = 0
        del self._replicas[name]
        self._free.append(state.number)
        self.groups.forget(name)

    def drop_forgotten(self, name: str) -> None:
        """Drop the counters kept for ``name``, a forgotten replica (not one followed now)."""
        if name not in self._replicas:
            self._retired.pop(name, None)
            self._unsalted.pop(name, None)

    def _mine(self, key: int) -> bool:
        return self.shard_count == 1 or key % self.shard_count == self.shard_index

    def _set(self, state: _Replica, tier: int) -> None:
        params = self._params
        params[self._k.P_REPLICA] = state.number
        params[self._k.P_TIER] = tier

    def _arrays(self, state: _Replica) -> Arrays:
        """What every loop takes (:data:`kvlens.fleet.kernels.rules.Arrays`), with ``state``'s
        tables: built a call, as a table is replaced when it grows or shrinks."""
        return (
            self._params,
            state.table.rows,
            state.copies.rows,
            self._fleet.rows,
            self._remembered.rows,
            self._ring.keys,
            self._stats,
            self._counts,
            state.table.depths,
        )

    def stored(
        self,
        replica: str,
        block_hashes: Sequence[EngineHash],
        parent_block_hash: EngineHash | None,
        token_ids: Sequence[int] | msgspec.Raw | np.ndarray[Any, np.dtype[np.uint64]],
        block_size: int,
        *,
        medium: str | None = None,
        extra_keys: Sequence[Any] | None = None,
        lora_name: str | None = None,
    ) -> bool:
        """One ``BlockStored``: classify each block (primary tier) and hold it. False, and nothing
        counted, when the token ids are not ``block_size`` integers for each block (``token_ids``
        as msgpack bytes are parsed in the compiled loop: cheaper than a list of Python ints)."""
        if not 1 <= block_size <= MAX_BLOCK_SIZE:
            return False
        state = self._replicas.get(replica) or self.replica(replica)
        tier = tier_number(medium or PRIMARY)
        hashes = hash_array(block_hashes)
        count = hashes.size
        if isinstance(token_ids, msgspec.Raw):
            raw, tokens = np.frombuffer(token_ids, dtype=np.uint8), _NO_TOKENS
        else:
            raw = _NO_BYTES
            given = token_ids if isinstance(token_ids, np.ndarray) else token_array(token_ids)
            if given is None:
                return False
            tokens = given.astype(np.uint64, copy=False)
        if extra_keys is None and lora_name is None:
            extras = _NO_TOKENS
        else:
            extras = np.array(
                [
                    extra_digest(lora_name, None if extra_keys is None else extra_keys[i])
                    for i in range(count)
                ],
                dtype=np.uint64,
            )
        k = self._k
        self._set(state, tier)
        params = self._params
        params[k.P_BLOCK_SIZE] = block_size
        params[k.P_HAS_PARENT] = parent_block_hash is not None
        params[k.P_PARENT] = 0 if parent_block_hash is None else engine_key(parent_block_hash)
        while True:
            done = k.store(hashes, raw, tokens, extras, self._arrays(state))
            if done not in (k.GROW, k.GROW_COPIES):
                break
            self._room_to_store(state, count, done)
        return bool(done >= 0)

    def _room_to_store(self, state: _Replica, count: int, grow: int) -> None:
        pause = self.lock.pause
        if grow == self._k.GROW_COPIES:
            state.copies.reserve(count, pause)
            return
        state.table.reserve(count, pause)
        self._fleet.reserve(count, pause)

    def _room_to_remove(self, count: int) -> None:
        self._remembered.reserve(count, self.lock.pause)
        self._ring.reserve(count)

    def _shrink(self, state: _Replica, flags: int) -> None:
        pause = self.lock.pause
        if flags & self._k.SHRINK_REPLICA:
            state.table.shrink(pause)
        if flags & self._k.SHRINK_FLEET:
            self._fleet.shrink(pause)
        if flags & self._k.SHRINK_COPIES:
            state.copies.shrink(pause)

    def apply_payload(self, replica: str, payload: bytes) -> list[int] | None:
        """Every event of a payload, read and applied in one compiled call (the usual payload:
        :func:`kvlens.fleet.kernels.msgpack.read_batch` says which), as
        :func:`kvlens.fleet.wire.decode_batch` then :meth:`stored`, :meth:`removed` and
        :meth:`cleared` event by event would (tested); the loop hands back what it leaves to this
        class (growing and shrinking tables, ``AllBlocksCleared``). Returns what became of the
        events (events of each type, malformed), or None, nothing changed, for a payload the loop
        leaves to msgspec (one with an event of another KV cache group, which msgspec counts)."""
        if self.groups.is_hybrid(replica):  # its removals need its groups' kinds: msgspec's path
            return None
        if self.sessions is not None and b"session_id" in payload:  # causes an event: msgspec's path
            return None
        k = self._k
        state = self._replicas.get(replica) or self.replica(replica)
        params = self._params
        params[k.P_REPLICA] = state.number  # the loop sets the rest an event
        position = 0
        malformed = 0  # by earlier calls (each call reads the payload anew)
        tally: list[int]  # numba answers ints
        while True:
            position, stop, value, *tally = k.apply_payload(payload, position, self._arrays(state))
            if stop == k.DONE:
                if malformed:
                    tally[k.T_MALFORMED] += malformed
                if self.require_cache_salt and tally[k.STORED_EVENT]:
                    self._count_unsalted(replica, payload)
                return tally
            malformed += tally[k.T_MALFORMED]
            if stop == k.UNREAD:
                return None
            if stop == k.STOP_SHRINK:
                self._shrink(state, value)
            elif stop == k.STOP_GROW:  # room for the value's blocks, the event at the position
                self._room_to_store(state, value, k.GROW)
            elif stop == k.STOP_GROW_COPIES:
                self._room_to_store(state, value, k.GROW_COPIES)
            elif stop == k.STOP_GROW_REMEMBERED:
                self._room_to_remove(value)
            else:  # STOP_CALLER: an AllBlocksCleared
                self.cleared(replica)
                params[k.P_REPLICA] = state.number
                position += 1

    def note_chain_start(self, replica: str, blocks: int, *, salted: bool) -> None:
        """A primary-tier store of ``blocks`` blocks whose first has no parent (a chain's start),
        with a cache salt or not: the unsalted ones counted with ``require_cache_salt`` (shard 0
        only, so that shards' counts add up to the fleet's). The salt itself is never kept."""
        if self.require_cache_salt and not salted and self.shard_index == 0:
            self._unsalted[replica] += blocks

    def _count_unsalted(self, replica: str, payload: bytes) -> None:
        """The chain starts of a payload the compiled loop applied: none of its stores carried a
        salt (a salt, in extra keys or SGLang's fields, leaves the payload to msgspec), so each
        GPU store applied without a parent is unsalted. The payload is read again, only with
        ``require_cache_salt`` (measured: the consumer then takes 1.07-1.13 times the CPU)."""
        blocks = int(self._reader.chain_start_blocks(payload))
        if blocks:
            self.note_chain_start(replica, blocks, salted=False)

    def removed(
        self,
        replica: str,
        block_hashes: Sequence[EngineHash],
        *,
        medium: str | None = None,
        remaining: Sequence[int] | None = None,
    ) -> None:
        """One ``BlockRemoved``: a copy of each hash goes (its extra copies first). With
        ``remaining`` (vLLM's ``remaining_copy_counts``, #48933: the engine's physical copies of
        each hash left after it), as many go as leave that many held here (at least none)."""
        state = self._replicas.get(replica) or self.replica(replica)
        hashes = hash_array(block_hashes)
        if remaining is not None:
            hashes = self._to_remaining(state, hashes, tier_number(medium or PRIMARY), remaining)
        k = self._k
        self._set(state, tier_number(medium or PRIMARY))
        while True:
            done = k.remove(hashes, self._arrays(state))
            if done != k.GROW:
                break
            self._room_to_remove(hashes.size)
        self._shrink(state, done)

    def _to_remaining(
        self,
        state: _Replica,
        hashes: np.ndarray[Any, np.dtype[np.uint64]],
        tier: int,
        left: Sequence[int],
    ) -> np.ndarray[Any, np.dtype[np.uint64]]:
        """Each hash repeated as often as copies must go for ``left`` of it to be held here."""
        lookup, copy_bits = self._tables.lookup, self._k.COPY_BITS
        repeated: list[int] = []
        for engine_hash, copies_left in zip(hashes.tolist(), left, strict=True):
            key = np.uint64(engine_hash)
            found, value = lookup(state.table.rows, key)
            held = int(found and int(value) >> (60 + tier) & 1)
            _, counts = lookup(state.copies.rows, key)
            held += int(counts) >> (copy_bits * tier) & ((1 << copy_bits) - 1)
            repeated += [engine_hash] * max(0, held - max(0, copies_left))
        return np.array(repeated, dtype=np.uint64)

    def cleared(self, replica: str) -> None:
        """``AllBlocksCleared``, or the publisher restarted: the replica holds nothing now.
        Its table is gone through :data:`~kvlens.fleet.kernels.table.SLICE_ROWS` rows at a time, the
        lock handed to a waiting scrape between slices (:meth:`IndexLock.pause`): a scrape
        meanwhile sees the blocks of the slices done removed, the rest still held. The remembered
        table grows a slice at a time too, so never past ``remember_blocks`` and a slice."""
        state = self._replicas.get(replica)
        if state is None:  # nothing stored (or refused a slot): nothing to clear
            return
        k, pause, slice_rows = self._k, self.lock.pause, self._tables.SLICE_ROWS
        table = state.table
        # grown once to what it will hold (the slices' own room then rebuilds it only when
        # forgetting at the cap left tombstones), not to that plus the replica's blocks
        remembered = self._remembered
        remembered.reserve(
            max(0, min(self.remember_cap, remembered.live + table.live) - remembered.live), pause
        )
        self._ring.reserve(table.live)
        rows = table.rows.shape[0]
        for start in range(0, rows, slice_rows):
            pause()  # whoever took the lock meanwhile may have set the parameters and grown tables
            stop = min(rows, start + slice_rows)
            self._room_to_remove(stop - start)
            self._set(state, 0)
            k.clear(self._arrays(state), start, stop)
        state.table, state.copies = self._tables.Table(depths=True), self._tables.Table()
        self._fleet.shrink(pause)

    # --- reading ---------------------------------------------------------------------------

    def _by_replica(self, first: int, names: Sequence[str], every: bool = False) -> Counter[tuple[str, str]]:
        """A block of the counter rows as {(replica, name): value}: the non-zero values, or with
        ``every`` each tier the replica stored into or removed from (a held count of 0 shows)."""
        k = self._k
        rows = dict(self._retired)
        for state in self._replicas.values():
            earlier = rows.get(state.name)
            live = self._stats[state.number]
            rows[state.name] = live if earlier is None else earlier + live
        table: Counter[tuple[str, str]] = Counter()
        for replica, counts in rows.items():
            row = counts.tolist()
            for offset, name in enumerate(names):
                value = row[first + offset]
                touched = row[k.STORED + offset] or row[k.REMOVED + offset] if every else value
                if touched:
                    table[replica, name] = value
        return table

    @property
    def recomputed(self) -> Counter[tuple[str, str]]:
        """(replica, cause) -> blocks."""
        return self._by_replica(self._k.C_NEW, CAUSES)

    def cause_tokens(self, replica: str) -> list[int]:
        """The replica's tokens recomputed so far by cause (:data:`CAUSES`' order)."""
        state = self._replicas.get(replica) or self.replica(replica)
        return cast(
            "list[int]", self._stats[state.number, self._k.TOKENS : self._k.TOKENS + len(CAUSES)].tolist()
        )

    @property
    def recomputed_tokens(self) -> Counter[tuple[str, str]]:
        return self._by_replica(self._k.TOKENS, CAUSES)

    @property
    def recomputed_pairs(self) -> Counter[tuple[str, str]]:
        """(replica, cause) -> the causal pairs of its recomputed tokens of known depth."""
        return self._by_replica(self._k.PAIRS, CAUSES)

    @property
    def depth_unknown_tokens(self) -> Counter[tuple[str, str]]:
        """(replica, cause) -> recomputed tokens whose chain's start was never seen."""
        return self._by_replica(self._k.DEPTHLESS, CAUSES)

    @property
    def duplicated(self) -> int:
        return int(self._counts[self._k.DUPLICATED])

    @property
    def forgotten(self) -> int:
        return int(self._counts[self._k.FORGOTTEN])

    @property
    def untracked(self) -> int:
        return int(self._counts[self._k.UNTRACKED])

    @property
    def unknown_removed(self) -> int:
        return int(self._counts[self._k.UNKNOWN_REMOVED])

    def holders(self, key: int) -> list[str]:
        """The replicas that hold the block of content key ``key`` now."""
        _, mask = self._tables.lookup(self._fleet.rows, np.uint64(key))
        return [state.name for state in self._replicas.values() if int(mask) >> state.number & 1]

    def snapshot(self) -> IndexSnapshot:
        k = self._k
        with self.lock:
            return IndexSnapshot(
                recomputed_blocks=dict(self.recomputed),
                recomputed_tokens=dict(self.recomputed_tokens),
                recomputed_pairs=dict(self.recomputed_pairs),
                depth_unknown_tokens=dict(self.depth_unknown_tokens),
                stored=dict(self._by_replica(k.STORED, TIERS)),
                removed=dict(self._by_replica(k.REMOVED, TIERS)),
                held=dict(self._by_replica(k.HELD, TIERS, every=True)),
                distinct_blocks=self._fleet.live,
                duplicated_blocks=self.duplicated,
                remembered_blocks=self._remembered.live,
                forgotten_blocks=self.forgotten,
                untracked_blocks=self.untracked,
                unknown_removed=self.unknown_removed,
                memory_bytes=self.memory_bytes(),
                unsalted_blocks={name: count for name, count in self._unsalted.items() if count},
            )

    def memory_bytes(self) -> int:
        """Every array the index holds, exactly: the tables (a table being rebuilt twice, old and
        new), the ring and the counters (tested against tracemalloc)."""
        tables = [self._fleet, self._remembered]
        for state in self._replicas.values():
            tables += [state.table, state.copies]
        arrays = [self._ring.keys, self._stats, self._counts, self._params, *self._retired.values()]
        return sum(table.nbytes for table in tables) + sum(array.nbytes for array in arrays)
