"""A request body and the admission of the work it asks for, each bounded: shared by every
server of the package (``kvlens serve``, ``kvlens simulate serve``).

- :class:`ArrivingBodies`: at most ``max_arriving_bodies`` bodies arriving at once, holding at
  most ``max_arriving_body_bytes`` together; while full, a new body takes the place (or bytes) of
  one that fell behind ``body_min_bytes_per_second_when_full`` (answered 503 and closed), and is
  itself refused so (before anything of its body is read) only when none did.
- :class:`BodyReader`: the body, under :class:`BodyLimits` (a size, a total deadline, a stall
  deadline and a minimum pace); read whole before the request asks a gate for a slot, so slow
  senders never hold one. The one reader of both servers: ``kvlens serve`` through Starlette's
  request, ``kvlens simulate serve`` from plain ASGI.
- :class:`IngestGate`: at most ``capacity`` requests whose body has arrived at work at once (in
  ``kvlens serve`` decoding records, in ``kvlens simulate serve`` tokenizing); one more is
  answered 503 with ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Final, Protocol

from starlette.requests import Request
from starlette.types import Message, Receive

from kvlens.errors import (
    ArrivingBytesFull,
    BodyDisplaced,
    BodyTooSlow,
    Busy,
    ClientDisconnected,
    PayloadTooLarge,
)

RETRY_AFTER_SECONDS: Final = 1


class IngestGate:
    """Admission for requests at work: a slot each, refused (not queued) when none is free."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.in_flight = 0
        self.refused = 0

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[bool]:
        """Yields whether the request was admitted; runs on the event loop only (no lock)."""
        if self.in_flight >= self.capacity:
            self.refused += 1
            yield False
            return
        self.in_flight += 1
        try:
            yield True
        finally:
            self.in_flight -= 1


def _nobody() -> None:
    pass


class Arrival:
    """One body arriving: when it started, the bytes it holds, and who to tell if it loses its place."""

    __slots__ = ("displaced", "held", "on_displaced", "started")

    def __init__(self, started: float) -> None:
        self.started = started
        self.held = 0
        self.displaced = False
        self.on_displaced: Callable[[], None] = _nobody


class ArrivingBodies:
    """The bodies still arriving and the bytes they hold: at most ``max_bodies`` at once and
    ``max_bytes`` together. Used from the event loop only (no lock).

    While either cap is reached, a body that has fallen behind ``min_pace_when_full`` bytes per
    second since it started (by more than the newcomer has) gives its place or its bytes to the
    newcomer, the one furthest behind first: a real sender sends its body at once, far above
    that pace, so slow senders, however many, can fill the places but not keep a real POST out.
    Without one behind, the newcomer is refused (before anything of its body is read, past
    ``max_bodies``). 0 turns displacement off: the caps then refuse whoever comes last."""

    def __init__(
        self,
        max_bodies: int,
        max_bytes: int,
        min_pace_when_full: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_bodies = max_bodies
        self.max_bytes = max_bytes
        self.min_pace_when_full = min_pace_when_full
        self._clock = clock
        self._arrivals: dict[Arrival, None] = {}
        self.bytes = 0

    @property
    def bodies(self) -> int:
        return len(self._arrivals)

    @contextlib.contextmanager
    def admit(self) -> Iterator[Arrival | None]:
        """Yields the body's place, or None when there is none for it (nor one to take). On exit
        the place and the bytes taken through it are free again."""
        now = self._clock()
        if len(self._arrivals) >= self.max_bodies:
            behind = self._behind(now, None)
            if not behind:
                yield None
                return
            self._displace(behind[0])
        arrival = Arrival(now)
        self._arrivals[arrival] = None
        try:
            yield arrival
        finally:
            if self._arrivals.pop(arrival, 0) is None:
                self.bytes -= arrival.held

    def take(self, size: int, arrival: Arrival | None = None) -> bool:
        """Reserve ``size`` bytes for a piece that arrived (for ``arrival``, whose place then gives
        them back, else given back by the caller); False (nothing reserved) past the cap. Bodies
        are displaced for ``arrival`` only when that makes room."""
        short = self.bytes + size - self.max_bytes
        if short > 0 and arrival is not None:
            victims = []
            for victim in self._behind(self._clock(), arrival):
                victims.append(victim)
                short -= victim.held
                if short <= 0:
                    for victim in victims:
                        self._displace(victim)
                    break
        if self.bytes + size > self.max_bytes:
            return False
        self.bytes += size
        if arrival is not None:
            arrival.held += size
        return True

    def give_back(self, size: int) -> None:
        self.bytes -= size

    def _behind(self, now: float, taker: Arrival | None) -> list[Arrival]:
        """The arrivals (not ``taker``) behind the pace asked when full, and further than
        ``taker``, the furthest first."""
        pace = self.min_pace_when_full
        if not pace:
            return []

        def short(arrival: Arrival) -> float:  # bytes short of the pace since it started
            return pace * (now - arrival.started) - arrival.held

        floor = 0.0 if taker is None else max(0.0, short(taker))
        behind = [(short(a), a) for a in self._arrivals if a is not taker]
        return [a for gap, a in sorted(behind, key=lambda pair: -pair[0]) if gap > floor]

    def _displace(self, victim: Arrival) -> None:
        # Its bytes are counted free at once: its reader drops them now (on_displaced), before it
        # wakes to answer; many bodies may be displaced in one turn of the loop.
        del self._arrivals[victim]
        self.bytes -= victim.held
        victim.displaced = True
        victim.on_displaced()


class BodySettings(Protocol):
    """The settings of request bodies that every server of the package reads (``kvlens serve``'s,
    KVLENS_*): one set of rules, built here for each, so that no server leaves one out."""

    @property
    def body_timeout_seconds(self) -> float: ...
    @property
    def header_timeout_seconds(self) -> float: ...
    @property
    def body_min_bytes_per_second(self) -> int: ...
    @property
    def body_min_bytes_per_second_when_full(self) -> int: ...
    @property
    def body_rate_window_seconds(self) -> float: ...
    @property
    def max_arriving_bodies(self) -> int: ...
    @property
    def max_arriving_body_bytes(self) -> int: ...


def arriving_bodies(settings: BodySettings) -> ArrivingBodies:
    """The arriving bodies' caps, displacing a body behind the pace when full unless no pace is
    asked at all (``body_min_bytes_per_second`` 0 turns every pace off)."""
    return ArrivingBodies(
        settings.max_arriving_bodies,
        settings.max_arriving_body_bytes,
        settings.body_min_bytes_per_second_when_full if settings.body_min_bytes_per_second else 0,
    )


def body_limits(settings: BodySettings, max_bytes: int) -> BodyLimits:
    """A body's limits: the server's size cap, and the settings' deadline, pause and pace."""
    return BodyLimits(
        max_bytes,
        settings.body_timeout_seconds,
        settings.header_timeout_seconds,
        settings.body_min_bytes_per_second,
        settings.body_rate_window_seconds,
    )


@dataclass(frozen=True)
class BodyLimits:
    """What a request body may cost: its size, its total time, its longest pause, and its pace
    (every ``window_seconds`` must bring ``min_bytes_per_second * window_seconds`` bytes, or the end
    of the body; the first window is the grace period)."""

    max_bytes: int
    deadline_seconds: float
    stall_seconds: float
    min_bytes_per_second: int
    window_seconds: float


class BodyReader:
    """A request body received from ASGI's ``receive`` under :class:`BodyLimits`, in a place among
    the :class:`ArrivingBodies`, its bytes counted against their budget while it arrives (given
    back once it has arrived, failed, or lost its place). A declared Content-Length over the size
    is refused before a place is taken: a retry would be refused again.

    Each wait for a piece is ``receive()`` itself, under a timer that cancels it at the next
    deadline (the whole body's, the pause's, or the end of a pace window) and cancelled at once
    when the body loses its place: a cancellation told from any other by a flag, and taken back.
    Not a task per piece awaited with a timeout: that cost 60 us of CPU a body (9 here), a sixth
    of what ``kvlens simulate serve`` spends on a request. Cancelling ``receive()`` loses
    nothing: uvicorn keeps what arrived for the next call (so the reader takes the ASGI
    ``receive``, never Starlette's ``request.stream()``, which a cancellation ends)."""

    def __init__(
        self,
        receive: Receive,
        declared: bytes | str | None,
        limits: BodyLimits,
        budget: ArrivingBodies,
        clock: Callable[[], float] | None = None,
    ) -> None:
        """``declared``: the request's Content-Length header, if any."""
        self._receive = receive
        self._declared = declared
        self._limits = limits
        self._budget = budget
        self._loop = asyncio.get_running_loop()
        self._clock = clock or self._loop.time
        self._task: asyncio.Task[Any] | None = None
        self._waiting = False  # in receive(), where a lost place cancels it
        self._expired = False
        self._displaced = False
        self._arrival: Arrival | None = None
        self._chunks: list[bytes] = []
        self._size = 0
        now = self._clock()
        self._deadline = now + limits.deadline_seconds
        self._last_piece = now
        self._window_end = now + limits.window_seconds
        self._window_bytes = 0

    @classmethod
    def of(
        cls,
        request: Request,
        limits: BodyLimits,
        budget: ArrivingBodies,
        clock: Callable[[], float] | None = None,
    ) -> BodyReader:
        """A Starlette request's body (read from its ``receive``, see above)."""
        return cls(request.receive, request.headers.get("content-length"), limits, budget, clock)

    async def body(self) -> bytes:
        """The whole body; the place and bytes it held are free again whatever the outcome."""
        declared, most = self._declared, self._limits.max_bytes
        if declared is not None and declared.isascii() and declared.isdigit() and int(declared) > most:
            raise PayloadTooLarge(f"the body exceeds {most} bytes")
        with self._budget.admit() as arrival:
            if arrival is None:  # nothing of the body read: it is refused rather than waited for
                raise Busy("too many request bodies arriving")
            self._arrival = arrival
            arrival.on_displaced = self._on_displaced
            self._task = asyncio.current_task()
            try:
                while not await self._next():
                    pass
                return b"".join(self._chunks)
            finally:
                self.close()

    def close(self) -> None:
        if self._arrival is not None:  # no cycle through the place: freed without waiting for gc
            self._arrival.on_displaced = _nobody
            self._arrival = None
        self._size = 0
        self._chunks = []

    def _on_displaced(self) -> None:
        self._chunks = []  # the budget counts them free already
        self._displaced = True
        if self._waiting and self._task is not None:
            self._task.cancel()

    def _expire(self) -> None:
        self._expired = True
        if self._task is not None:
            self._task.cancel()

    async def _next(self) -> bool:
        """Wait for the next piece (or a deadline); True once the body is complete."""
        limits = self._limits
        self._close_windows(self._clock())
        now = self._clock()
        wait = min(self._deadline, self._last_piece + limits.stall_seconds) - now
        if limits.min_bytes_per_second:  # a window's end is a deadline only when it asks a pace
            wait = min(wait, self._window_end - now)
        message = await self._within(max(0.0, wait))
        now = self._clock()
        if self._displaced:
            raise BodyDisplaced(
                f"a new body took this one's place: all {self._budget.max_bodies} places (or "
                f"{self._budget.max_bytes} bytes) were taken and it was furthest behind "
                f"{self._budget.min_pace_when_full} bytes/s; retry"
            )
        if message is None:
            if now >= self._deadline:
                raise BodyTooSlow(f"the body did not arrive within {limits.deadline_seconds:g} s")
            if now >= self._last_piece + limits.stall_seconds:
                raise BodyTooSlow(f"the body paused over {limits.stall_seconds:g} s")
            return False  # a window ended: checked on the next call
        if message["type"] != "http.request":  # http.disconnect
            raise ClientDisconnected("the client went away before its body arrived")
        chunk = message.get("body", b"")
        self._close_windows(now)
        self._last_piece = now
        self._window_bytes += len(chunk)
        if self._size + len(chunk) > limits.max_bytes:
            raise PayloadTooLarge(f"the body exceeds {limits.max_bytes} bytes")
        if not self._budget.take(len(chunk), self._arrival):
            raise ArrivingBytesFull(f"bodies arriving hold {self._budget.max_bytes} bytes already; retry")
        self._size += len(chunk)
        if chunk:
            self._chunks.append(chunk)
        return not message.get("more_body", False)

    async def _within(self, seconds: float) -> Message | None:
        """``receive()``'s next message, or None once ``seconds`` passed or the place was lost."""
        self._expired = False
        timer = self._loop.call_later(seconds, self._expire)
        self._waiting = True
        try:
            return await self._receive()
        except asyncio.CancelledError:
            if not (self._expired or self._displaced):
                raise
            task = self._task
            # Python 3.11+: the cancellation was ours, taken back; another one still pending is not
            if task is not None and hasattr(task, "uncancel") and task.uncancel() > 0:
                raise
            return None
        finally:
            self._waiting = False
            timer.cancel()

    def _close_windows(self, now: float) -> None:
        limits = self._limits
        while now >= self._window_end:
            if self._window_bytes < limits.min_bytes_per_second * limits.window_seconds:
                raise BodyTooSlow(
                    f"the body arrived slower than {limits.min_bytes_per_second} bytes/s "
                    f"over {limits.window_seconds:g} s"
                )
            self._window_bytes = 0
            self._window_end += limits.window_seconds
