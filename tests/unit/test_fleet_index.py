"""The fleet block index against the simulator, which knows the truth: the simulated caches publish
their KV events (BlockStored / BlockRemoved), the index classifies every stored block, and the
causes are checked against ``kvlens simulate``'s reachable and delivered reuse on the bundled
trace, exactly.

Why the identities hold (and when): the reachable walk reuses, per request, the leading blocks
seen before; a replica recomputes and stores the rest. A stored block seen before was held
somewhere and is no more (one replica: ``evicted_here``) or is held by another replica (unbounded
caches: ``held_elsewhere``). So the cause's blocks are the reuse the replica missed, provided
(a) the cache never refused a block for lack of room (checked: ``refused == 0``) and (b) no
prompt that is a whole number of blocks, every block seen before, finds its last block evicted:
the engine recomputes that block even when it is cached, so the walk does not count it as reuse,
while its eviction makes a store (:func:`test_a_whole_block_prompt_whose_last_block_was_evicted`
shows the one block of difference). The bundled trace has 4 prompts of whole blocks, none of
them in that case.
"""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlens.definitions import SECONDS, UNITS
from kvlens.exporter.promql import LOST
from kvlens.fleet.causes import (
    CAUSES,
    EVICTED_ELSEWHERE,
    EVICTED_HERE,
    HELD_ELSEWHERE,
    HELD_HERE,
    NEW,
    UNKNOWN,
)
from kvlens.fleet.index import FleetIndex
from kvlens.fleet.keys import extra_digest
from kvlens.fleet.limits import HELD_ENTRY_BYTES, MAX_REPLICAS, REMEMBERED_ENTRY_BYTES
from kvlens.fleet.simulated import SimulatedEngine, into_index
from kvlens.simulate.replica import DEFAULT_SERVICE
from kvlens.simulate.run import Fleet, Outcome, simulate, walk
from kvlens.simulate.trace import BUNDLED, MOONCAKE, Trace, TraceRequest

BLOCK = 512


def trace() -> list[TraceRequest]:
    return list(Trace(str(BUNDLED), MOONCAKE, BLOCK).requests())


@pytest.fixture(scope="module")
def requests() -> list[TraceRequest]:
    return trace()


@pytest.fixture(scope="module")
def reachable(requests: list[TraceRequest]) -> Outcome:
    return walk(requests, None, BLOCK, "reachable")


@pytest.fixture(scope="module")
def reachable_tokens(reachable: Outcome) -> int:
    return reachable.totals.cached_tokens


def lost_work(index: FleetIndex) -> float:
    """The index's lost causes in work, by the simulator's own cost model (seconds)."""
    work = index.snapshot().recomputed_work(DEFAULT_SERVICE.prefill)
    return sum(value for (_, cause), value in work.items() if cause in LOST)


def saved_seconds(outcome: Outcome) -> float:
    return outcome.totals.reused_work[UNITS.index(SECONDS)]


def run(
    requests: list[TraceRequest],
    replicas: int,
    capacity: int | None,
    policy: str,
    seeds: list[int | None] | None = None,
    index: FleetIndex | None = None,
    block: int = BLOCK,
) -> tuple[Outcome, FleetIndex]:
    index = index or FleetIndex()
    emit = into_index(index)
    engines = [
        SimulatedEngine(f"r{i}", block, emit, None if seeds is None else seeds[i]) for i in range(replicas)
    ]
    outcome = simulate(requests, Fleet(replicas, capacity, block), policy, events=lambda i: engines[i])
    return outcome, index


def by_cause(index: FleetIndex, tokens: bool = True) -> Counter[str]:
    table = index.recomputed_tokens if tokens else index.recomputed
    totals: Counter[str] = Counter()
    for (_, cause), value in table.items():
        totals[cause] += value
    return totals


def stored_blocks(requests: list[TraceRequest]) -> int:
    return sum(len(r.blocks) for r in requests)


def test_one_unbounded_replica_recomputes_only_new_blocks(requests: list[TraceRequest]) -> None:
    outcome, index = run(requests, 1, None, "round_robin")
    distinct = len({key for r in requests for key in r.blocks})
    assert by_cause(index, tokens=False) == Counter({NEW: distinct})
    assert index.snapshot().held == {("r0", "GPU"): distinct}
    assert outcome.evictions == 0


@pytest.mark.parametrize("capacity", [3000, 8000])
def test_one_replica_with_a_capacity_recomputes_the_reuse_it_evicted(
    requests: list[TraceRequest], reachable: Outcome, reachable_tokens: int, capacity: int
) -> None:
    outcome, index = run(requests, 1, capacity, "round_robin")
    assert outcome.refused == 0  # the identity's condition (a)
    causes = by_cause(index)
    assert set(causes) == {NEW, EVICTED_HERE}
    assert causes[EVICTED_HERE] == reachable_tokens - outcome.totals.cached_tokens
    assert lost_work(index) == pytest.approx(saved_seconds(reachable) - saved_seconds(outcome), rel=1e-9)
    assert causes[EVICTED_HERE] > 0
    distinct = len({key for r in requests for key in r.blocks})
    assert causes[NEW] == distinct * BLOCK


@pytest.mark.parametrize("policy", ["round_robin", "prefix_affinity"])
def test_unbounded_replicas_recompute_what_another_one_held(
    requests: list[TraceRequest], reachable_tokens: int, policy: str
) -> None:
    outcome, index = run(requests, 4, None, policy)
    assert outcome.refused == 0
    causes = by_cause(index)
    assert set(causes) <= {NEW, HELD_ELSEWHERE}
    assert causes[HELD_ELSEWHERE] == reachable_tokens - outcome.totals.cached_tokens
    assert causes[NEW] == len({key for r in requests for key in r.blocks}) * BLOCK


def test_with_capacity_and_replicas_the_causes_cover_every_stored_block(
    requests: list[TraceRequest], reachable: Outcome, reachable_tokens: int
) -> None:
    outcome, index = run(requests, 4, 2000, "round_robin")
    assert outcome.refused == 0
    causes = by_cause(index)
    lost = causes[HELD_ELSEWHERE] + causes[EVICTED_HERE] + causes[EVICTED_ELSEWHERE]
    assert lost == reachable_tokens - outcome.totals.cached_tokens  # the whole gap, split by cause
    # and in work: each lost block at its position, by the cost model of compute saved, is the
    # compute the reachable reuse would have saved beyond what the replicas' caches delivered
    assert lost_work(index) == pytest.approx(saved_seconds(reachable) - saved_seconds(outcome), rel=1e-9)
    assert index.snapshot().depth_unknown_tokens == {}
    snapshot = index.snapshot()
    stored = sum(snapshot.stored.values())
    assert sum(by_cause(index, tokens=False).values()) == stored
    removed = sum(snapshot.removed.values())
    assert removed == outcome.evictions
    assert sum(snapshot.held.values()) == stored - removed
    assert {c for c, n in by_cause(index).items() if n} == {
        NEW,
        EVICTED_HERE,
        HELD_ELSEWHERE,
        EVICTED_ELSEWHERE,
    }


def test_replicas_that_hash_differently_are_classified_alike(requests: list[TraceRequest]) -> None:
    part = requests[:1500]
    _, same = run(part, 3, 1500, "round_robin")
    _, seeded = run(part, 3, 1500, "round_robin", seeds=[11, 22, 33])
    assert seeded.recomputed == same.recomputed
    assert seeded.snapshot().held == same.snapshot().held


# --- by hand ----------------------------------------------------------------------------------


def test_a_whole_block_prompt_whose_last_block_was_evicted() -> None:
    """The identity's limit (b): a prompt of exactly 2 blocks comes back after its second block
    was evicted. Both the walk and the replica reuse 1 block (the last token is recomputed, so
    the last block is never a hit), yet the replica stores the evicted block: 1 block of
    evicted_here beyond the reuse gap."""
    requests = [
        TraceRequest(0, 0.0, 8, 1, ("a1", "a2")),
        TraceRequest(1, 100.0, 5, 1, ("b1",)),  # evicts a2 (freed before a1: last block first)
        TraceRequest(2, 200.0, 8, 1, ("a1", "a2")),
    ]
    keys = {"a1": 1, "a2": 2, "b1": 3}
    numbered = [
        TraceRequest(r.index, r.arrival, r.prompt_tokens, 1, tuple(keys[b] for b in r.blocks))
        for r in requests
    ]
    outcome, index = run(numbered, 1, 2, "round_robin", block=4)
    gap = walk(numbered, None, 4, "reachable").totals.cached_tokens - outcome.totals.cached_tokens
    assert (gap, index.recomputed_tokens["r0", EVICTED_HERE]) == (0, 4)


def tokens(*values: int) -> list[int]:
    return [v for value in values for v in [value] * 4]


def test_precedence_held_elsewhere_then_evicted_here_then_evicted_elsewhere() -> None:
    index = FleetIndex()
    index.stored("a", [1], None, tokens(7), 4)  # new
    index.removed("a", [1])
    index.stored("b", [2], None, tokens(7), 4)  # a evicted it, none holds it: evicted_elsewhere
    index.stored("a", [3], None, tokens(7), 4)  # a evicted it, b holds it: held_elsewhere wins
    index.removed("b", [2])
    index.removed("a", [3])
    index.stored("a", [4], None, tokens(7), 4)  # both evicted it: evicted_here wins
    index.stored("a", [4], None, tokens(7), 4)  # again: a holds it (duplicate announcement)
    assert [index.recomputed["a", c] for c in CAUSES] == [1, 1, 1, 0, 1, 0]
    assert index.recomputed["b", EVICTED_ELSEWHERE] == 1
    assert index.recomputed_tokens["a", EVICTED_HERE] == 4


def test_a_child_is_keyed_by_its_parents_content_and_an_unknown_parent_is_unknown() -> None:
    index = FleetIndex()
    index.stored("a", [10, 11], None, tokens(1, 2), 4)
    index.stored("b", [20], None, tokens(1), 4)  # same content as a's 10: held elsewhere
    index.stored("b", [21], 20, tokens(2), 4)  # chained after it: a's 11
    index.stored("b", [22], 99, tokens(3), 4)  # parent never seen
    assert index.recomputed["b", HELD_ELSEWHERE] == 2
    assert index.recomputed["b", UNKNOWN] == 1
    index.stored("c", [30], None, tokens(2), 4)  # tokens of 11 but as a first block: another block
    assert index.recomputed["c", NEW] == 1


def test_extra_keys_and_lora_tell_blocks_apart() -> None:
    index = FleetIndex()
    index.stored("a", [1], None, tokens(5), 4, extra_keys=[("cache_salt", "x")])
    index.stored("b", [2], None, tokens(5), 4, extra_keys=[("cache_salt", "y")])
    index.stored("c", [3], None, tokens(5), 4, lora_name="sql")
    index.stored("d", [4], None, tokens(5), 4, extra_keys=[("cache_salt", "x")])
    assert [index.recomputed[r, NEW] for r in "abc"] == [1, 1, 1]
    assert index.recomputed["d", HELD_ELSEWHERE] == 1


def test_cpu_tier_copies_hold_but_are_not_work() -> None:
    index = FleetIndex()
    index.stored("a", [1], None, tokens(5), 4)
    index.stored("a", [1], None, tokens(5), 4, medium="CPU")  # offloaded
    index.removed("a", [1])  # gone from the GPU, still in CPU
    index.stored("b", [2], None, tokens(5), 4)
    index.stored("a", [1], None, tokens(5), 4)  # loaded back from its own CPU tier
    assert index.recomputed["b", HELD_ELSEWHERE] == 1
    assert index.recomputed["a", HELD_HERE] == 1
    assert sum(n for (r, _), n in index.recomputed.items() if r == "a") == 2
    assert index.snapshot().held == {("a", "GPU"): 1, ("a", "CPU"): 1, ("b", "GPU"): 1}


def test_all_blocks_cleared_counts_as_removed_by_the_replica() -> None:
    index = FleetIndex()
    index.stored("a", [1, 2], None, tokens(5, 6), 4)
    index.stored("a", [2], 1, tokens(6), 4)  # a second copy of 2
    index.cleared("a")
    snapshot = index.snapshot()
    assert snapshot.removed == {("a", "GPU"): 3}
    assert snapshot.held == {("a", "GPU"): 0}
    assert snapshot.distinct_blocks == 0
    index.stored("a", [1], None, tokens(5), 4)
    assert index.recomputed["a", EVICTED_HERE] == 1


def test_the_oldest_remembered_blocks_are_forgotten_past_the_cap() -> None:
    index = FleetIndex(remember_blocks=2)
    for engine_hash in (1, 2, 3):
        index.stored("a", [engine_hash], None, tokens(engine_hash), 4)
        index.removed("a", [engine_hash])
    snapshot = index.snapshot()
    assert (snapshot.remembered_blocks, snapshot.forgotten_blocks) == (2, 1)
    for engine_hash in (1, 2, 3):
        index.stored("a", [engine_hash], None, tokens(engine_hash), 4)
    assert index.recomputed["a", NEW] == 3 + 1  # 1 was forgotten: new again
    assert index.recomputed["a", EVICTED_HERE] == 2


def test_held_blocks_past_the_cap_are_classified_but_not_kept() -> None:
    index = FleetIndex(max_held_blocks=2)
    index.stored("a", [1, 2, 3], None, tokens(1, 2, 3), 4)
    assert index.recomputed["a", NEW] == 3
    assert (index.snapshot().untracked_blocks, sum(index.snapshot().held.values())) == (1, 2)


def test_duplicated_blocks_count_holdings_beyond_the_first() -> None:
    index = FleetIndex()
    for replica in "abc":
        index.stored(replica, [1], None, tokens(1), 4)
    assert (index.snapshot().distinct_blocks, index.snapshot().duplicated_blocks) == (1, 2)
    index.removed("b", [1])
    assert (index.snapshot().distinct_blocks, index.snapshot().duplicated_blocks) == (1, 1)


def test_shards_split_the_counts_exactly(requests: list[TraceRequest]) -> None:
    part = requests[:1200]
    _, whole = run(part, 3, 1500, "round_robin")
    shards = [run(part, 3, 1500, "round_robin", index=FleetIndex(shard=(i, 3)))[1] for i in range(3)]
    summed: Counter[tuple[str, str]] = Counter()
    for shard in shards:
        summed.update(shard.recomputed)
    assert summed == whole.recomputed
    assert all(shard.recomputed != whole.recomputed for shard in shards)


# --- the tables ---------------------------------------------------------------------------


def test_engine_hashes_0_and_1_are_blocks_like_any_other() -> None:
    """0 and 1 mark empty and deleted slots inside a table, so those two keys live apart."""
    index = FleetIndex(hashes_alike=True)
    index.stored("a", [0, 1, 2], None, tokens(1, 2, 3), 4)
    index.stored("b", [0], None, tokens(1), 4)
    index.removed("a", [0, 1])
    index.stored("a", [1], None, tokens(2), 4)
    assert (index.holders(0), index.holders(1), index.holders(2)) == (["b"], ["a"], ["a"])
    assert (index.recomputed["b", HELD_ELSEWHERE], index.recomputed["a", EVICTED_HERE]) == (1, 1)
    index.cleared("a")
    assert (index.holders(1), index.snapshot().remembered_blocks) == ([], 3)


class Reference:
    """The rules of the module docstring for one tier and hashes alike, with Python dicts (as
    the index kept them before its tables): what the compiled tables must give exactly."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.holders: dict[int, set[str]] = {}
        self.remembered: dict[int, set[str]] = {}  # insertion order: oldest first
        self.causes: Counter[tuple[str, str]] = Counter()
        self.forgotten = 0

    def stored(self, replica: str, key: int) -> None:
        holders = self.holders.setdefault(key, set())
        before = self.remembered.get(key, set())
        cause = (
            HELD_HERE
            if replica in holders
            else HELD_ELSEWHERE
            if holders
            else NEW
            if key not in self.remembered
            else EVICTED_HERE
            if replica in before
            else EVICTED_ELSEWHERE
        )
        self.causes[replica, cause] += 1
        holders.add(replica)

    def removed(self, replica: str, key: int) -> None:
        holders = self.holders.get(key, set())
        if replica not in holders:
            return
        holders.discard(replica)
        if not holders:
            del self.holders[key]
        if key in self.remembered:
            self.remembered[key].add(replica)
            return
        self.remembered[key] = {replica}
        if len(self.remembered) > self.cap:
            del self.remembered[next(iter(self.remembered))]
            self.forgotten += 1


def test_the_tables_agree_with_plain_dicts_through_growth_deletions_and_forgetting() -> None:
    """Random stores and removals of 3 replicas over 20,000 blocks: the tables grow, fill with
    deleted slots, are rebuilt and shrink, the remembered ring wraps, and every cause, holder
    and count stays what the plain rules give."""
    rng = random.Random(19)
    index, reference = FleetIndex(hashes_alike=True, remember_blocks=5_000), Reference(5_000)
    held: dict[str, set[int]] = {r: set() for r in "abc"}
    for _ in range(3_000):
        replica = rng.choice("abc")
        if rng.random() < 0.55:
            sample = rng.sample(range(20_000), rng.randrange(1, 40))
            keys = [key for key in sample if key not in held[replica]]  # no extra copies here
            index.stored(replica, keys, None, [0] * len(keys), 1)
            for key in keys:
                reference.stored(replica, key)
            held[replica].update(keys)
        elif held[replica]:
            keys = rng.sample(sorted(held[replica]), min(len(held[replica]), rng.randrange(1, 60)))
            index.removed(replica, keys)
            for key in keys:
                reference.removed(replica, key)
            held[replica].difference_update(keys)
    assert index.recomputed == reference.causes
    snapshot = index.snapshot()
    assert snapshot.distinct_blocks == len(reference.holders)
    assert (snapshot.remembered_blocks, snapshot.forgotten_blocks) == (
        len(reference.remembered),
        reference.forgotten,
    )
    assert reference.forgotten > 0
    for key in rng.sample(range(20_000), 500):
        assert set(index.holders(key)) == reference.holders.get(key, set())


def test_memory_stays_within_the_documented_bytes_per_entry() -> None:
    """Measured after every event while 200,000 blocks are stored, then removed: the tables never
    take more than the documented bytes per held (block, replica) at the most held, plus per
    remembered block; once the held ones are gone, the remembered ones cost their bound alone."""
    index = FleetIndex(hashes_alike=True)
    worst_held = worst = 0.0
    for first in range(0, 200_000, 50):
        index.stored("a", list(range(first, first + 50)), None, [0] * 50, 1)
        if first >= 20_000:
            worst_held = max(worst_held, index.memory_bytes() / (first + 50))
    for first in range(0, 200_000, 50):
        index.removed("a", list(range(first, first + 50)))
        remembered = first + 50
        bound = HELD_ENTRY_BYTES * 200_000 + REMEMBERED_ENTRY_BYTES * remembered
        worst = max(worst, index.memory_bytes() / bound)
    assert (index.snapshot().remembered_blocks, index.snapshot().held) == (200_000, {("a", "GPU"): 0})
    assert 40 < worst_held <= HELD_ENTRY_BYTES
    assert 0.5 < worst <= 1
    assert 25 < index.memory_bytes() / 200_000 <= REMEMBERED_ENTRY_BYTES


@pytest.mark.parametrize("remember", [5_000, 1_500])
def test_replicas_cycling_through_the_slots_are_classified_as_the_plain_rules_say(remember: int) -> None:
    """200 replica names come and go, at most 20 at a time (a fleet rolled out again and again,
    each pod a new address): a vanished one's blocks are cleared and its slot forgotten, and a
    new replica on that slot inherits none of its past. The reference keeps every replica's
    history by name, a name that comes back being a new replica (its past life's removals are
    someone else's): the causes, holders and held counts stay exactly what it gives. With fewer
    blocks remembered than the 3,000 used, the oldest are forgotten too: there the vanishing
    replica's blocks are removed first, in the reference's order (a clear remembers them in its
    table's order, which the reference does not model)."""
    rng = random.Random(1919)
    index, reference = FleetIndex(hashes_alike=True, remember_blocks=remember), Reference(remember)
    live: dict[str, str] = {}  # name -> its identity in the reference (name#life)
    lives: Counter[str] = Counter()
    held: dict[str, set[int]] = {}
    pool = [f"10.0.{i // 256}.{i % 256}:5557" for i in range(200)]
    fresh = iter(pool)
    for _ in range(4_000):
        if len(live) < 20 and (len(live) < 5 or rng.random() < 0.05):
            # mostly a new address; now and then one seen before comes back
            gone = [name for name in pool if name not in live and lives[name]]
            name = rng.choice(gone) if gone and rng.random() < 0.2 else next(fresh, None)
            if name is None:
                name = rng.choice(gone)
            lives[name] += 1
            live[name] = f"{name}#{lives[name]}"
            held[name] = set()
            continue
        name = rng.choice(sorted(live))
        if len(live) > 5 and rng.random() < 0.04:
            if remember < 3_000:
                index.removed(name, sorted(held[name]))
            index.cleared(name)
            index.forget_replica(name)
            for key in sorted(held.pop(name)):
                reference.removed(live[name], key)
            del live[name]
            continue
        if rng.random() < 0.6:
            sample = rng.sample(range(3_000), rng.randrange(1, 30))
            keys = [key for key in sample if key not in held[name]]
            index.stored(name, keys, None, [0] * len(keys), 1)
            for key in keys:
                reference.stored(live[name], key)
            held[name].update(keys)
        elif held[name]:
            keys = rng.sample(sorted(held[name]), min(len(held[name]), rng.randrange(1, 40)))
            index.removed(name, keys)
            for key in keys:
                reference.removed(live[name], key)
            held[name].difference_update(keys)
    by_name: Counter[tuple[str, str]] = Counter()
    for (identity, cause), count in reference.causes.items():
        by_name[identity.split("#")[0], cause] += count
    assert sum(lives.values()) > 2 * MAX_REPLICAS and len(lives) > MAX_REPLICAS
    assert any(n > 1 for n in lives.values())
    assert index.recomputed == +by_name
    assert sum(n for (_, cause), n in by_name.items() if cause == EVICTED_ELSEWHERE) > 0
    snapshot = index.snapshot()
    assert snapshot.distinct_blocks == len(reference.holders)
    assert (snapshot.remembered_blocks, snapshot.forgotten_blocks) == (
        len(reference.remembered),
        reference.forgotten,
    )
    assert (reference.forgotten > 0) == (remember < 3_000)
    assert {name for (name, _), n in snapshot.held.items() if n} == {name for name in live if held[name]}
    for key in range(3_000):
        assert {live[name] for name in index.holders(key)} == reference.holders.get(key, set())


def slot_order(index: FleetIndex, replica: str) -> list[int]:
    """The keys of a replica's table in slot order, the two spare rows (keys 0 and 1) last: the
    order a clear removes them in (hashes alike: the key is the engine hash)."""
    rows = index._replicas[replica].table.rows
    size = rows.shape[0] - 3
    probed = [int(key) for key in rows[:size, 0] if key > 1]
    return probed + [spare for spare in (0, 1) if rows[size + spare, 0] == 2]


def well_formed(rows: np.ndarray) -> None:
    """A table's counters are what it holds (used: live keys and tombstones, key 1 in a probed
    slot), and every key is reachable from its home slot: no empty slot lies between the two
    (else a probe for it stops short)."""
    size = rows.shape[0] - 3
    keys = rows[:size, 0]
    occupied = keys != 0
    live = int((keys > 1).sum()) + int((rows[size : size + 2, 0] == 2).sum())
    assert (int(rows[-1, 0]), int(rows[-1, 1])) == (live, int(occupied.sum()))
    slots = np.flatnonzero(keys > 1)
    hashed = (keys[slots] * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(32)  # kernels._home's
    homes = ((hashed * np.uint64(size)) >> np.uint64(32)).astype(np.int64)
    empty = np.flatnonzero(~occupied)  # at least one: a table is never full
    before = empty[np.searchsorted(empty, slots) - 1]  # the last empty slot before each (cyclic)
    assert ((homes - before) % size <= (slots - before) % size).all()
    assert ((homes - before) % size > 0).all()


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32))
def test_the_tables_keep_the_plain_rules_through_clears_lost_replicas_and_growth(seed: int) -> None:
    """Random stores, removals (some of blocks never stored), clears and replicas lost for good,
    a name coming back now and then, with few blocks remembered or many: every table stays well
    formed after every event, grows (doubling while small), is rebuilt and shrinks, and the
    causes, holders and counts are what the plain rules give. A clear (and a lost replica's)
    removes the replica's blocks in its table's slot order, read before it."""
    rng = random.Random(seed)  # a seed a case: hypothesis's own draws would be thousands
    cap = rng.choice([30, 400, 10_000])
    index, reference = FleetIndex(hashes_alike=True, remember_blocks=cap), Reference(cap)
    live: dict[str, str] = {}  # name -> its identity in the reference (name#life)
    lives: Counter[str] = Counter()
    held: dict[str, set[int]] = {}
    universe = rng.choice([300, 1_500])
    for _ in range(150):
        if len(live) < 2 or (len(live) < 6 and rng.random() < 0.05):
            name = rng.choice([n for n in "abcdefg" if n not in live])
            lives[name] += 1
            live[name], held[name] = f"{name}#{lives[name]}", set()
            continue
        name = rng.choice(sorted(live))
        roll = rng.random()
        if roll < 0.08:  # AllBlocksCleared, or the replica is gone for good
            order = slot_order(index, name) if name in index._replicas else []
            if roll < 0.04:
                index.cleared(name)
            else:
                index.forget_replica(name)
            for key in order:
                reference.removed(live[name], key)
            held[name] = set()
            if roll >= 0.04:
                del live[name]
        elif roll < 0.6:
            sample = rng.sample(range(universe), rng.randrange(1, 90))
            keys = [key for key in sample if key not in held[name]]  # no extra copies here
            index.stored(name, keys, None, [0] * len(keys), 1)
            for key in keys:
                reference.stored(live[name], key)
            held[name].update(keys)
        else:
            mine = rng.sample(sorted(held[name]), min(len(held[name]), rng.randrange(0, 90)))
            keys = mine + [key for key in rng.sample(range(universe), 3) if key not in held[name]]
            index.removed(name, keys)
            for key in keys:
                reference.removed(live[name], key)
            held[name].difference_update(keys)
        for table in (index._fleet, index._remembered, *(state.table for state in index._replicas.values())):
            well_formed(table.rows)
    by_name: Counter[tuple[str, str]] = Counter()
    for (identity, cause), count in reference.causes.items():
        by_name[identity.split("#")[0], cause] += count
    assert index.recomputed == +by_name
    snapshot = index.snapshot()
    assert snapshot.distinct_blocks == len(reference.holders)
    assert (snapshot.remembered_blocks, snapshot.forgotten_blocks) == (
        len(reference.remembered),
        reference.forgotten,
    )
    for key in range(universe):
        assert {live[name] for name in index.holders(key)} == reference.holders.get(key, set())


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**32))
def test_forgetting_a_replica_drops_its_bit_from_every_key_of_the_fleet_table(seed: int) -> None:
    """``drop_bit`` walks the fleet table and deletes the keys whose last holder it drops: each
    key has the bit dropped, the ones left with no holder are gone, the rest findable, and the
    table's counters are what it holds."""
    from kvlens.fleet.kernels import rules, table

    rng = random.Random(seed)
    fleet, remembered = table.Table(), table.Table()
    counts = np.zeros(rules.FLEET_COUNTS, np.int64)
    masks: dict[int, int] = {}
    for key in [*rng.sample(range(2**40), rng.randrange(150, 217)), 0, 1]:  # up to 85 % full
        masks[key] = rng.choice([0b01, 0b10, 0b11])
        row, _ = table.find_slot(fleet.rows, np.uint64(key))
        table.insert_at(fleet.rows, row, np.uint64(key), np.uint64(masks[key]))
    counts[rules.DUPLICATED] = sum(mask == 0b11 for mask in masks.values())
    for rows, holders in ((fleet.rows, True), (remembered.rows, False)):  # as forget_replica does
        rules.drop_bit(rows, np.uint64(1), holders, counts, 0, rows.shape[0])
    left = {key: mask & ~1 for key, mask in masks.items() if mask & ~1}
    well_formed(fleet.rows)
    assert fleet.live == len(left)
    assert counts[rules.DUPLICATED] == 0
    for key in masks:
        assert table.lookup(fleet.rows, np.uint64(key)) == (key in left, left.get(key, 0))


def test_more_replicas_than_the_masks_hold_is_an_error_naming_the_replica() -> None:
    index = FleetIndex()
    for number in range(MAX_REPLICAS):
        index.stored(f"r{number}", [1], None, tokens(1), 4)
    assert index.recomputed[f"r{MAX_REPLICAS - 1}", HELD_ELSEWHERE] == 1
    with pytest.raises(ValueError, match="'r64': the index follows at most 64 replicas"):
        index.stored("r64", [1], None, tokens(1), 4)


_M64 = (1 << 64) - 1


def _murmur_mix(h: int) -> int:
    h ^= h >> 33
    h = h * 0xFF51AFD7ED558CCD & _M64
    h ^= h >> 33
    h = h * 0xC4CEB9FE1A85EC53 & _M64
    return h ^ h >> 33


def plain_content_keys(tokens: list[int], size: int, parent: int, extras: list[int]) -> list[int]:
    """The content key as the index's docstring defines it, a block at a time in Python ints:
    FNV-1a-like over the block's tokens, mixed with its extra keys' digest, chained from the
    parent's key, 60 bits."""
    key, keys = parent, []
    for block in range(len(tokens) // size):
        h = 0xCBF29CE484222325
        for token in tokens[block * size : (block + 1) * size]:
            h = (h ^ token) * 0x100000001B3 & _M64
        h = _murmur_mix(h ^ (extras[block] if extras else 0))
        key = _murmur_mix((key * 0x9E3779B97F4A7C15 + h) & _M64) & ((1 << 60) - 1)
        keys.append(key)
    return keys


@pytest.mark.parametrize("lora", [None, "adapter"])
def test_content_keys_are_the_plain_definition_whatever_the_blocks_an_event(lora: str | None) -> None:
    """Events of 1 to 11 blocks (the compiled loop hashes four blocks' tokens at a time, the
    rest one by one), chained from a parent, with and without extra keys: each block is held
    under the key the plain definition gives (the same in every process and version)."""
    rng = random.Random(3)
    index = FleetIndex()
    parent_hash, parent_key, first = 7, 0, 100
    index.stored("a", [parent_hash], None, [5, 6, 7], 3, lora_name=lora)
    extras = [extra_digest(lora, None)] if lora else []
    parent_key = plain_content_keys([5, 6, 7], 3, 0, extras)[0]
    for blocks in range(1, 12):
        tokens = [rng.randrange(1 << rng.choice([7, 16, 32, 64])) for _ in range(blocks * 3)]
        hashes = list(range(first, first + blocks))
        index.stored("a", hashes, parent_hash, tokens, 3, lora_name=lora)
        keys = plain_content_keys(tokens, 3, parent_key, [extra_digest(lora, None)] * blocks if lora else [])
        assert [index.holders(key) for key in keys] == [["a"]] * blocks
        parent_hash, parent_key, first = hashes[-1], keys[-1], first + blocks
