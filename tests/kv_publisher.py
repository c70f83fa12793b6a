"""The publisher the tests drive: kvlens's vLLM-wire :class:`~kvlens.fleet.publisher.EventPublisher`
with hooks to misbehave: ``drop()`` buffers a batch without sending it (a full high-water mark
does that) and ``restart()`` starts the sequence again (the engine restarted)."""

from __future__ import annotations

from kvlens.fleet.publisher import EventPublisher


class TestPublisher(EventPublisher):
    __test__ = False

    def __init__(
        self, port: int, replay_port: int | None = None, topic: str = "", host: str = "127.0.0.1"
    ) -> None:
        """``host``: an address as it goes in a tcp:// endpoint (``[::1]`` for IPv6)."""
        super().__init__(
            f"tcp://{host}:{port}",
            None if replay_port is None else f"tcp://{host}:{replay_port}",
            topic=topic,
        )
        self.pub.setsockopt(self._zmq.SNDHWM, 0)  # never drop on this side: counts stay exact

    def drop(self, payload: bytes) -> None:
        with self._lock:
            self.buffer.append((self.seq, payload))
            self.seq += 1

    def restart(self) -> None:
        with self._lock:
            self.seq = 0
            self.buffer.clear()
