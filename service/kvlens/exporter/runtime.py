"""How the sidecar's own event loop is doing, and /metrics rendered without stalling it.

- :class:`LoopLag` measures how late the event loop wakes a sleeping task (a blocked loop delays
  every request, health probes included): ``kvlens_event_loop_lag_seconds``.
- :class:`ScrapeRenderer` renders the exposition in a thread; scrapes that arrive while a render
  runs share the next one, so N concurrent scrapes cost at most two renders and each still gets
  data at least as fresh as its arrival.
- :class:`ServiceHealth` gathers these for the collector.
"""

from __future__ import annotations

import asyncio
import bisect
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from prometheus_client import CollectorRegistry

from kvlens.http.bodies import ArrivingBodies, IngestGate
from kvlens.http.server import ConnectionGuard

LAG_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class LoopLag:
    """A histogram of event-loop wake-up delays, sampled every ``interval`` seconds."""

    def __init__(self, interval: float = 0.1) -> None:
        self.interval = interval
        self._counts = [0] * (len(LAG_BUCKETS) + 1)
        self._sum = 0.0
        self._lock = threading.Lock()

    async def watch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            await asyncio.sleep(self.interval)
            self.observe(max(0.0, loop.time() - started - self.interval))

    def observe(self, lag: float) -> None:
        with self._lock:
            self._counts[bisect.bisect_left(LAG_BUCKETS, lag)] += 1
            self._sum += lag

    def snapshot(self) -> tuple[list[int], float]:
        """Cumulative bucket counts (the last is +Inf) and the sum."""
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative = []
        running = 0
        for count in counts:
            running += count
            cumulative.append(running)
        return cumulative, total


Encoder = Callable[[CollectorRegistry], bytes]


class ScrapeRenderer:
    """One render at a time per content type, shared by the scrapes that wait for it."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        self._running: dict[str, asyncio.Future[bytes]] = {}
        self._next: dict[str, asyncio.Future[bytes]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def render(self, encoder: Encoder, content_type: str) -> bytes:
        waiting = self._next.get(content_type)
        if waiting is not None:  # a render starts for us as soon as the running one ends
            return await asyncio.shield(waiting)
        running = self._running.get(content_type)
        if running is None:
            return await asyncio.shield(self._start(encoder, content_type))
        following: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._next[content_type] = following

        async def after_the_running_one() -> None:
            await asyncio.wait([running])
            del self._next[content_type]
            try:
                following.set_result(await self._start(encoder, content_type))
            except Exception as error:  # the collector never raises; an encoder bug still answers
                following.set_exception(error)

        task = asyncio.create_task(after_the_running_one())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return await asyncio.shield(following)

    def _start(self, encoder: Encoder, content_type: str) -> asyncio.Future[bytes]:
        future = asyncio.ensure_future(asyncio.to_thread(encoder, self._registry))
        self._running[content_type] = future

        def finished(done: asyncio.Future[bytes]) -> None:
            if self._running.get(content_type) is done:
                del self._running[content_type]

        future.add_done_callback(finished)
        return future


@dataclass
class ServiceHealth:
    """How the service itself is doing, for the collector: admission, refusals, the loop."""

    ingest_open: bool
    gate: IngestGate
    arriving: ArrivingBodies
    loop_lag: LoopLag = field(default_factory=LoopLag)
    connections: ConnectionGuard | None = None
    refused: Counter[str] = field(default_factory=Counter)  # event loop only

    def refuse(self, reason: str) -> None:
        self.refused[reason] += 1
