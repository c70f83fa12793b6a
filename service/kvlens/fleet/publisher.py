"""Publish KV events as vLLM's ``ZmqEventPublisher`` does on the wire (needs the ``kv-events``
extra): multipart ``[topic, seq (8 bytes, big-endian), payload]`` on a PUB socket, sequences from
0; with a replay endpoint, a ROUTER that answers a start sequence (8 bytes, big-endian) with the
buffered ``[seq, payload]`` frames (after the empty delimiter) and ends with seq -1.

For ``kvlens simulate serve`` (one publisher per simulated replica, fed by
:class:`~kvlens.fleet.simulated.SimulatedEngine`) and for the tests. The socket is an XPUB (a PUB
that also hears subscriptions), so :meth:`wait_subscribed` can wait for a subscriber instead of
sleeping, which a plain PUB cannot.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, Final

import msgspec

from kvlens.errors import MissingExtra
from kvlens.fleet.schema import Event, KVEventBatch

END_SEQ: Final = (-1).to_bytes(8, "big", signed=True)


class EventPublisher:
    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        buffer_steps: int = 10_000,
        data_parallel_rank: int = 0,
    ) -> None:
        """``endpoint`` (and ``replay_endpoint``) are bound, e.g. ``tcp://127.0.0.1:5557``."""
        try:
            import zmq
        except ModuleNotFoundError:
            raise MissingExtra("publishing KV events", "kv-events") from None

        self._zmq = zmq
        self.context = zmq.Context()
        self.pub = self.context.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 100_000)  # vLLM's default hwm
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscriber's subscription, not the first only
        self.pub.setsockopt(zmq.IPV6, 1)  # tcp://[::]:5557 binds; harmless for IPv4
        self.pub.bind(endpoint)
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.rank = data_parallel_rank
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._encode = msgspec.msgpack.Encoder().encode
        self._thread: threading.Thread | None = None
        self.router: Any = None
        if replay_endpoint is not None:
            self.router = self.context.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.router.setsockopt(zmq.IPV6, 1)
            self.router.bind(replay_endpoint)
            self._thread = threading.Thread(target=self._serve_replays, name="kvlens-kv-replay", daemon=True)
            self._thread.start()

    def wait_subscribed(self, timeout_seconds: float = 20.0) -> None:
        """Wait for one (more) subscriber's subscription."""
        if not self.pub.poll(int(timeout_seconds * 1000)):
            raise TimeoutError(f"no subscriber came to {self.endpoint}")
        self.pub.recv()

    def publish_events(self, events: Sequence[Event], ts: float | None = None) -> int:
        """One ``EventBatch`` of ``events``; returns its sequence number."""
        batch = KVEventBatch(
            ts=time.time() if ts is None else ts, events=list(events), data_parallel_rank=self.rank
        )
        return self.publish(self._encode(batch))

    def publish(self, payload: bytes) -> int:
        with self._lock:
            seq = self.seq
            self.seq += 1
            self.buffer.append((seq, payload))
        self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def _serve_replays(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(50):
                continue
            frames = self.router.recv_multipart()
            if len(frames) != 3:  # as vLLM: [identity, empty delimiter, start]
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            with self._lock:
                buffered = [(seq, payload) for seq, payload in self.buffer if seq >= first]
            for seq, payload in buffered:
                self.router.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
            self.router.send_multipart([client, b"", END_SEQ, b""])

    def close(self) -> None:
        """Stop the replay thread, then close every socket without lingering: ``destroy``, not
        ``term``, which waits for ever on a socket left open (a test that failed half-way)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self.context.destroy(linger=0)

    def __enter__(self) -> EventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
