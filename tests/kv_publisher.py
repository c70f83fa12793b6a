"""A KV event publisher that behaves as vLLM's ``ZmqEventPublisher`` on the wire: multipart
``[topic, seq (8 bytes, big-endian), payload]`` on a PUB socket, and a ROUTER replay socket that
answers a start sequence with the buffered ``[seq, payload]`` frames and ends with seq -1.

It uses XPUB (a PUB that also hears subscriptions) so a test can wait until the subscriber is
there instead of sleeping; ``drop()`` skips a sequence number, as a full high-water mark does."""

from __future__ import annotations

import threading
from collections import deque

import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class TestPublisher:
    __test__ = False

    def __init__(self, port: int, replay_port: int | None = None, topic: str = "") -> None:
        self.context = zmq.Context()
        self.pub = self.context.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscriber's subscription, not the first only
        self.pub.bind(f"tcp://127.0.0.1:{port}")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.topic = topic.encode()
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=10_000)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.replay_endpoint = None if replay_port is None else f"tcp://127.0.0.1:{replay_port}"
        self._thread: threading.Thread | None = None
        if replay_port is not None:
            self.router = self.context.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.router.bind(f"tcp://127.0.0.1:{replay_port}")
            self._thread = threading.Thread(target=self._serve_replays, daemon=True)
            self._thread.start()

    def wait_subscribed(self, timeout_ms: int = 20_000) -> None:
        if not self.pub.poll(timeout_ms):
            raise TimeoutError("no subscriber came")
        self.pub.recv()  # the subscription message

    def publish(self, payload: bytes) -> int:
        with self._lock:
            seq = self.seq
            self.seq += 1
            self.buffer.append((seq, payload))
        self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def drop(self, payload: bytes) -> None:
        """Buffer a batch (a replay can bring it back) without sending it."""
        with self._lock:
            self.buffer.append((self.seq, payload))
            self.seq += 1

    def restart(self) -> None:
        with self._lock:
            self.seq = 0
            self.buffer.clear()

    def _serve_replays(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(50):
                continue
            client, _, start = self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            with self._lock:
                frames = [(seq, payload) for seq, payload in self.buffer if seq >= first]
            for seq, payload in frames:
                self.router.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
            self.router.send_multipart([client, b"", END_SEQ, b""])

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self.router.close(0)
        self.pub.close(0)
        self.context.term()
