"""The compiled path (a whole payload read and applied in one call: ``FleetIndex.apply_payload``)
against the event-by-event one (``decode_batch`` then ``apply`` per event, what every payload the
compiled reader is unsure of still takes): on random batches, with broken and unknown events, cut
payloads, duplicate stores, removals then stores in one batch, both leave the same counters, the
same tables (so the same holders) and the same publisher statuses."""

from __future__ import annotations

from collections import Counter
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlens.fleet import schema
from kvlens.fleet.index import FleetIndex
from kvlens.fleet.kernels import msgpack
from kvlens.fleet.ordering import Consumer, Publisher
from kvlens.fleet.simulated import SimulatedEngine
from kvlens.simulate.run import Fleet, simulate
from kvlens.simulate.trace import BUNDLED, MOONCAKE, Trace
from tests import vllm_kv_events as vllm

TS = 1764600000.25
BLOCK = 2  # tokens a block: short events, many of them


class EventByEvent(FleetIndex):
    """The index as before the compiled reader: every payload goes through msgspec."""

    def apply_payload(self, replica: str, payload: bytes) -> list[int] | None:
        return None


class Counting(FleetIndex):
    read = 0

    def apply_payload(self, replica: str, payload: bytes) -> list[int] | None:
        tally = super().apply_payload(replica, payload)
        self.read += tally is not None
        return tally


def rarely(usual: st.SearchStrategy[Any], unusual: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly what the compiled reader reads itself (so that it runs, and stops, often), now and
    then what it leaves to msgspec (the payload then goes the event-by-event way whole)."""
    return st.integers(0, 24).flatmap(lambda n: unusual if n == 0 else usual)


hashes = rarely(
    st.sampled_from([0, 1, 2, 3, 5, 8, 13, 2**63, 2**64 - 1]) | st.integers(-3, -1), st.binary(max_size=9)
)
token = st.sampled_from([0, 1, 127, 128, 255, 300, 65535, 70000, 2**32, 2**63, -1, -200, -40000, -(2**40)])
texts = rarely(st.sampled_from(["GPU", "CPU", "STORAGE", "CPU_PINNED", "DISK", "NVME", ""]), st.just("é"))


@st.composite
def stored_event(draw: st.DrawFn) -> dict[str, Any]:
    block_hashes = draw(st.lists(hashes, max_size=4))
    count = len(block_hashes) * BLOCK + draw(st.sampled_from([0] * 8 + [1, -1]))
    event: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": block_hashes,
        "parent_block_hash": draw(st.none() | hashes),
        "token_ids": draw(st.lists(token, min_size=max(0, count), max_size=max(0, count))),
        "block_size": draw(st.sampled_from([BLOCK] * 8 + [0, -1, 2**40, 2**64 - 1])),
        "lora_id": draw(st.none() | st.integers(0, 3)),
        "medium": draw(st.none() | texts),
        "lora_name": draw(rarely(st.none(), st.just("x"))),
    }
    optional: dict[str, Any] = {
        "extra_keys": rarely(
            st.sampled_from([None, [None] * len(block_hashes), [None]]), st.just([["lora", "x"]])
        ),
        "group_idx": rarely(st.sampled_from([None, 0, 0, 1, -1]), st.just(True)),
        "kv_cache_spec_kind": rarely(st.none() | st.just("full_attention"), st.sampled_from(["é", 3])),
        "kv_cache_spec_sliding_window": st.none() | st.integers(0, 4096),
        "session_id": st.none() | st.text(max_size=3),
        "lookahead_token_ids": rarely(st.none() | st.lists(token, max_size=3), st.just(["x"])),
        "surprise": st.integers(-5, 5),
    }
    for name in draw(st.lists(st.sampled_from(sorted(optional)), max_size=2, unique=True)):
        if name != "surprise" or not draw(st.integers(0, 9)):
            event[name] = draw(optional[name])
    return event


@st.composite
def removed_event(draw: st.DrawFn) -> dict[str, Any]:
    event: dict[str, Any] = {"type": "BlockRemoved", "block_hashes": draw(st.lists(hashes, max_size=4))}
    if draw(st.booleans()):
        event["medium"] = draw(st.none() | texts)
    if draw(st.booleans()):
        event["group_idx"] = draw(st.sampled_from([None, 0, 1]))
    if not draw(st.integers(0, 19)):
        event["ownership"] = draw(st.sampled_from(["local", 7]))
    return event


@st.composite
def shaped(draw: st.DrawFn, event: dict[str, Any]) -> Any:
    """As vLLM sends it (a map, its tag first), SGLang's array, or rarely its fields in another
    order or the array cut short."""
    shape = draw(st.sampled_from(["map"] * 12 + ["array"] * 6 + ["shuffled", "array_cut"]))
    if shape == "shuffled":
        return dict(draw(st.permutations(list(event.items()))))
    if shape.startswith("array"):
        names = schema.FIELD_NAMES[:8] if event["type"] == "BlockStored" else ("block_hashes", "medium")
        values = [event["type"], *(event.get(name) for name in names)]
        return values[: draw(st.integers(1, len(values)))] if shape == "array_cut" else values
    return event


events = rarely(
    st.one_of(
        stored_event(),
        stored_event(),
        stored_event(),
        removed_event(),
        removed_event(),
        st.just({"type": "AllBlocksCleared"}),
    ),
    st.just({"type": "BlockMoved", "block_hashes": [1]})
    | st.just(["AllBlocksCleared", 1])
    | st.integers(-5, 5)
    | st.text(max_size=3)
    | st.none(),
).flatmap(lambda event: shaped(event) if isinstance(event, dict) else st.just(event))


@st.composite
def payload(draw: st.DrawFn) -> bytes:
    batch = draw(st.lists(events, max_size=5))
    envelope: Any = [TS, batch, draw(rarely(st.sampled_from([0, None]), st.just("x")))]
    shape = draw(st.sampled_from(["array"] * 16 + ["map", "short", "cut", "long"]))
    if shape == "map":
        envelope = {"ts": TS, "events": batch}
    elif shape == "short":
        envelope = envelope[:2]
    encoded = msgspec.msgpack.encode(envelope)
    if shape == "cut":
        return encoded[: draw(st.integers(0, len(encoded) - 1))]
    return encoded + b"\x00" if shape == "long" else encoded


def tables(index: FleetIndex) -> list[Any]:
    """Everything the index keeps, array by array (equal tables: equal holders and causes)."""
    state = [index._fleet.rows, index._remembered.rows, index._ring.keys, index._stats, index._counts]
    for name in sorted(index._replicas):
        replica = index._replicas[name]
        state += [name, replica.number, replica.table.rows, replica.copies.rows]
    return state


def same(ours: list[Any], theirs: list[Any]) -> None:
    assert len(ours) == len(theirs)
    for mine, reference in zip(ours, theirs, strict=True):
        if isinstance(mine, np.ndarray):
            np.testing.assert_array_equal(mine, reference)
        else:
            assert mine == reference


@pytest.mark.parametrize("alike", [False, True], ids=["content_keys", "hashes_alike"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from("ab"), payload()), max_size=12))
def test_the_compiled_path_counts_and_holds_what_the_event_by_event_one_does(
    alike: bool, messages: list[tuple[str, bytes]]
) -> None:
    publishers = [Publisher("a", "tcp://a:1"), Publisher("b", "tcp://b:1")]
    # small caps: the remembered ring wraps (forgotten blocks), held blocks pass the cap (untracked)
    caps = {
        "hashes_alike": alike,
        "remember_blocks": 5,
        "max_held_blocks": 9,
        "require_cache_salt": True,
        "sessions": 3,
    }
    compiled = Consumer(Counting(**caps), publishers)
    reference = Consumer(EventByEvent(**caps), publishers)
    seqs = dict.fromkeys("ab", 0)
    for replica, data in messages:
        for consumer in (compiled, reference):
            consumer.message(replica, seqs[replica], data, None)
        seqs[replica] += 1
    assert compiled.status == reference.status
    assert compiled.index.snapshot() == reference.index.snapshot()
    same(tables(compiled.index), tables(reference.index))


def test_the_usual_payloads_take_the_compiled_path_and_the_rest_msgspec() -> None:
    """What the compiled reader reads itself; anything else is left, unchanged, to msgspec."""
    tokens = [1, 2, 300, 70000]
    usual = [
        vllm.BlockStored([1, 2], None, tokens, BLOCK, None, "GPU", None),
        vllm.BlockStored([3], 2, tokens[:2], BLOCK, None, "CPU", None, [None], 0, "full_attention", 0),
        vllm.BlockRemoved([1], "GPU", group_idx=0),
        vllm.AllBlocksCleared(),
    ]
    sglang = [["BlockStored", [4], None, tokens[:2], BLOCK, None, None, None], ["BlockRemoved", [4]]]
    unusual = [
        vllm.BlockStored([b"\x01" * 32], None, tokens[:2], BLOCK, None, "GPU", None),  # bytes hashes
        vllm.BlockStored([5], None, tokens[:2], BLOCK, None, "GPU", "adapter"),  # a LoRA name
        # a salt, as SGLang sends it: a map field (sglang#37482), or a map in lora_name's place
        vllm.SGLangMapStored([5], None, tokens[:2], BLOCK, medium="GPU", cache_salt="tenant-b"),
        vllm.SGLangSaltedStored(
            [5], None, tokens[:2], BLOCK, None, "GPU", metadata=vllm.SGLangBlockStoredMetadata(cache_salt="b")
        ),
        vllm.BlockStored([5], None, tokens[:2], BLOCK, None, "GPU", None, [["lora", "x"]]),
        vllm.BlockStored([5], None, tokens[:2], BLOCK, None, "GPÜ", None),  # not ASCII
        {"block_hashes": [5], "type": "BlockRemoved"},  # the tag not first
        {"type": "BlockRemoved", "block_hashes": [5], "surprise": 1},  # an unknown field
        {"type": "BlockMoved"},
        # a hybrid model's other KV cache groups and kinds (kvlens.fleet.groups)
        vllm.BlockRemoved([1], "GPU", group_idx=1),
        vllm.BlockStored([5], None, tokens[:2], BLOCK, None, "GPU", None, None, 0, "sliding_window"),
    ]
    index = Counting()
    assert index.apply_payload("a", vllm.encode(vllm.KVEventBatch(TS, usual, 0))) == [2, 1, 1, 0]
    assert index.apply_payload("a", msgspec.msgpack.encode([TS, sglang])) == [1, 1, 0, 0]
    before = tables(index)
    for event in unusual:
        assert index.apply_payload("a", msgspec.msgpack.encode([TS, [usual[0], event]])) is None
    same(tables(index), before)


def trace_messages(replicas: int, capacity: int, per_batch: int) -> list[tuple[str, bytes]]:
    """The bundled trace's blocks as vLLM payloads of up to ``per_batch`` events of one replica,
    then each replica evicting all it holds (its table mostly empty: shrunk)."""
    out: list[tuple[str, bytes]] = []
    pending: list[tuple[str, Any]] = []
    held: dict[str, set[int]] = {f"r{i}": set() for i in range(replicas)}

    def flush() -> None:
        if pending:
            out.append((pending[0][0], vllm.encode(vllm.KVEventBatch(TS, [e for _, e in pending], 0))))
            pending.clear()

    def emit(replica: str, event: Any) -> None:
        if pending and (pending[0][0] != replica or len(pending) == per_batch):
            flush()
        pending.append((replica, event))
        if isinstance(event, schema.BlockStored):
            held[replica].update(event.block_hashes)
        else:
            held[replica].difference_update(event.block_hashes)

    engines = [SimulatedEngine(f"r{i}", BLOCK, emit) for i in range(replicas)]
    requests = list(Trace(str(BUNDLED), MOONCAKE, 512).requests())[:400]
    simulate(requests, Fleet(replicas, capacity, 512), "round_robin", events=lambda i: engines[i])
    flush()
    for replica, blocks in held.items():
        ordered = sorted(blocks)
        for start in range(0, len(ordered), 100):
            emit(replica, schema.BlockRemoved(block_hashes=ordered[start : start + 100], medium="GPU"))
        flush()
    return out


@pytest.mark.parametrize("alike", [False, True], ids=["content_keys", "hashes_alike"])
def test_the_bundled_trace_grows_shrinks_and_forgets_alike_on_both_paths(alike: bool) -> None:
    """Thousands of blocks: tables grown and shrunk, the remembered ring wrapped, in the middle
    of payloads (the compiled loop stops, the index grows the table, the loop goes on)."""
    publishers = [Publisher(f"r{i}", "tcp://x:1") for i in range(3)]
    caps = {"hashes_alike": alike, "remember_blocks": 3000, "max_held_blocks": 2500}
    compiled = Consumer(Counting(**caps), publishers)
    reference = Consumer(EventByEvent(**caps), publishers)
    messages = trace_messages(3, 400, per_batch=4)
    seqs: Counter[str] = Counter()
    for replica, data in messages:
        for consumer in (compiled, reference):
            consumer.message(replica, seqs[replica], data, None)
        seqs[replica] += 1
    assert isinstance(compiled.index, Counting) and compiled.index.read == len(messages)
    snapshot = compiled.index.snapshot()
    assert snapshot == reference.index.snapshot()
    assert compiled.status == reference.status
    same(tables(compiled.index), tables(reference.index))
    # what the run went through (the compiled loop stopped 114-119 times to grow a table, 5 to
    # shrink one): every block stored classified, the ring wrapped, the tables emptied at the end
    assert len(messages) == 184 and sum(snapshot.recomputed_blocks.values()) == 9931
    assert (snapshot.forgotten_blocks, snapshot.remembered_blocks, snapshot.distinct_blocks) == (
        6491,
        3000,
        0,
    )


def test_a_payload_past_the_readers_size_is_left_to_msgspec() -> None:
    """The compiled reader allocates arrays as large as the payload (every integer could be a
    byte): past MAX_READ_BYTES (a vLLM step's batch is well under it) msgspec reads it, so that a
    publisher's 64 MiB message costs what it did, not 16 times its size."""
    many = [vllm.BlockStored([n], None, [1, 2], BLOCK, None, "GPU", None) for n in range(1, 12_000)]
    payload = vllm.encode(vllm.KVEventBatch(TS, many, 0))
    assert msgpack.MAX_READ_BYTES < len(payload) < 2 * msgpack.MAX_READ_BYTES
    index = Counting()
    assert index.apply_payload("a", payload) is None
    assert index.apply_payload("a", vllm.encode(vllm.KVEventBatch(TS, many[:6_000], 0))) == [6_000, 0, 0, 0]
    consumer = Consumer(Counting(), [Publisher("a", "tcp://a:1")])
    consumer.message("a", 0, payload, None)
    assert consumer.status["a"].events == {"BlockStored": 11_999}
    assert sum(consumer.index.recomputed.values()) == 11_999
