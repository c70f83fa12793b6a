"""A KV event publisher that skips a sequence number in every message, its replay endpoint
answering wrongly (or not at all), beside a steady publisher, against a real ``kvlens serve
--kv-events``. A replay runs beside the live streams: the steady replica's batches are applied
while the gappy one's replay is outstanding; one wrong frame ends a replay; a replay that
repaired nothing keeps that replica's next gaps from being asked for a while.

Before: a replay held kvlens's one subscriber thread until its answer or its timeout (2 s), and a
wrong answer (a frame of another sequence number, then the end mark) counted as an answer, so the
next gap was asked again: with a replay endpoint answering one wrong frame just before the
timeout, the steady replica's batches waited some 1.8 s per gap of the other (the issue: 10 of
2,930 batches applied after 35 s)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from tests.hostile.conftest import Serve
from tests.hostile.test_kv_events import stored_batch
from tests.kv_publisher import TestPublisher
from tests.live import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
END = (-1).to_bytes(8, "big", signed=True)


class ReplayEndpoint:
    """A replay endpoint under the test's control: each request is answered after ``delay``
    seconds with one frame of a sequence number nobody asked for and the end mark, or, with
    ``delay=None``, never."""

    def __init__(self, delay: float | None) -> None:
        self.context = zmq.Context()
        self.router = self.context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.delay = delay
        self.asked: list[int] = []
        self.requested = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(20):
                continue
            client, _, start = self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            self.asked.append(first)
            self.requested.set()
            if self.delay is None or self._stop.wait(self.delay):
                continue
            wrong = (first + 1000).to_bytes(8, "big")
            self.router.send_multipart([client, b"", wrong, stored_batch(10**6, 1)])
            self.router.send_multipart([client, b"", END, b""])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.router.close(0)
        self.context.term()


@pytest.fixture
def publishers() -> Iterator[tuple[TestPublisher, TestPublisher]]:
    gappy, steady = TestPublisher(free_port()), TestPublisher(free_port())
    yield gappy, steady
    gappy.close()
    steady.close()


def serve_both(serve: Serve, gappy: TestPublisher, steady: TestPublisher, replay: ReplayEndpoint) -> Serve:
    config = [
        {"name": "gappy", "endpoint": gappy.endpoint, "replay_endpoint": f"tcp://127.0.0.1:{replay.port}"},
        {"name": "steady", "endpoint": steady.endpoint},
    ]
    sidecar = serve(KVLENS_KV_EVENTS=json.dumps(config))
    gappy.wait_subscribed()
    steady.wait_subscribed()
    return sidecar  # type: ignore[return-value]


def test_wrong_answers_just_before_the_timeout_never_starve_another_replica(
    serve: Serve, publishers: tuple[TestPublisher, TestPublisher]
) -> None:
    gappy, steady = publishers
    replay = ReplayEndpoint(delay=1.8)  # kvlens's replay timeout is 2 s
    try:
        sidecar = serve_both(serve, gappy, steady, replay)
        gappy.publish(stored_batch(0, 1))
        assert sidecar.wait_for("kvlens_kv_event_batches_total", 1, replica="gappy") == 1
        gaps = 30
        for number in range(1, gaps + 1):
            gappy.drop(stored_batch(number * 128, 1))
            gappy.publish(stored_batch(number * 128 + 64, 1))
        started = time.monotonic()
        steady_batches = 300
        for number in range(steady_batches):  # 3 s of a steady replica's batches
            steady.publish(stored_batch(10**5 + number * 64, 1))
            time.sleep(0.01)  # the steady publisher's pace, not a wait for kvlens
        applied = sidecar.value("kvlens_kv_event_batches_total", replica="steady")
        print(
            f"steady batches applied {applied:.0f} of {steady_batches} {time.monotonic() - started:.1f} s in"
        )
        assert applied >= steady_batches - 50  # all but the last window's and a scrape's
        assert sidecar.wait_for("kvlens_kv_event_batches_total", gaps + 1, replica="gappy") == gaps + 1
        assert replay.asked == [1]  # the wrong answer ended the replays for a while
        assert sidecar.value("kvlens_kv_replays_total", replica="gappy") == 1
        assert sidecar.value("kvlens_kv_replayed_batches_total", replica="gappy") == 0
        assert sidecar.value("kvlens_kv_sequence_gaps_total", replica="gappy") == gaps
        assert sidecar.value("kvlens_kv_missed_batches_total", replica="gappy") == gaps
        assert (
            sidecar.wait_for("kvlens_kv_event_batches_total", steady_batches, replica="steady")
            == steady_batches
        )
    finally:
        replay.close()


def test_the_live_stream_is_applied_while_a_replay_is_outstanding(
    serve: Serve, publishers: tuple[TestPublisher, TestPublisher]
) -> None:
    gappy, steady = publishers
    replay = ReplayEndpoint(delay=None)  # bound, never answers: kvlens gives up after 2 s
    try:
        sidecar = serve_both(serve, gappy, steady, replay)
        gappy.publish(stored_batch(0, 1))
        assert sidecar.wait_for("kvlens_kv_event_batches_total", 1, replica="gappy") == 1
        gappy.drop(stored_batch(64, 1))
        gappy.publish(stored_batch(128, 1))
        assert replay.requested.wait(20), "kvlens did not ask for a replay"
        for number in range(20):
            steady.publish(stored_batch(10**5 + number * 64, 1))
        assert sidecar.wait_for("kvlens_kv_event_batches_total", 20, replica="steady") == 20
        # the steady batches were applied before the gappy replica's replay ended (it ends in
        # a missed batch and a replay counted)
        assert sidecar.value("kvlens_kv_missed_batches_total", replica="gappy") == 0
        assert sidecar.value("kvlens_kv_replays_total", replica="gappy") == 0
        assert sidecar.wait_for("kvlens_kv_missed_batches_total", 1, replica="gappy") == 1
        assert sidecar.value("kvlens_kv_replays_total", replica="gappy") == 1
        assert sidecar.wait_for("kvlens_kv_event_batches_total", 2, replica="gappy") == 2
    finally:
        replay.close()
