"""What libzmq holds for a real ``kvlens serve --kv-events`` facing a publisher that sends big
messages at full speed while kvlens is busy, and a replay endpoint that answers without end: the
bytes read ahead stay within the documented bound (KV_RECEIVE_HWM messages of at most
MAX_MESSAGE_BYTES per socket; MAX_REPLAY_BYTES per replay answer) instead of growing with what
the peer sends."""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterator

import pytest
import zmq

from kvlens.fleet.replay import MAX_REPLAY_BYTES
from kvlens.fleet.subscriber import KV_RECEIVE_HWM, MAX_MESSAGE_BYTES
from tests import vllm_kv_events as vllm
from tests.hostile.conftest import Serve
from tests.kv_publisher import TestPublisher
from tests.live import Running, free_port

pytestmark = pytest.mark.integration
MIB = 1024 * 1024


@pytest.fixture
def publisher() -> Iterator[TestPublisher]:
    pub = TestPublisher(free_port())
    yield pub
    pub.close()


@pytest.fixture
def router() -> Iterator[tuple[zmq.Socket[bytes], int]]:
    """A replay endpoint under the test's control (it answers only what the test sends)."""
    context = zmq.Context()
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.LINGER, 0)
    port = socket.bind_to_random_port("tcp://127.0.0.1")
    yield socket, port
    socket.close(0)
    context.term()


def kv_env(pub: TestPublisher, replay_port: int) -> dict[str, str]:
    replica = {"name": "r0", "endpoint": pub.endpoint, "replay_endpoint": f"tcp://127.0.0.1:{replay_port}"}
    return {"KVLENS_KV_EVENTS": json.dumps([replica])}


def ask_a_replay(sidecar: Running, publisher: TestPublisher, replay: zmq.Socket[bytes]) -> list[bytes]:
    """A batch, then a gap: kvlens asks the replay endpoint; returns the request's frames."""
    empty = vllm.encode(vllm.KVEventBatch(ts=1.0, events=[]))
    publisher.publish(empty)
    assert sidecar.wait_for("kvlens_kv_event_batches_total", 1) == 1
    publisher.drop(empty)
    publisher.publish(empty)
    assert replay.poll(20_000), "kvlens did not ask for a replay"
    return replay.recv_multipart()


def heavy(size: int) -> bytes:
    """A batch whose timestamp reads but whose events do not: cheap for kvlens to reject once it
    reads it, so what grows is what was read ahead, not the work."""
    head = b"\x92\xcb" + struct.pack(">d", 1.0) + b"\xdb"  # [ts, a string in place of the events]
    junk = size - len(head) - 4
    return head + junk.to_bytes(4, "big") + b"x" * junk


def test_big_messages_sent_while_kvlens_waits_on_a_replay_stay_with_the_publisher(
    serve: Serve, publisher: TestPublisher, router: tuple[zmq.Socket[bytes], int]
) -> None:
    """A gap makes kvlens ask the (silent) replay endpoint, and its one thread waits for the
    answer (2 s); meanwhile the publisher sends 48 messages of 8 MiB. Before: libzmq read all of
    them ahead (its default RCVHWM is 1,000 messages), +390 MiB; now at most KV_RECEIVE_HWM
    messages wait in kvlens, the rest in TCP's buffers and the publisher's queue."""
    replay, port = router
    sidecar = serve(**kv_env(publisher, port))
    publisher.wait_subscribed()
    memory = sidecar.memory()
    memory.reset()
    ask_a_replay(sidecar, publisher, replay)  # kvlens's one thread now waits for the answer
    message = heavy(8 * MIB)
    count = 48
    for _ in range(count):
        publisher.publish(message)
    rejected = sidecar.wait_for(
        "kvlens_kv_events_rejected_total", count, timeout=120, reason="malformed_payload"
    )
    assert rejected == count
    assert sidecar.value("kvlens_kv_missed_batches_total") == 1
    bound = (KV_RECEIVE_HWM + 1) * 8 + 64  # read ahead, one being received, and its processing
    assert memory.peak_growth_mib() < bound


def test_a_replay_answer_without_end_is_given_up_at_its_byte_cap(
    serve: Serve, publisher: TestPublisher, router: tuple[zmq.Socket[bytes], int]
) -> None:
    """A gap of twice MAX_REPLAY_BYTES in 4 MiB batches; the replay endpoint answers every one
    of them, never the end frame. Before: kvlens kept every frame until the 2 s deadline (as fast
    as loopback carries them); now it gives the answer up past MAX_REPLAY_BYTES: the gap counted
    missed. (A gap is taken as soon as its frames came, the end frame not waited for.)"""
    replay, port = router
    replay.setsockopt(zmq.SNDHWM, 0)
    sidecar = serve(**kv_env(publisher, port))
    publisher.wait_subscribed()
    memory = sidecar.memory()
    memory.reset()
    empty = vllm.encode(vllm.KVEventBatch(ts=1.0, events=[]))
    publisher.publish(empty)
    assert sidecar.wait_for("kvlens_kv_event_batches_total", 1) == 1
    gap = 2 * MAX_REPLAY_BYTES // (4 * MIB)
    for _ in range(gap):
        publisher.drop(empty)
    publisher.publish(empty)
    assert replay.poll(20_000), "kvlens did not ask for a replay"
    identity, empty_frame, first = replay.recv_multipart()
    frame = heavy(4 * MIB)
    start = int.from_bytes(first, "big")
    for sent in range(gap):
        replay.send_multipart([identity, empty_frame, (start + sent).to_bytes(8, "big"), frame])
    assert sidecar.wait_for("kvlens_kv_missed_batches_total", gap, timeout=30) == gap
    assert sidecar.value("kvlens_kv_replayed_batches_total") == 0
    bound = MAX_REPLAY_BYTES // MIB + (KV_RECEIVE_HWM + 1) * 4 + 64
    assert memory.peak_growth_mib() < bound


def test_a_message_over_the_cap_costs_that_message_not_the_subscription(
    serve: Serve, publisher: TestPublisher
) -> None:
    """One message past MAX_MESSAGE_BYTES: libzmq closes the connection (a protocol error) and,
    unlike after a network error, never connects again. Before: that publisher's events were lost
    for good, ``up`` 0, until kvlens restarted; now the subscription is made afresh and the
    sequence gap counts what was lost."""
    sidecar = serve(KVLENS_KV_EVENTS=json.dumps([{"name": "r0", "endpoint": publisher.endpoint}]))
    publisher.wait_subscribed()
    empty = vllm.encode(vllm.KVEventBatch(ts=1.0, events=[]))
    publisher.publish(empty)
    assert sidecar.wait_for("kvlens_kv_event_batches_total", 1) == 1
    publisher.publish(b"x" * (MAX_MESSAGE_BYTES + 1))
    deadline = time.monotonic() + 20
    while sidecar.value("kvlens_kv_event_batches_total") < 2 and time.monotonic() < deadline:
        publisher.publish(empty)  # lost at the publisher while nobody is connected: a gap
        sidecar.wait_for("kvlens_kv_event_batches_total", 2, timeout=0.3)
    assert sidecar.value("kvlens_kv_event_batches_total") == 2
    assert sidecar.value("kvlens_kv_missed_batches_total") == publisher.seq - 2
    assert sidecar.value("kvlens_kv_publisher_up") == 1
