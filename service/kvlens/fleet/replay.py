"""Replays of a sequence gap from a publisher's replay endpoint: the answer's check and the bounds.

vLLM's replay endpoint (a ``ROUTER``) answers a start sequence with its buffered ``[sequence,
payload]`` frames from that one on, then sequence -1. kvlens asks for the first missing
sequence of a gap and needs exactly the gap's batches, in order: :class:`ReplayAnswer` takes the
frames as they come and ends the replay at the first frame that is not the next one wanted (a
wrong sequence, a broken frame, the end mark before the gap is filled), or as soon as the gap
is filled (what the endpoint sends after it also comes live).

A replay runs beside the live streams (:class:`~kvlens.fleet.subscriber.KVEventsSource` polls its
socket with the others): only the gappy replica's stream waits for it, the others are read and
applied meanwhile. It is bounded (:class:`ReplayBudget`): an answer within the replay timeout
(2 s), at most :data:`MAX_REPLAY_FRAMES` batches and :data:`MAX_REPLAY_BYTES`; at most
:data:`MAX_REPLAYS_PER_PERIOD` replays of a replica per :data:`REPLAY_PERIOD_SECONDS`; and after
one that repaired nothing (quiet, or a wrong answer) none of that replica for
:data:`REPLAY_QUIET_TIMEOUTS` timeouts. A gap not asked for is counted missed at once.
"""

from __future__ import annotations

from collections import deque
from typing import Final

END_SEQ: Final = -1
MAX_REPLAY_FRAMES: Final = 100_000  # one replay answer at most (vLLM's buffer_steps is 10,000)
# One replay answer's payloads at most; a longer one is given up (the gap counted missed).
MAX_REPLAY_BYTES: Final = 64 * 1024 * 1024
# After a replay that repaired nothing, the replica's gaps are missed without asking for this
# many replay timeouts: each replay holds that replica's live stream until it ends.
REPLAY_QUIET_TIMEOUTS: Final = 10
# Replays of one replica at most per period, answered or not: a publisher that skips a number in
# every message, with an endpoint that answers slowly, would otherwise hold its own stream to a
# batch per answer, and keep its endpoint busy.
MAX_REPLAYS_PER_PERIOD: Final = 10
REPLAY_PERIOD_SECONDS: Final = 60.0


class ReplayAnswer:
    """The frames of one replay answer for the gap ``[first, end)``, checked as they come."""

    def __init__(self, first: int, end: int) -> None:
        self.first = first
        self.end = end
        self.frames: list[tuple[int, bytes]] = []
        self.bytes = 0

    def take(self, parts: list[bytes]) -> bool | None:
        """One message of the answer (without the DEALER's empty delimiter): True once the gap is
        filled, False when the answer is wrong (the replay ends, nothing repaired), None for more."""
        if len(parts) != 2 or len(parts[0]) != 8:
            return False
        seq = int.from_bytes(parts[0], "big", signed=True)
        if seq != self.first + len(self.frames):  # the end mark too: the gap is not filled yet
            return False
        self.frames.append((seq, parts[1]))
        self.bytes += len(parts[1])
        if self.bytes > MAX_REPLAY_BYTES:
            return False
        return True if seq + 1 == self.end else None


class ReplayBudget:
    """When a replica's replay endpoint may be asked (see the module's docstring)."""

    def __init__(self, timeout_seconds: float) -> None:
        self.timeout_seconds = timeout_seconds
        self._asked: deque[float] = deque()
        self._quiet_until = float("-inf")

    def allows(self, now: float) -> bool:
        while self._asked and self._asked[0] <= now - REPLAY_PERIOD_SECONDS:
            self._asked.popleft()
        return now >= self._quiet_until and len(self._asked) < MAX_REPLAYS_PER_PERIOD

    def asked(self, now: float) -> None:
        self._asked.append(now)

    def failed(self, now: float) -> None:
        self._quiet_until = now + REPLAY_QUIET_TIMEOUTS * self.timeout_seconds
