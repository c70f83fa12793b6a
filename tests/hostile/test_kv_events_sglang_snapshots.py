"""SGLang publishing with a ``snapshot_endpoint`` against a real ``kvlens serve --kv-events``:
its live topic names the publisher's lifecycle (``\\x00sgl-kv-epoch=<uuid>``) and a snapshot
adds a barrier message, an empty batch at the next sequence number, on the same socket.

Built as SGLang builds them (tests/vllm_kv_events.py). A barrier is a batch like any other (not
malformed, no gap). A new epoch is a new publisher (SGLang restarted the replica: its cache and
its sequence start again): the old blocks are gone even when kvlens saw no sequence go back,
and the new lifecycle's batches kvlens did not get are asked of the replay endpoint from 0.
Before, kvlens read the topic as a prefix only: a restart whose new sequence had passed the old
one went unseen, the old blocks stayed held and the new lifecycle's first batches were lost."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import pytest

from tests import vllm_kv_events as wire
from tests.hostile.conftest import Serve
from tests.hostile.test_kv_events import stored_batch
from tests.kv_publisher import TestPublisher
from tests.live import Running, free_port, until

pytestmark = pytest.mark.integration


class SGLangPublisher(TestPublisher):
    """The test publisher with SGLang's snapshot-enabled topics."""

    __test__ = False

    def __init__(self, port: int, replay_port: int) -> None:
        super().__init__(port, replay_port)
        self.epoch = uuid.uuid4().hex

    def publish(self, payload: bytes) -> int:
        return self._send(wire.sglang_live_topic(self.topic, self.epoch), payload)

    def barrier(self) -> int:
        return self._send(
            wire.sglang_barrier_topic(self.topic, self.epoch, uuid.uuid4().hex), wire.sglang_barrier(2.0)
        )

    def _send(self, topic: bytes, payload: bytes) -> int:
        with self._lock:
            seq = self.seq
            self.seq += 1
            self.buffer.append((seq, payload))
        self.pub.send_multipart([topic, seq.to_bytes(8, "big"), payload])
        return seq

    def drop_barrier(self) -> None:
        self.drop(wire.sglang_barrier(2.0))

    def new_lifecycle(self) -> None:
        """SGLang rebuilt the replica's publisher: a new epoch, sequences from 0, an empty buffer."""
        self.restart()
        self.epoch = uuid.uuid4().hex


@pytest.fixture
def publisher() -> Iterator[SGLangPublisher]:
    pub = SGLangPublisher(free_port(), free_port())
    yield pub
    pub.close()


def counters(sidecar: Running) -> dict[str, float]:
    samples = sidecar.samples()
    names = {
        "held": "kvlens_kv_blocks_held",
        "batches": "kvlens_kv_event_batches_total",
        "gaps": "kvlens_kv_sequence_gaps_total",
        "replayed": "kvlens_kv_replayed_batches_total",
        "restarts": "kvlens_kv_publisher_restarts_total",
        "rejected": "kvlens_kv_events_rejected_total",
        "stored": "kvlens_kv_blocks_stored_total",
    }
    return {key: sum(v for (n, _), v in samples.items() if n == name) for key, name in names.items()}


def test_barriers_are_batches_and_a_new_epoch_is_a_restart(serve: Serve, publisher: SGLangPublisher) -> None:
    endpoints = [{"name": "r0", "endpoint": publisher.endpoint, "replay_endpoint": publisher.replay_endpoint}]
    sidecar = serve(KVLENS_KV_EVENTS=json.dumps(endpoints))
    publisher.wait_subscribed()

    publisher.publish(stored_batch(0, 1))  # seq 0: 64 blocks
    publisher.barrier()  # seq 1: a snapshot was taken
    publisher.publish(stored_batch(64, 1))  # seq 2
    until(lambda: counters(sidecar)["batches"] == 3)
    assert counters(sidecar) == {
        "held": 128,
        "batches": 3,
        "gaps": 0,
        "replayed": 0,
        "restarts": 0,
        "rejected": 0,
        "stored": 128,
    }

    # SGLang rebuilt the replica while kvlens was not listening: the new lifecycle's first three
    # batches never came; its fourth has the sequence kvlens expects next (3)
    publisher.new_lifecycle()
    publisher.drop(stored_batch(1000, 2))  # seq 0: 128 blocks
    publisher.drop_barrier()  # seq 1
    publisher.drop(stored_batch(3000, 1))  # seq 2
    publisher.publish(stored_batch(4000, 1))  # seq 3
    # seq 4 clears the cache: its clear is the sign that seq 3 and whatever it brought back are
    # applied (one thread handles a message whole before the next)
    cleared = wire.EventBatch(ts=3.0, events=[wire.AllBlocksCleared()], data_parallel_rank=0)
    publisher.publish(wire.encode(cleared))
    until(lambda: sidecar.value("kvlens_kv_events_total", type="AllBlocksCleared") == 1)
    assert counters(sidecar) == {
        "held": 0,
        "batches": 8,  # 3, then the new lifecycle's 0 to 4
        "gaps": 1,  # 0 to 2, asked from 0 and brought back whole
        "replayed": 3,
        "restarts": 1,
        "rejected": 0,
        "stored": 128 + 128 + 64 + 64,  # the old lifecycle's, then all of the new one's
    }
