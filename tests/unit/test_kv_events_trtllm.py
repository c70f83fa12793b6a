"""TensorRT-LLM's KV cache events (its ``POST /kv_cache_events`` drains) read into the fleet index.
TensorRT-LLM does not import here (it needs CUDA): the drains are copied payloads in
``KVCacheEventSerializer``'s shape (tests/fixtures/README.md says where from)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvlens.fleet.causes import EVICTED_ELSEWHERE, EVICTED_HERE, HELD_ELSEWHERE, NEW
from kvlens.fleet.index import FleetIndex
from kvlens.fleet.ordering import Consumer, Publisher
from kvlens.fleet.trtllm import TrtllmFeed
from tests import vllm_kv_events as vllm

pytestmark = pytest.mark.timeout(120)  # a drain applied under the index's lock must not take it twice
FIXTURES = Path(__file__).parents[1] / "fixtures" / "trtllm"


def fleet(**index: Any) -> tuple[Consumer, TrtllmFeed, TrtllmFeed]:
    consumer = Consumer(FleetIndex(**index), [])
    return (
        consumer,
        TrtllmFeed(consumer, "t0", "http://t0:8000"),
        TrtllmFeed(consumer, "t1", "http://t1:8000"),
    )


def body(*events: dict[str, Any]) -> bytes:
    return json.dumps(list(events)).encode()


def stored(event_id: int, parent: int | None, *blocks: tuple[int, list[int]], **extra: Any) -> dict[str, Any]:
    return {
        "event_id": event_id,
        "data": {
            "type": "stored",
            "parent_hash": parent,
            "blocks": [
                {
                    "type": "stored_block",
                    "block_hash": block_hash,
                    "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in tokens],
                    "cache_level": 0,
                    "priority": 35,
                }
                for block_hash, tokens in blocks
            ],
        },
        "window_size": 4096,
        **extra,
    }


def test_two_replicas_drains_give_the_causes_as_vllms_events_would() -> None:
    consumer, t0, t1 = fleet(require_cache_salt=True)
    t0.apply_body((FIXTURES / "drain_r0.json").read_bytes())
    t1.apply_body((FIXTURES / "drain_r1.json").read_bytes())
    index = consumer.index
    assert index.recomputed == {
        ("t0", NEW): 3,
        ("t1", HELD_ELSEWHERE): 2,
        ("t1", EVICTED_ELSEWHERE): 1,
        ("t1", NEW): 1,
    }
    assert index.recomputed_tokens[("t1", HELD_ELSEWHERE)] == 8
    snapshot = index.snapshot()
    assert snapshot.held == {("t0", "GPU"): 2, ("t1", "GPU"): 4}
    assert snapshot.unsalted_blocks == {"t0": 2, "t1": 4}  # TensorRT-LLM sends no salt
    assert consumer.status["t0"].events == {
        "AllBlocksCleared": 1,
        "BlockStored": 2,
        "BlockUpdated": 1,
        "BlockRemoved": 1,
    }
    assert (consumer.status["t0"].batches, consumer.status["t0"].gaps, consumer.status["t0"].restarts) == (
        1,
        0,
        0,
    )


def test_gaps_restarts_and_created_clear_as_a_publishers_would() -> None:
    consumer, t0, _ = fleet()
    t0.apply_body(body(stored(0, None, (1, [1, 2]))))
    t0.apply_body(body(stored(5, 1, (2, [3, 4]))))  # events 1-4 lost
    status = consumer.status["t0"]
    assert (status.gaps, status.missed) == (1, 4)
    t0.apply_body(body(stored(0, None, (3, [5, 6]))))  # numbered from 0 again: the engine restarted
    assert status.restarts == 1
    assert consumer.index.snapshot().held == {("t0", "GPU"): 1}
    t0.apply_body(body({"event_id": 1, "data": {"type": "created", "num_blocks_per_cache_level": [8, 0]}}))
    assert consumer.index.snapshot().held == {("t0", "GPU"): 0}


def test_a_smaller_window_a_dp_rank_a_host_copy_and_bad_events() -> None:
    consumer, t0, _ = fleet()
    host = stored(2, None, (3, [1, 2]))
    host["data"]["blocks"][0]["cache_level"] = 1
    t0.apply_body(
        body(
            stored(0, None, (1, [1, 2])),
            stored(1, None, (2, [1, 2]), window_size=512),  # a sliding window's cache: not followed
            host,
            stored(0, None, (9, [1, 2]), attention_dp_rank=1),  # rank 1: a cache, a replica of its own
            {"event_id": 3, "data": {"type": "moved"}},
            {"event_id": 3, "data": {"type": "removed", "block_hashes": "x"}},
        )
    )
    t0.apply_body(b"<html>busy</html>")
    status = consumer.status["t0"]
    assert (status.other_group_events, status.unknown_events, status.malformed_events) == (1, 1, 1)
    assert status.malformed_payloads == 1
    assert consumer.index.snapshot().held == {("t0", "GPU"): 1, ("t0", "CPU"): 1, ("t0/dp1", "GPU"): 1}
    assert consumer.index.recomputed == {("t0", NEW): 1, ("t0/dp1", HELD_ELSEWHERE): 1}


def test_serve_drains_each_server_over_http_into_the_index() -> None:
    """``kvlens serve --kv-events-trtllm t0=URL``: POST URL/kv_cache_events (a local stand-in that
    answers the fixture's drain, then an empty one), no ZeroMQ subscription, the index fed."""
    import asyncio
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from kvlens.cli import parser_of
    from kvlens.cli.common import settings_from
    from kvlens.exporter.aggregator import Aggregator
    from kvlens.exporter.background import BackgroundSources

    drains = [(FIXTURES / "drain_r0.json").read_bytes(), b"[]"]
    paths: list[tuple[str, str]] = []
    drained = threading.Event()

    class Engine(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            paths.append((self.command, self.path))
            answer = drains.pop(0) if drains else b"[]"
            self.send_response(200)
            self.send_header("content-length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)
            if not drains:
                drained.set()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Engine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        argv = ["serve", "--kv-events-trtllm", f"t0=http://127.0.0.1:{server.server_port}/"]
        settings = settings_from(parser_of(argv).parse_args(argv)).model_copy(
            update={"kv_events_trtllm_poll_seconds": 0.01}
        )
        background = BackgroundSources(settings, Aggregator(settings))
        assert background.kv_events is not None and background.kv_events.in_process

        async def run() -> None:
            await background.start()
            await asyncio.to_thread(drained.wait, 30)
            await background.stop()

        asyncio.run(run())
    finally:
        server.shutdown()
        server.server_close()
    assert paths[:2] == [("POST", "/kv_cache_events")] * 2
    kv = background.kv_events
    assert kv.index.recomputed == {("t0", NEW): 3}
    assert kv.consumer.status["t0"].up == 1


def test_an_event_id_jump_past_the_sequence_cap_is_one_jump_not_missed_events() -> None:
    """The rule of a publisher's sequence (kvlens.fleet.ordering.MAX_SEQUENCE_GAP): a forward jump
    wider than any engine sends is garbage or another numbering, counted once, no loss."""
    consumer, t0, _ = fleet()
    t0.apply_body(body(stored(0, None, (1, [1, 2]))))
    t0.apply_body(body(stored(2**62, 1, (2, [3, 4]))))
    status = consumer.status["t0"]
    assert (status.gaps, status.jumps, status.missed, status.restarts) == (0, 1, 0, 0)
    t0.apply_body(body(stored(2**62 + 3, 2, (3, [5, 6]))))  # the numbering goes on from there
    assert (status.gaps, status.jumps, status.missed) == (1, 1, 2)
    assert consumer.index.snapshot().held == {("t0", "GPU"): 3}  # a jump clears nothing


def test_a_drain_is_applied_at_once_in_event_order_while_zeromq_batches_wait_their_window() -> None:
    """The events skip the reorder window (kvlens.fleet.trtllm says why: no timestamp to order them
    by, and one drainer of one ordered queue): a drain's events are applied when it arrives, in
    event_id order, whatever the window; a ZeroMQ replica's batch still waits its window."""
    now = 1_764_600_000.0
    consumer = Consumer(
        FleetIndex(),
        [Publisher("v0", "tcp://v0:5557")],
        reorder_seconds=5.0,
        clock=lambda: 0.0,
        wall_clock=lambda: now,
    )
    t0 = TrtllmFeed(consumer, "t0", "http://t0:8000")
    store = vllm.BlockStored([9], None, [7, 8], 2, None, "GPU", None)
    consumer.message(
        "v0", 0, vllm.encode(vllm.KVEventBatch(ts=now, events=[store], data_parallel_rank=0)), None
    )
    assert consumer.status["v0"].batches == 0  # waiting for the window
    removed = {"event_id": 1, "data": {"type": "removed", "block_hashes": [1]}, "window_size": 4096}
    t0.apply_body(body(stored(0, None, (1, [1, 2])), removed, stored(2, None, (1, [1, 2]))))
    assert consumer.index.recomputed == {("t0", NEW): 1, ("t0", EVICTED_HERE): 1}  # in event_id order
    assert consumer.index.snapshot().held == {("t0", "GPU"): 1}
    assert consumer.status["v0"].batches == 0  # the drain released nothing of the window
    consumer.release(everything=True)
    assert consumer.index.recomputed[("v0", NEW)] == 1
