"""TensorRT-LLM's drain (``POST /kv_cache_events``) from an endpoint that answers what it likes:
numbers it chose must not grow kvlens's memory or its counters without bound."""

from __future__ import annotations

import json
import threading
import time
import tracemalloc
from typing import Any

import pytest

from kvlens.fleet.index import FleetIndex
from kvlens.fleet.limits import MAX_REPLICAS
from kvlens.fleet.ordering import MAX_SEQUENCE_GAP, Consumer
from kvlens.fleet.schema import REMOVED, STORED
from kvlens.fleet.trtllm import MAX_EVENT_BYTES, TrtllmFeed

pytestmark = pytest.mark.timeout(120)


def feed() -> tuple[Consumer, TrtllmFeed]:
    consumer = Consumer(FleetIndex(), [])
    return consumer, TrtllmFeed(consumer, "t0", "http://t0:8000")


def stored(event_id: int, block_hash: int, **extra: Any) -> dict[str, Any]:
    tokens = [{"type": "unique_token", "token_id": 1, "token_extra_id": 0}] * 16
    block = {"type": "stored_block", "block_hash": block_hash, "tokens": tokens, "cache_level": 0}
    data = {"type": "stored", "parent_hash": None, "blocks": [block]}
    return {"event_id": event_id, "data": data, "window_size": 4096, **extra}


def test_an_event_id_far_ahead_is_a_jump_not_missed_events() -> None:
    """Before: an event id of 2^63 - 1 after 0 added 9,223,372,036,854,775,806 missed events to
    kvlens_kv_missed_batches_total (the ZeroMQ streams' rule, a jump past 2^32 counted once as a
    jump, was not followed)."""
    consumer, t0 = feed()
    t0.apply_body(json.dumps([stored(0, 1), stored(2**63 - 1, 2), stored(2**63 - 1 + 3, 3)]).encode())
    status = consumer.status["t0"]
    assert (status.jumps, status.gaps, status.missed) == (1, 1, 2)
    consumer, t0 = feed()
    t0.apply_body(json.dumps([stored(0, 1), stored(MAX_SEQUENCE_GAP + 1, 2)]).encode())
    status = consumer.status["t0"]
    assert (status.jumps, status.gaps, status.missed) == (0, 1, MAX_SEQUENCE_GAP)


def test_attention_dp_ranks_are_bounded() -> None:
    """Before: each attention_dp_rank an event named became a replica with its counters (and a
    series in every per-replica family), refused by the index or not: one 2.3 MiB drain of 20,000
    ranks held 95 MiB (a 64 MiB drain: about 2.6 GiB). A rank outside 0 .. MAX_REPLICAS - 1 (the
    replicas the index can follow) is now a malformed event."""
    consumer, t0 = feed()
    events = [stored(i, i + 1, attention_dp_rank=i) for i in range(20_000)]
    events += [stored(20_000, 7, attention_dp_rank=-1), stored(20_001, 8, attention_dp_rank=2**62)]
    body = json.dumps(events).encode()
    tracemalloc.start()
    try:
        t0.apply_body(body)
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert len(consumer.status) == MAX_REPLICAS
    assert set(consumer.following) == {"t0", *(f"t0/dp{rank}" for rank in range(1, MAX_REPLICAS))}
    assert consumer.status["t0"].malformed_events == 20_002 - MAX_REPLICAS
    assert held < 5 * 2**20


def test_a_drain_hands_the_index_to_a_waiting_scrape_between_events() -> None:
    """Before: a drain's events were all applied under one hold of the index's lock: a 64 MiB
    drain of 547,000 one-block events held it 11 s, and of one block list 7 s, while a scrape
    (and every other replica's events) waited. Now the lock is handed over between events
    (:meth:`kvlens.fleet.lock.IndexLock.pause`, as a clear's slices do)."""
    consumer, t0 = feed()
    index = consumer.index
    got = threading.Event()
    seen: list[bool] = []
    removed = index.removed

    def scrape() -> None:
        with index.lock:
            got.set()

    def watched(replica: str, block_hashes: Any, **kwargs: Any) -> None:
        if not seen:  # the first event: a scrape comes and waits for the lock
            waiter = threading.Thread(target=scrape, daemon=True)
            waiter.start()
            deadline = time.monotonic() + 10
            while not index.lock._waiting and time.monotonic() < deadline:
                time.sleep(0.001)
        seen.append(got.is_set())
        removed(replica, block_hashes, **kwargs)

    index.removed = watched  # type: ignore[method-assign]
    gone = [{"event_id": i, "data": {"type": "removed", "block_hashes": [i]}} for i in range(3)]
    t0.apply_body(json.dumps(gone).encode())
    assert seen == [False, True, True]


def test_an_event_past_its_bound_is_malformed_and_never_decoded() -> None:
    """Before: one ``removed`` event of 8.4M hashes of two bytes each (17 MiB) was decoded into a
    list of 8.4M ints and applied: about 18 bytes of memory a byte of JSON (a 64 MiB drain of one:
    +1,180 MiB and 10 s under the index's lock). An event over MAX_EVENT_BYTES (16 MiB) is counted
    malformed; the events beside it are applied."""
    consumer, t0 = feed()
    count = (MAX_EVENT_BYTES + 2**20) // 2
    huge = b'{"event_id":1,"data":{"type":"removed","block_hashes":[' + b"1," * count + b"1]}}"
    body = (
        b"["
        + json.dumps(stored(0, 5)).encode()
        + b","
        + huge
        + b","
        + json.dumps(stored(2, 6)).encode()
        + b"]"
    )
    tracemalloc.start()
    try:
        t0.apply_body(body)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    status = consumer.status["t0"]
    assert (status.malformed_events, status.events[STORED], status.events[REMOVED]) == (1, 2, 0)
    assert peak < 16 * 2**20
