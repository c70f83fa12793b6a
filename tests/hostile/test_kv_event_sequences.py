"""A KV event publisher whose sequence numbers jump by millions, then by 2^62, with a replay
endpoint configured, against a real ``kvlens serve --kv-events``. (Garbage payloads, the caps
and stalled publishers are in test_kv_events.py.)

A gap wider than any replay buffer (MAX_REPLAY_FRAMES) cannot be repaired: it is counted as
missed at once, without asking and without building the list of the numbers it lacks (before:
a jump of 2^22 built a list of 4M ints, about 160 MiB by arithmetic; one of 2^62 raised
MemoryError out of the handler and the batch was lost, which this test saw). A jump past 2^32
(2^62, 2^63 - 1: no engine sends that many batches) is one jump, not that many missed batches
(before: missed_batches_total went to 2^63 - 3, where no further +1 shows)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import zmq

from kvlens.fleet.replay import MAX_REPLAY_FRAMES
from tests.hostile.conftest import Serve
from tests.hostile.test_kv_events import stored_batch
from tests.kv_publisher import TestPublisher
from tests.live import free_port

pytestmark = pytest.mark.integration


@pytest.fixture
def publisher() -> Iterator[TestPublisher]:
    pub = TestPublisher(free_port(), replay_port=free_port())
    yield pub
    pub.close()


def jump_to(publisher: TestPublisher, seq: int) -> None:
    with publisher._lock:
        publisher.seq = seq


def test_a_sequence_jumping_past_any_replay_buffer_is_missed_not_built(
    serve: Serve, publisher: TestPublisher
) -> None:
    config = [{"name": "r0", "endpoint": publisher.endpoint, "replay_endpoint": publisher.replay_endpoint}]
    sidecar = serve(KVLENS_KV_EVENTS=json.dumps(config))
    publisher.wait_subscribed()
    publisher.publish(stored_batch(0, 1))
    publisher.drop(stored_batch(64, 1))
    publisher.publish(stored_batch(128, 1))  # a gap of one: repaired from the replay endpoint
    assert sidecar.wait_for("kvlens_kv_event_batches_total", 3, replica="r0") == 3
    memory = sidecar.memory()
    memory.reset()
    jump_to(publisher, 2**22)
    publisher.publish(stored_batch(192, 1))  # 2^22 - 3 lost
    jump_to(publisher, 2**62)
    publisher.publish(stored_batch(256, 1))  # no engine sends 2^62 batches: a jump, not a loss
    jump_to(publisher, 2**63 - 1)
    publisher.publish(stored_batch(320, 1))
    assert sidecar.wait_for("kvlens_kv_event_batches_total", 6, replica="r0") == 6
    assert sidecar.value("kvlens_kv_sequence_gaps_total", replica="r0") == 2
    assert sidecar.value("kvlens_kv_sequence_jumps_total", replica="r0") == 2
    assert sidecar.value("kvlens_kv_replays_total", replica="r0") == 1  # the gaps past the buffer: none
    assert sidecar.value("kvlens_kv_replayed_batches_total", replica="r0") == 1
    # before: 2^63 - 3 missed, a counter on which no further +1 shows (2^53 and past)
    assert sidecar.value("kvlens_kv_missed_batches_total", replica="r0") == 2**22 - 3
    assert sidecar.value("kvlens_kv_events_rejected_total", replica="r0", reason="error") == 0
    assert sidecar.value("kvlens_kv_recomputed_tokens_total") == 6 * 64
    assert memory.peak_growth_mib() < 16
    assert MAX_REPLAY_FRAMES < 2**22 - 3


def test_a_dead_replay_endpoint_is_asked_once_not_at_every_gap(serve: Serve) -> None:
    # A publisher that skips a number in every message, its replay endpoint bound and silent: each
    # replay held the one subscriber thread replay_timeout_seconds (2 s), so 10 gaps held every
    # other publisher's batches 20 s. After one replay that repaired nothing, the publisher's gaps
    # are missed without asking for REPLAY_QUIET_TIMEOUTS timeouts.
    silent_router = zmq.Context.instance().socket(zmq.ROUTER)
    replay_port = free_port()
    silent_router.bind(f"tcp://127.0.0.1:{replay_port}")
    gappy, steady = TestPublisher(free_port()), TestPublisher(free_port())
    try:
        config = [
            {
                "name": "gappy",
                "endpoint": gappy.endpoint,
                "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
            },
            {"name": "steady", "endpoint": steady.endpoint},
        ]
        sidecar = serve(KVLENS_KV_EVENTS=json.dumps(config))
        gappy.wait_subscribed()
        steady.wait_subscribed()
        gappy.publish(stored_batch(0, 1))
        for number in range(1, 11):
            gappy.drop(stored_batch(number * 128, 1))
            gappy.publish(stored_batch(number * 128 + 64, 1))
            steady.publish(stored_batch(10_000 + number * 64, 1))
        assert sidecar.wait_for("kvlens_kv_event_batches_total", 11, timeout=60, replica="gappy") == 11
        assert sidecar.wait_for("kvlens_kv_event_batches_total", 10, timeout=60, replica="steady") == 10
        assert sidecar.value("kvlens_kv_sequence_gaps_total", replica="gappy") == 10
        assert sidecar.value("kvlens_kv_replays_total", replica="gappy") == 1
        assert sidecar.value("kvlens_kv_missed_batches_total", replica="gappy") == 10
    finally:
        gappy.close()
        steady.close()
        silent_router.close(0)
