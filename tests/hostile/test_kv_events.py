"""KV event publishers that misbehave, against a real ``kvlens serve --kv-events``: garbage at
volume, more distinct blocks than the caps, and publishers that stall. Memory stays within the
caps, every bad message is counted, and /metrics keeps answering.

Scaled to this suite's budget: 128 MiB of garbage (not 1 GB) and 1.3M blocks against caps of
200,000 (not 10M against the defaults); the bounds are the same rules at a smaller size."""

from __future__ import annotations

import json
import random
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
import zmq

from kvlens.fleet.limits import HELD_ENTRY_BYTES, REMEMBERED_ENTRY_BYTES
from kvlens.fleet.reorder import MAX_WAITING_BYTES
from tests import vllm_kv_events as vllm
from tests.hostile.conftest import Serve
from tests.kv_publisher import TestPublisher
from tests.live import free_port

pytestmark = pytest.mark.integration
CAP = 200_000


@pytest.fixture
def publisher() -> Iterator[TestPublisher]:
    pub = TestPublisher(free_port())
    yield pub
    pub.close()


def kv_env(pub: TestPublisher, **extra: str) -> dict[str, str]:
    return {"KVLENS_KV_EVENTS": json.dumps([{"name": "r0", "endpoint": pub.endpoint}]), **extra}


def test_a_publisher_sending_garbage_is_counted_and_costs_no_memory(
    serve: Serve, publisher: TestPublisher
) -> None:
    sidecar = serve(**kv_env(publisher))
    publisher.wait_subscribed()
    memory = sidecar.memory()
    memory.reset()
    rng = random.Random(19)
    blobs = [rng.randbytes(64 * 1024) for _ in range(8)]
    messages = 2048  # 128 MiB
    for i in range(messages):
        blob = blobs[rng.randrange(len(blobs))]
        if i % 4 == 3:  # not even the three frames of the protocol
            publisher.pub.send_multipart([b"", blob])
        else:
            publisher.publish(blob[: rng.randrange(1, len(blob))])
    rejected = sidecar.wait_for(
        "kvlens_kv_events_rejected_total", messages, timeout=120, reason="malformed_payload"
    )
    assert rejected == messages
    assert sidecar.value("kvlens_kv_recomputed_tokens_total") == 0
    assert sidecar.value("kvlens_collector_errors_total") == 0
    assert memory.peak_growth_mib() < 64


def stored_batch(first: int, chains: int) -> bytes:
    events = [
        vllm.BlockStored(list(range(start, start + 64)), None, [0] * 64, 1, None, "GPU", None)
        for start in range(first, first + chains * 64, 64)
    ]
    return vllm.encode(vllm.KVEventBatch(ts=1.0, events=events, data_parallel_rank=0))


def removed_batch(first: int, chains: int) -> bytes:
    events = [vllm.BlockRemoved(list(range(first, first + chains * 64)), "GPU")]
    return vllm.encode(vllm.KVEventBatch(ts=1.0, events=events, data_parallel_rank=0))


def test_more_distinct_blocks_than_the_caps_are_forgotten_and_counted(
    serve: Serve, publisher: TestPublisher
) -> None:
    sidecar = serve(
        **kv_env(
            publisher,
            KVLENS_KV_EVENTS_HASHES_ALIKE="true",
            KVLENS_KV_EVENTS_REMEMBER_BLOCKS=str(CAP),
            KVLENS_KV_EVENTS_MAX_HELD_BLOCKS=str(CAP),
        )
    )
    publisher.wait_subscribed()
    memory = sidecar.memory()
    memory.reset()
    block = 0
    for _ in range(1_000_000 // 4096):  # stored then removed: remembered, past the cap forgotten
        publisher.publish(stored_batch(block, 64))
        publisher.publish(removed_batch(block, 64))
        block += 4096
    remembered = block
    for _ in range(300_000 // 4096):  # held and never removed: past the cap not kept
        publisher.publish(stored_batch(block, 64))
        block += 4096
    held = block - remembered
    sent = 2 * (remembered // 4096) + held // 4096
    assert sidecar.wait_for("kvlens_kv_event_batches_total", sent, timeout=300) == sent
    assert sidecar.value("kvlens_kv_recomputed_tokens_total", cause="new") == block
    assert sidecar.value("kvlens_kv_forgotten_blocks_total") == remembered - CAP
    assert sidecar.value("kvlens_kv_remembered_blocks") == CAP
    assert sidecar.value("kvlens_kv_untracked_blocks_total") == held - CAP
    assert sidecar.value("kvlens_kv_blocks_held") == CAP
    # the documented bounds: both caps full at the documented bytes per entry (the fleet's
    # table included in a held entry's), the reorder window's bytes, ZeroMQ's receive queue
    # (1000 messages), and 32 MiB for the allocator
    table = CAP * (HELD_ENTRY_BYTES + REMEMBERED_ENTRY_BYTES)
    queues = MAX_WAITING_BYTES + 1000 * len(stored_batch(0, 64))
    assert memory.peak_growth_mib() < (table + queues) / 2**20 + 32


def test_stalled_publishers_leave_metrics_answering(serve: Serve, publisher: TestPublisher) -> None:
    silent = socket.socket()  # accepts TCP, never speaks ZMQ
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    stalled_router = zmq.Context.instance().socket(zmq.ROUTER)  # a replay endpoint nobody serves
    replay_port = free_port()
    stalled_router.bind(f"tcp://127.0.0.1:{replay_port}")
    try:
        config = [
            {
                "name": "r0",
                "endpoint": publisher.endpoint,
                "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
            },
            {"name": "mute", "endpoint": f"tcp://127.0.0.1:{silent.getsockname()[1]}"},
        ]
        sidecar = serve(KVLENS_KV_EVENTS=json.dumps(config))
        publisher.wait_subscribed()
        publisher.publish(stored_batch(0, 1))
        publisher.drop(stored_batch(64, 1))
        publisher.publish(stored_batch(128, 1))  # a gap: the replay is asked and never answered
        started = time.monotonic()
        answered = 0
        while sidecar.value("kvlens_kv_missed_batches_total", replica="r0") < 1:
            assert time.monotonic() - started < 30
            httpx.get(f"{sidecar.url}/metrics", timeout=5).raise_for_status()
            answered += 1
        assert answered >= 1
        assert sidecar.value("kvlens_kv_replays_total", replica="r0") == 1
        assert sidecar.value("kvlens_kv_publisher_up", replica="mute") == 0
        assert sidecar.value("kvlens_kv_publisher_up", replica="r0") == 1
        assert sidecar.wait_for("kvlens_kv_event_batches_total", 2, replica="r0") == 2
    finally:
        stalled_router.close(0)
        silent.close()
