"""The reorder window: batches of different replicas applied in the order of their timestamps,
each replica's trouble kept to that replica.

**The timestamp rule** (:func:`usable_timestamp`, the one place it is decided): a batch's ``ts``
orders it when it is a number from 0 to :data:`MAX_TIMESTAMP_LEAD_SECONDS` ahead of kvlens's own
clock (``time.time()`` when kvlens reads it); not a number, infinite, negative or further ahead it
is absurd: the batch is still applied (its events are read as any other's), ordered as if stamped
with the newest usable timestamp read before it, and counted. A ``ts`` behind the replica's
previous one is taken as that one (a replica's batches are never reordered among themselves, and
a clock stepped back would put them before their own past). A ``ts`` far behind kvlens's clock
is usable: it only makes its batch go at once (recorded events replayed with their old stamps are
ordered among themselves), while one far ahead would pass every other replica's batches through
the window at once, and hold its own replica's ordering there for as long.

**Isolation**: each replica's batches wait in their own queue, in the order they were read; the
queues' heads are merged by timestamp. A batch is applied once a batch ``window`` newer has been
read (of any replica), or once it has waited ``window`` by kvlens's monotonic clock, busy or idle
(those read before it with earlier stamps go first): so no replica's batches, stamps or pace can
hold another's past the window. Batches waiting hold at most :data:`MAX_WAITING_BYTES`, each
counted with :data:`WAITING_ENTRY_BYTES` for its bookkeeping; past it the oldest go at once.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from typing import Final, NamedTuple

# A batch's ts at most this far ahead of kvlens's clock is used to order it: NTP-synced hosts
# agree within milliseconds, and a stamp further ahead would release every other replica's
# batches early for as long (see the module's docstring).
MAX_TIMESTAMP_LEAD_SECONDS: Final = 10.0
# Batches waiting for the reorder window (kept as received, read when applied) hold at most this
# many bytes; past it the oldest are applied at once (a burst cannot make kvlens hold more).
MAX_WAITING_BYTES: Final = 8 * 1024 * 1024
# What a waiting batch costs beside its payload (its tuple, floats, the bytes object's header):
# counted against MAX_WAITING_BYTES so that a flood of tiny batches is bounded too.
WAITING_ENTRY_BYTES: Final = 256


def usable_timestamp(ts: float, wall_now: float) -> bool:
    """Whether a batch's ``ts`` may order it (the rule of the module's docstring); NaN fails both
    comparisons."""
    return 0.0 <= ts <= wall_now + MAX_TIMESTAMP_LEAD_SECONDS


class Waiting(NamedTuple):
    key: float  # the ordering timestamp (usable, or the newest one when the batch's was not)
    arrival: int  # read order, across replicas: ties of key broken by replica, then this
    received: float  # kvlens's monotonic clock when read
    payload: bytes | str  # the batch, or a marker (the replica cleared, or gone)
    size: int


class ReorderQueue:
    """Per-replica queues merged by timestamp (see the module's docstring)."""

    def __init__(self, window: float) -> None:
        self.window = window
        self.newest = -math.inf  # the newest ordering timestamp read
        self.bytes = 0
        self._queues: dict[str, deque[Waiting]] = {}
        # (key, replica, arrival, received) of each non-empty queue's head: one entry a replica
        self._heads: list[tuple[float, str, int, float]] = []
        self._arrival = 0

    def __bool__(self) -> bool:
        return bool(self._heads)

    def push(self, key: float, replica: str, received: float, payload: bytes | str, size: int) -> None:
        queue = self._queues.get(replica)
        if queue is None:
            queue = self._queues[replica] = deque()
        waiting = Waiting(key, self._arrival, received, payload, size)
        if not queue:
            heapq.heappush(self._heads, (key, replica, self._arrival, received))
        queue.append(waiting)
        self._arrival += 1
        self.bytes += size + WAITING_ENTRY_BYTES
        if key > self.newest:
            self.newest = key

    def arrived(self) -> None:
        """A batch applied without waiting (no window, nothing queued): counted in the order."""
        self._arrival += 1

    def due(self, now: float, *, everything: bool = False) -> list[tuple[str, Waiting]]:
        """Pop the batches whose wait is over, in the order to apply them."""
        heads, queues, window = self._heads, self._queues, self.window
        horizon = self.newest - window  # a batch this old has a batch `window` newer behind it
        waited = now - window
        out: list[tuple[str, Waiting]] = []
        overdue: tuple[float, str, int] | None = None  # the last in order of the batches overdue
        while heads:
            head = heads[0]
            key, replica, _, received = head
            if not (
                everything
                or key <= horizon
                or received <= waited
                or self.bytes > MAX_WAITING_BYTES
                or (overdue is not None and head[:3] <= overdue)
            ):
                # the first head in order may wait, but a batch read `window` ago goes now, and
                # those before it in order first: one replica's stamps cannot hold another's
                late = [(k, r, a) for k, r, a, read in heads if read <= waited]
                if not late:
                    break
                overdue = max(late)
                continue
            heapq.heappop(heads)
            queue = queues[replica]
            waiting = queue.popleft()
            self.bytes -= waiting.size + WAITING_ENTRY_BYTES
            if queue:
                following = queue[0]
                heapq.heappush(heads, (following.key, replica, following.arrival, following.received))
            else:
                del queues[replica]
            out.append((replica, waiting))
        return out
