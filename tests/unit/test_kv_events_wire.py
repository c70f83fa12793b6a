"""KV events as the engines encode them (their own struct definitions, tests/vllm_kv_events.py),
decoded by kvlens; unknown and broken parts counted, never fatal; sequences, gaps, replays and
restarts (the consumer half, without sockets)."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlens.fleet import wire
from kvlens.fleet.causes import EVICTED_HERE, HELD_ELSEWHERE, NEW
from kvlens.fleet.index import FleetIndex
from kvlens.fleet.keys import token_array
from kvlens.fleet.ordering import Consumer, Publisher
from kvlens.fleet.reorder import MAX_WAITING_BYTES
from kvlens.fleet.wire import (
    APPLIED,
    MALFORMED,
    MAX_EPOCH_BYTES,
    MalformedPayload,
    apply,
    decode_batch,
    sglang_epoch,
)
from tests import vllm_kv_events as vllm

TS = 1764600000.25
FIRST = [128000, 128006, 9125, 128007]
SECOND = [65535, 65536, 0, 127]


def stored(hashes: list[Any], parent: Any, tokens: list[int], **extra: Any) -> vllm.BlockStored:
    return vllm.BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=4,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        **extra,
    )


def batch(*events: Any, rank: int | None = 0) -> bytes:
    return vllm.encode(vllm.KVEventBatch(ts=TS, events=list(events), data_parallel_rank=rank))


def tokens_of(event: Any) -> list[int]:
    tokens = token_array(event.token_ids)
    assert tokens is not None
    return [int(t) for t in tokens.astype(np.int64)]


def test_vllm_events_round_trip() -> None:
    payload = batch(
        stored([11, 12], None, FIRST + SECOND, extra_keys=[("cache_salt", "s"), None], group_idx=0),
        vllm.BlockRemoved(block_hashes=[12], medium="GPU"),
        vllm.AllBlocksCleared(),
    )
    assert payload[0] == 0x93  # [ts, events, rank]: the array envelope
    decoded = decode_batch(payload)
    assert (decoded.ts, decoded.data_parallel_rank) == (TS, 0)
    first, second, third = decoded.events
    assert (first.block_hashes, first.parent_block_hash) == ([11, 12], None)
    assert tokens_of(first) == FIRST + SECOND  # left as msgpack by the decoder, read by the index
    assert (first.medium, first.extra_keys, first.group_idx) == ("GPU", [["cache_salt", "s"], None], 0)
    assert (second.block_hashes, second.medium) == ([12], "GPU")
    assert type(third) is wire._Cleared
    assert (decoded.unknown_events, decoded.unknown_fields, decoded.malformed_events) == (0, 0, 0)


def test_bytes_hashes_are_read_as_their_low_64_bits() -> None:
    digest = bytes(range(32))
    index = FleetIndex(hashes_alike=True)
    for event in decode_batch(batch(stored([digest], None, FIRST))).events:
        apply(index, "a", event)
    assert index.holders(int.from_bytes(digest[-8:], "big")) == ["a"]


def test_the_map_envelope_and_sglangs_array_events_decode_alike() -> None:
    sglang = vllm.encode(
        vllm.SGLangEventBatch(
            ts=TS,
            events=[
                vllm.SGLangBlockStored(
                    block_hashes=[1], parent_block_hash=None, token_ids=FIRST, block_size=4, lora_id=None
                ),
                vllm.SGLangBlockRemoved(block_hashes=[1]),
                vllm.SGLangAllBlocksCleared(),
            ],
        )
    )
    as_map = vllm.encode(vllm.MapEventBatch(ts=TS, events=[stored([1], None, FIRST)]))
    assert as_map[0] & 0xF0 == 0x80
    index = FleetIndex()
    events = decode_batch(sglang).events
    assert [type(e) for e in events] == [wire._StoredArray, wire._RemovedArray, wire._ClearedArray]
    assert (events[0].block_hashes, tokens_of(events[0]), events[0].medium) == ([1], FIRST, None)
    for event in [*events, *decode_batch(as_map).events]:
        assert apply(index, "a", event) == APPLIED
    assert index.recomputed["a", NEW] == 1 and index.recomputed["a", EVICTED_HERE] == 1


def test_sglang_0_5_18_salted_stores_decode_and_the_salt_keeps_blocks_apart() -> None:
    """SGLang 0.5.18 sends a salted request's store with a metadata map where vLLM's array has
    lora_name: read, not dropped as malformed, and the salt is part of the block's content (two
    tenants' equal prompts are not one block: the second tenant's store is new, not routing)."""
    unsalted = vllm.SGLang2BlockStored([1], None, FIRST, 4, None, "GPU")
    salted = vllm.SGLangSaltedStored(
        [1], None, FIRST, 4, None, "GPU", metadata=vllm.SGLangBlockStoredMetadata(cache_salt="tenant-b")
    )
    payloads = [
        vllm.encode(vllm.SGLang2EventBatch(TS, [unsalted], 0)),
        vllm.encode(vllm.SGLang2EventBatch(TS, [salted], 0)),
    ]
    index = FleetIndex()
    for replica, payload in zip("ab", payloads, strict=True):
        decoded = decode_batch(payload)
        assert (decoded.malformed_events, decoded.unknown_fields, decoded.data_parallel_rank) == (0, 0, 0)
        for event in decoded.events:
            assert apply(index, replica, event) == APPLIED
    assert index.recomputed == {("a", NEW): 1, ("b", NEW): 1}
    # the same salted store on a third replica is held elsewhere (by b), as content should be
    for event in decode_batch(payloads[1]).events:
        apply(index, "c", event)
    assert index.recomputed["c", HELD_ELSEWHERE] == 1
    # SGLang's host memory and disk tiers are the CPU and STORAGE tiers
    tiers = [
        vllm.SGLang2BlockStored([7], None, SECOND, 4, None, "CPU_PINNED"),
        vllm.SGLang2BlockStored([8], None, SECOND, 4, None, "DISK"),
        vllm.SGLang2BlockRemoved([7], "CPU_PINNED"),
    ]
    for event in decode_batch(vllm.encode(vllm.SGLang2EventBatch(TS, tiers, 0))).events:
        assert apply(index, "d", event) == APPLIED
    snapshot = index.snapshot()
    assert {key: n for key, n in snapshot.stored.items() if key[0] == "d"} == {
        ("d", "CPU"): 1,
        ("d", "STORAGE"): 1,
    }
    assert {key: n for key, n in snapshot.removed.items() if key[0] == "d"} == {("d", "CPU"): 1}


def test_sglang_map_events_carry_the_salt_as_a_field() -> None:
    """After sgl-project/sglang#37482: tagged maps with cache_salt and session_id; both known
    (not counted as unknown fields), the salt part of the content."""
    plain = vllm.SGLangMapStored([1], None, FIRST, 4, medium="GPU")
    salted = vllm.SGLangMapStored([1], None, FIRST, 4, medium="GPU", cache_salt="tenant-b", session_id="s1")
    index = FleetIndex()
    for replica, event in (("a", plain), ("b", salted)):
        decoded = decode_batch(vllm.encode(vllm.SGLang2EventBatch(TS, [event], 0)))
        assert (decoded.malformed_events, decoded.unknown_fields) == (0, 0)
        for read in decoded.events:
            assert apply(index, replica, read) == APPLIED
    assert index.recomputed == {("a", NEW): 1, ("b", NEW): 1}


class FutureStored(vllm.KVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    priority: int = 0  # a field a later vLLM might add


class BlockPinned(vllm.KVCacheEvent):
    block_hashes: list[int]


def test_unknown_fields_and_event_types_are_counted_and_skipped() -> None:
    future = FutureStored([5], None, FIRST, 4, None, "GPU", None, priority=3)
    payload = vllm.encode(
        vllm.EventBatch(
            ts=TS, events=[BlockPinned([5]), future, stored([6], 5, SECOND)], data_parallel_rank=0
        )
    )
    decoded = decode_batch(payload)
    assert (decoded.unknown_events, decoded.unknown_fields, decoded.malformed_events) == (1, 1, 0)
    assert [e.block_hashes for e in decoded.events] == [[5], [6]]  # the future one's known fields


def test_a_malformed_event_is_dropped_and_a_malformed_payload_raises() -> None:
    bad = vllm.encode({"type": "BlockStored", "block_hashes": "not a list", "parent_block_hash": None})
    payload = vllm.encode([TS, [msgspec.Raw(bad), msgspec.Raw(vllm.encode(stored([1], None, FIRST)))], 0])
    decoded = decode_batch(payload)
    assert (decoded.malformed_events, len(decoded.events)) == (1, 1)
    for garbage in (b"", b"\xc1", b"\x93\x01", vllm.encode({"events": 3}), b"\xff" * 64):
        with pytest.raises(MalformedPayload):
            decode_batch(garbage)


def test_a_block_whose_tokens_do_not_fill_it_is_refused() -> None:
    index = FleetIndex()
    (event,) = decode_batch(batch(stored([1, 2], None, FIRST))).events  # 4 tokens for 2 blocks
    assert apply(index, "a", event) == MALFORMED
    assert index.recomputed == {}


# --- the consumer: sequences ------------------------------------------------------------------


def consumer() -> Consumer:
    return Consumer(FleetIndex(), [Publisher("a", "tcp://a:5557"), Publisher("b", "tcp://b:5557")])


def test_a_gap_without_replay_is_counted_as_missed_batches() -> None:
    c = consumer()
    c.message("a", 0, batch(stored([1], None, FIRST)), None)
    c.message("a", 3, batch(stored([2], 1, SECOND)), None)
    status = c.status["a"]
    assert (status.gaps, status.missed, status.replays, status.batches) == (1, 2, 0, 2)


def test_a_gap_is_repaired_from_the_replay_endpoint() -> None:
    c = consumer()
    buffered = {1: batch(stored([1], None, FIRST)), 2: batch(vllm.BlockRemoved([1], "GPU"))}
    asked: list[int] = []

    def replay(first: int) -> list[tuple[int, bytes]]:
        asked.append(first)
        return [(seq, payload) for seq, payload in sorted(buffered.items()) if seq >= first]

    c.message("a", 0, batch(), replay)
    c.message("a", 3, batch(stored([1], None, FIRST)), replay)
    status = c.status["a"]
    assert asked == [1]
    assert (status.gaps, status.missed, status.replays, status.replayed) == (1, 0, 1, 2)
    assert c.index.recomputed["a", EVICTED_HERE] == 1  # stored, removed (replayed), stored again


def test_a_replay_that_misses_part_of_the_gap_leaves_it_unrepaired() -> None:
    c = consumer()
    c.message("a", 0, batch(), None)
    c.message("a", 4, batch(), lambda first: [(2, batch()), (3, batch())])  # 1 is gone
    status = c.status["a"]
    assert (status.gaps, status.missed, status.replayed) == (1, 3, 0)


def test_a_publisher_restart_empties_that_replica_only() -> None:
    c = consumer()
    c.message("a", 0, batch(stored([1], None, FIRST)), None)
    c.message("b", 0, batch(stored([9], None, FIRST)), None)
    c.message("a", 1, batch(), None)
    c.message("a", 0, batch(), None)  # the engine restarted: sequences begin again
    assert c.status["a"].restarts == 1
    assert c.index.snapshot().held == {("a", "GPU"): 0, ("b", "GPU"): 1}
    c.message("a", 1, batch(stored([1], None, FIRST)), None)
    assert c.index.recomputed["a", HELD_ELSEWHERE] == 1


def test_malformed_payloads_and_events_are_counted_per_publisher() -> None:
    c = consumer()
    c.message("a", 0, b"\xc1\xc1", None)
    c.message("a", 1, batch(stored([1, 2], None, FIRST)), None)  # tokens do not fill two blocks
    c.message("a", 2, batch(BlockPinned([1])), None)
    status = c.status["a"]
    assert (status.malformed_payloads, status.malformed_events, status.unknown_events) == (1, 1, 1)
    assert status.events == {"BlockStored": 1}


# --- ordering across publishers -----------------------------------------------------------------


def at(ts: float, *events: Any) -> bytes:
    return vllm.encode(vllm.KVEventBatch(ts=ts, events=list(events), data_parallel_rank=0))


def test_without_a_window_batches_apply_in_arrival_order() -> None:
    c = consumer()
    c.message("a", 0, at(10.2, stored([1], None, FIRST)), None)
    c.message("b", 0, at(10.1, stored([2], None, FIRST)), None)  # older, arrived later
    assert c.index.recomputed == {("a", NEW): 1, ("b", HELD_ELSEWHERE): 1}


def test_with_a_window_batches_of_replicas_apply_in_timestamp_order() -> None:
    now = [0.0]
    c = Consumer(
        FleetIndex(),
        [Publisher("a", "tcp://a:5557"), Publisher("b", "tcp://b:5557")],
        reorder_seconds=0.5,
        clock=lambda: now[0],
    )
    c.message("a", 0, at(10.2, stored([1], None, FIRST)), None)
    c.message("b", 0, at(10.1, stored([2], None, FIRST)), None)
    assert c.index.recomputed == {}  # both wait
    c.message("a", 1, at(10.65, stored([3], None, SECOND)), None)  # 0.5 s newer than 10.1 only
    assert c.index.recomputed == {("b", NEW): 1}
    c.message("b", 1, at(10.71, stored([4], None, [7] * 4)), None)  # and than 10.2
    assert c.index.recomputed == {("b", NEW): 1, ("a", HELD_ELSEWHERE): 1}
    now[0] = 0.49
    c.release()
    assert c.status["a"].batches == 1
    now[0] = 0.5
    c.release()  # waited the window by kvlens's clock: applied, busy or idle
    assert c.index.recomputed == {("b", NEW): 2, ("a", HELD_ELSEWHERE): 1, ("a", NEW): 1}


def test_a_replica_whose_clock_steps_back_keeps_its_order() -> None:
    c = Consumer(FleetIndex(), [Publisher("a", "tcp://a:5557")], reorder_seconds=1.0, clock=lambda: 0.0)
    c.message("a", 0, at(5.0, stored([1], None, FIRST)), None)
    c.message("a", 1, at(4.0, vllm.BlockRemoved([1], "GPU")), None)  # its clock went back
    c.release(everything=True)
    assert c.index.snapshot().held == {("a", "GPU"): 0}
    assert c.index.unknown_removed == 0


def test_the_reorder_window_holds_a_bounded_number_of_bytes() -> None:
    c = Consumer(FleetIndex(), [Publisher("a", "tcp://a:5557")], reorder_seconds=60.0, clock=lambda: 0.0)
    big = at(1.0, stored(list(range(1, 100_001)), None, [70_000] * 400_000))  # ts never moves
    assert 1 << 20 < len(big) < MAX_WAITING_BYTES
    held_back = MAX_WAITING_BYTES // len(big)
    for seq in range(held_back + 3):
        c.message("a", seq, big, None)
    assert c.status["a"].batches == 3  # the oldest applied to stay within the bound
    c.release(everything=True)
    assert c.status["a"].batches == held_back + 3


def test_a_payload_whose_stamp_reads_but_events_do_not_is_counted_when_applied() -> None:
    c = consumer()
    c.message("a", 0, vllm.encode([1.0, "not a list of events", 0]), None)
    assert (c.status["a"].batches, c.status["a"].malformed_payloads) == (1, 1)


def test_kvlens_publishes_the_bytes_vllm_does() -> None:
    """kvlens's copy of vLLM's structs (what ``simulate serve`` publishes with) encodes exactly as
    the engine's own definitions do, defaults left out alike."""
    from kvlens.fleet import schema

    def both(cls: str, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        return getattr(schema, cls)(*args, **kwargs), getattr(vllm, cls)(*args, **kwargs)

    cases = [
        both("BlockStored", [1, 2], None, FIRST + SECOND, 4, None, "GPU", None),
        both(
            "BlockStored",
            [b"\x01" * 32],
            7,
            FIRST,
            4,
            3,
            "CPU",
            "sql",
            extra_keys=[("cache_salt", "s")],
            group_idx=1,
        ),
        both("BlockRemoved", [1, 2], "GPU"),
        both("BlockRemoved", [1], None, group_idx=2, locality="LOCAL"),
        both("AllBlocksCleared"),
    ]
    ours = schema.KVEventBatch(ts=TS, events=[c[0] for c in cases], data_parallel_rank=3)
    theirs = vllm.KVEventBatch(ts=TS, events=[c[1] for c in cases], data_parallel_rank=3)
    assert msgspec.msgpack.Encoder().encode(ours) == vllm.encode(theirs)


# --- fuzz: outside bytes never crash the consumer ---------------------------------------------

msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=16),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=12), inner, max_size=6),
    max_leaves=30,
)
event_like = st.fixed_dictionaries(
    {"type": st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Other"])},
    optional={
        "block_hashes": st.lists(st.integers(0, 2**64 - 1) | st.binary(max_size=32), max_size=4),
        "parent_block_hash": st.none() | st.integers(0, 2**64 - 1),
        "token_ids": st.lists(st.integers(-1, 2**40), max_size=16),
        "block_size": st.integers(-2, 8),
        "medium": st.none() | st.sampled_from(["GPU", "CPU", ""]),
        "extra_keys": st.none() | st.lists(msgpack_values, max_size=4),
        "lora_name": st.none() | st.text(max_size=4),
        "surprise": msgpack_values,
    },
)


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=200),
        msgpack_values.map(vllm.encode),
        st.lists(event_like, max_size=5).map(lambda events: vllm.encode([TS, events, 0])),
        st.lists(msgpack_values, max_size=5).map(lambda events: vllm.encode([TS, events])),
    )
)
def test_any_payload_is_read_or_counted_never_raised(payload: bytes) -> None:
    c = consumer()
    c.message("a", 0, payload, None)
    c.release(everything=True)
    status = c.status["a"]
    assert status.batches == 1
    if status.malformed_payloads == 0:  # an EventBatch: each event read, skipped or dropped
        events = msgspec.msgpack.decode(payload)
        events = events[1] if isinstance(events, list) else events["events"]
        read = sum(status.events.values())
        assert read + status.unknown_events + status.malformed_events >= len(events)


def test_a_medium_outside_vllms_tiers_is_labelled_other() -> None:
    c = consumer()
    for seq, medium in enumerate(["GPU", "CPU", "STORAGE", "x" * 100, "NVME", None]):
        event = vllm.BlockStored([seq + 1], None, FIRST, 4, None, medium, None)
        c.message("a", seq, batch(event), None)
    stored = c.index.snapshot().stored
    assert stored == {("a", "GPU"): 2, ("a", "CPU"): 1, ("a", "STORAGE"): 1, ("a", "other"): 2}


def test_only_the_first_kv_cache_group_is_followed() -> None:
    c = consumer()
    c.message(
        "a", 0, batch(stored([1], None, FIRST, group_idx=0), stored([1], None, FIRST, group_idx=1)), None
    )
    c.message("a", 1, batch(vllm.BlockRemoved([1], "GPU", group_idx=1)), None)
    assert c.index.recomputed == {("a", NEW): 1}
    assert c.index.snapshot().held == {("a", "GPU"): 1}
    assert c.status["a"].other_group_events == 2


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(-(2**63), 2**64 - 1), max_size=40))
def test_token_ids_read_from_msgpack_equal_the_decoded_list(values: list[int]) -> None:
    """Every msgpack integer form (fixint, negative fixint, uint8-64, int8-64; array16 past 15)
    read in place gives what decoding to a list gives, negative ids in two's complement."""
    raw = msgspec.Raw(msgspec.msgpack.encode(values))
    from_raw, from_list = token_array(raw), token_array(values)
    assert from_raw is not None and from_list is not None
    assert from_raw.tolist() == from_list.tolist() == [v & (2**64 - 1) for v in values]


@pytest.mark.parametrize(
    "value",
    [[1, "2"], [1.5], [[1]], [None], {"a": 1}, "1", 7, b"\x01"],
    ids=["str", "float", "nested", "nil", "map", "string", "int", "bin"],
)
def test_token_ids_that_are_not_integers_make_the_event_malformed(value: Any) -> None:
    raw = msgspec.Raw(msgspec.msgpack.encode(value))
    assert token_array(raw) is None
    event = decode_batch(batch(stored([1], None, FIRST))).events[0]
    assert apply(FleetIndex(), "a", msgspec.structs.replace(event, token_ids=raw)) == MALFORMED


def test_truncated_and_long_token_arrays_are_refused() -> None:
    encoded = msgspec.msgpack.encode(list(range(100, 140)) + [70_000] * 20)  # array16, uint32s
    assert encoded[0] == 0xDC
    assert token_array(msgspec.Raw(encoded)) is not None
    for cut in (1, 2, 3, 50, len(encoded) - 1):
        assert token_array(msgspec.Raw(encoded[:cut])) is None
    assert token_array(msgspec.Raw(encoded + b"\x01")) is None  # a byte past the array


@pytest.mark.parametrize("size", [0, -4, 2**31 + 1, 2**64 + 4])
def test_a_block_size_out_of_range_makes_the_event_malformed(size: int) -> None:
    event = decode_batch(batch(stored([1], None, FIRST))).events[0]
    index = FleetIndex()
    assert apply(index, "a", msgspec.structs.replace(event, block_size=size)) == MALFORMED
    assert index.recomputed == {}


# --- SGLang's lifecycles (epochs) and snapshot barriers --------------------------------------


def test_sglangs_epoch_is_read_from_live_and_barrier_topics() -> None:
    assert sglang_epoch(vllm.sglang_live_topic(b"kv", "e1")) == b"e1"
    assert sglang_epoch(vllm.sglang_barrier_topic(b"kv", "e1", "b7")) == b"e1"
    assert sglang_epoch(b"kv") is None
    assert sglang_epoch(vllm.sglang_live_topic(b"", "")) is None
    assert sglang_epoch(vllm.sglang_live_topic(b"", "x" * MAX_EPOCH_BYTES)) == b"x" * MAX_EPOCH_BYTES
    assert sglang_epoch(vllm.sglang_live_topic(b"", "x" * (MAX_EPOCH_BYTES + 1))) is None


def test_a_barrier_is_an_empty_batch_in_the_sequence() -> None:
    c = consumer()
    c.message("a", 0, batch(stored([1], None, FIRST)), None, b"e1")
    c.message("a", 1, vllm.sglang_barrier(TS), None, b"e1")
    c.message("a", 2, batch(vllm.BlockRemoved([1], "GPU")), None, b"e1")
    status = c.status["a"]
    assert (status.batches, status.gaps, status.restarts, status.malformed_payloads) == (3, 0, 0, 0)
    assert c.index.snapshot().held[("a", "GPU")] == 0


def test_a_new_epoch_is_a_restart_however_its_sequence_runs() -> None:
    c = consumer()
    c.message("a", 0, batch(stored([1], None, FIRST)), None, b"e1")
    c.message("b", 0, batch(stored([9], None, FIRST)), None, b"f1")
    c.message("a", 1, batch(), None, b"e2")  # the next number, but of a new lifecycle: 0 was lost
    status = c.status["a"]
    assert (status.restarts, status.gaps, status.missed) == (1, 1, 1)
    assert c.index.snapshot().held == {("a", "GPU"): 0, ("b", "GPU"): 1}
    c.message("a", 0, batch(), None, b"e3")  # a new lifecycle whose sequence also went back: one restart
    assert (status.restarts, status.gaps) == (2, 1)
    c.message("a", 1, batch(), None, None)  # a topic without an epoch keeps the last one known
    c.message("a", 2, batch(), None, b"e3")
    assert (status.restarts, status.gaps, status.batches) == (2, 1, 5)


def test_the_first_epoch_seen_and_a_comeback_after_vanishing_are_no_restart() -> None:
    c = consumer()
    c.message("a", 7, batch(), None, b"e1")  # kvlens started after the publisher
    c.vanished("a")
    c.add(Publisher("a", "tcp://a:5557"))
    c.message("a", 0, batch(), None, b"e2")
    assert (c.status["a"].restarts, c.status["a"].gaps) == (0, 0)


def test_a_hybrid_models_prefix_is_held_only_where_every_full_attention_group_holds_it() -> None:
    """vLLM 0.33's hybrid model (two full-attention groups, a sliding-window and a Mamba group),
    its events encoded with vLLM's own structs: a removal from any full-attention group ends the
    hit; the other kinds' events change nothing held; the stores of one group are followed."""
    c = consumer()
    kinds = ["full_attention", "mla_attention", "sliding_window", "mamba"]
    c.message(
        "a",
        0,
        batch(
            *(
                stored([1, 2], None, FIRST + SECOND, group_idx=g, kv_cache_spec_kind=k)
                for g, k in enumerate(kinds)
            )
        ),
        None,
    )
    assert c.index.recomputed == {("a", NEW): 2}
    assert c.index.snapshot().held == {("a", "GPU"): 2}
    c.message(
        "a",
        1,
        batch(vllm.BlockRemoved([1], "GPU", group_idx=2), vllm.BlockRemoved([1], "GPU", group_idx=3)),
        None,
    )
    assert c.index.snapshot().held == {("a", "GPU"): 2}  # a window's or a state's eviction: still a prefix
    c.message("a", 2, batch(vllm.BlockRemoved([2], "GPU", group_idx=1)), None)
    assert c.index.snapshot().held == {("a", "GPU"): 1}  # group 1 lost it: no hit on block 2 here
    c.message("a", 3, batch(stored([2], 1, SECOND, group_idx=0, kv_cache_spec_kind="full_attention")), None)
    assert c.index.recomputed == {("a", NEW): 2, ("a", EVICTED_HERE): 1}
    assert c.status["a"].other_group_events == 5  # groups 1-3's stores, groups 2-3's removals


def test_a_hybrid_model_whose_first_group_is_a_sliding_window_follows_its_full_attention_group() -> None:
    c = consumer()
    window = stored([1], None, FIRST, group_idx=0, kv_cache_spec_kind="sliding_window")
    full = stored([1], None, FIRST, group_idx=1, kv_cache_spec_kind="full_attention")
    c.message("a", 0, batch(window, full), None)
    c.message("a", 1, batch(vllm.BlockRemoved([1], "GPU", group_idx=0)), None)  # the window's: no loss
    assert c.index.recomputed == {("a", NEW): 1}
    assert c.index.snapshot().held == {("a", "GPU"): 1}
    assert c.index.unknown_removed == 0


def test_a_removal_of_one_copy_leaves_the_chain_another_copy_backs() -> None:
    """vLLM #55092's case, as vLLM 0.33's block pool publishes it: request A caches H1 -> H2 -> H3;
    the same prompt again recomputes its last block, a second physical copy of H3; request B
    extends the chain to H5. Evicting A's copy of H3 announces BlockRemoved(H3), while the other
    copy still backs the chain: the replica still holds H1..H5 (another replica storing them
    finds all five held elsewhere); the second removal ends it."""
    c = consumer()
    third = [9, 8, 7, 6]
    c.message("a", 0, batch(stored([1, 2, 3], None, FIRST + SECOND + third)), None)
    c.message("a", 1, batch(stored([3], 2, third)), None)  # the recomputed last block: a copy
    c.message("a", 2, batch(stored([4, 5], 3, FIRST + SECOND)), None)
    c.message("a", 3, batch(vllm.BlockRemoved([3], "GPU")), None)
    assert c.index.snapshot().held == {("a", "GPU"): 5}
    c.message("b", 0, batch(stored([1, 2, 3, 4, 5], None, FIRST + SECOND + third + FIRST + SECOND)), None)
    assert c.index.recomputed[("b", HELD_ELSEWHERE)] == 5
    c.message("a", 4, batch(vllm.BlockRemoved([3], "GPU")), None)
    assert c.index.snapshot().held == {("a", "GPU"): 4, ("b", "GPU"): 5}
    assert c.index.unknown_removed == 0


def removal(hashes: list[int], left: list[int]) -> dict[str, Any]:
    """vLLM #48933's BlockRemoved (open upstream): each hash's physical copies left after it."""
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", "remaining_copy_counts": left}


def test_remaining_copy_counts_say_how_many_copies_stay() -> None:
    """With the counts a removal is exact whatever the engine's policy: one announced after the
    last copy went (vLLM #55092's fix) drops every copy kvlens holds; a count kvlens cannot reach
    (it missed a store) removes nothing more; a count per hash or the event is malformed."""
    c = consumer()
    c.message("a", 0, batch(stored([1, 2], None, FIRST + SECOND)), None)
    c.message("a", 1, batch(stored([2], 1, SECOND), stored([2], 1, SECOND)), None)  # 3 copies of 2
    c.message("a", 2, batch(removal([2], [2])), None)
    assert c.index.snapshot().held == {("a", "GPU"): 3}  # block 1, and 2 copies of block 2
    c.message("a", 3, batch(removal([2], [0])), None)  # the last copy went: all of them
    assert c.index.snapshot().held == {("a", "GPU"): 1}
    c.message("a", 4, batch(removal([1], [3]), removal([1, 2], [0])), None)
    assert c.index.snapshot().held == {("a", "GPU"): 1}
    assert c.status["a"].malformed_events == 1
    c.message("a", 5, batch(stored([2], 1, SECOND)), None)
    assert c.index.recomputed[("a", EVICTED_HERE)] == 1


@pytest.mark.parametrize("capacity", [2, 1])
def test_each_sessions_stores_are_kept_by_cause_for_the_per_request_view(capacity: int) -> None:
    """vLLM 0.33's session_id on BlockStored: the last sessions' GPU stores by cause, bounded."""
    c = Consumer(
        FleetIndex(sessions=capacity), [Publisher("a", "tcp://a:5557"), Publisher("b", "tcp://b:5557")]
    )
    c.message("a", 0, batch(stored([1, 2], None, FIRST + SECOND, session_id="s1")), None)
    c.message("b", 0, batch(stored([1, 2], None, FIRST + SECOND, session_id="s2")), None)
    c.message(
        "b",
        1,
        batch(stored([3], 2, FIRST, session_id="s2"), stored([4], None, SECOND, session_id="x" * 257)),
        None,
    )
    sessions = c.index.sessions
    assert sessions is not None
    view = sessions.get("s2")
    assert view is not None and view.replica == "b"
    assert view.tokens == {
        NEW: 4,
        EVICTED_HERE: 0,
        HELD_ELSEWHERE: 8,
        "evicted_elsewhere": 0,
        "held_here": 0,
        "unknown": 0,
    }
    first = sessions.get("s1")
    assert (first is None) == (capacity == 1)
    assert first is None or first.tokens[NEW] == 8
    assert (sessions.too_long, sessions.forgotten) == (1, capacity == 1)
    assert c.index.recomputed == {("a", NEW): 2, ("b", HELD_ELSEWHERE): 2, ("b", NEW): 2}
