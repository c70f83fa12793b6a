"""A request body and the admission of the work it asks for, each bounded: shared by every
server of the package (``kvlens serve``, ``kvlens simulate serve``).

- :class:`ArrivingBodies`: at most ``max_arriving_bodies`` bodies arriving at once, holding at
  most ``max_arriving_body_bytes`` together; while full, a new body takes the place (or bytes) of
  one that fell behind ``body_min_bytes_per_second_when_full`` (answered 503 and closed), and is
  itself refused so (before anything of its body is read) only when none did.
- :class:`BodyReader`: the body, under :class:`BodyLimits` (a size, a total deadline, a stall
  deadline and a minimum pace); read whole before the request asks a gate for a slot, so slow
  senders never hold one.
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
from typing import Any, Final

from starlette.requests import ClientDisconnect, Request

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
    """A request body received under :class:`BodyLimits`, in a place among the
    :class:`ArrivingBodies`, its bytes counted against their budget while it arrives (given back
    once it has arrived, failed, or lost its place).

    The pending read is a task awaited with a timeout, not cancelled, so a window boundary that
    passes between two pieces checks the pace without losing the piece on its way."""

    def __init__(
        self,
        request: Request,
        limits: BodyLimits,
        budget: ArrivingBodies,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self._request = request
        self._limits = limits
        self._budget = budget
        self._clock = clock or asyncio.get_running_loop().time
        self._stream = request.stream().__aiter__()
        self._pending: asyncio.Task[bytes] | None = None
        self._displaced: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._arrival: Arrival | None = None
        self._chunks: list[bytes] = []
        self._size = 0
        self._complete = False
        now = self._clock()
        self._deadline = now + limits.deadline_seconds
        self._last_piece = now
        self._window_end = now + limits.window_seconds
        self._window_bytes = 0

    async def body(self) -> bytes:
        """The whole body; the place and bytes it held are free again whatever the outcome."""
        declared = self._request.headers.get("content-length", "")
        with self._budget.admit() as arrival:
            if arrival is None:  # nothing of the body read: it is refused rather than waited for
                raise Busy("too many request bodies arriving")
            self._arrival = arrival
            arrival.on_displaced = self._on_displaced
            try:
                if declared.isascii() and declared.isdigit() and int(declared) > self._limits.max_bytes:
                    raise PayloadTooLarge(f"the body exceeds {self._limits.max_bytes} bytes")
                while not self._complete:
                    await self._next()
                return b"".join(self._chunks)
            finally:
                self.close()

    def close(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None
        if self._arrival is not None:  # no cycle through the place: freed without waiting for gc
            self._arrival.on_displaced = _nobody
            self._arrival = None
        self._size = 0
        self._chunks = []

    def _on_displaced(self) -> None:
        self._chunks = []  # the budget counts them free already
        if not self._displaced.done():
            self._displaced.set_result(None)

    async def _next(self) -> None:
        limits = self._limits
        self._close_windows(self._clock())
        if self._pending is None:
            self._pending = asyncio.ensure_future(self._stream.__anext__())
        now = self._clock()
        wait = min(self._deadline, self._last_piece + limits.stall_seconds, self._window_end) - now
        woken_by: list[asyncio.Future[Any]] = [self._pending, self._displaced]
        await asyncio.wait(woken_by, timeout=max(0.0, wait), return_when=asyncio.FIRST_COMPLETED)
        now = self._clock()
        if self._displaced.done():
            raise BodyDisplaced(
                f"a new body took this one's place: all {self._budget.max_bodies} places (or "
                f"{self._budget.max_bytes} bytes) were taken and it was furthest behind "
                f"{self._budget.min_pace_when_full} bytes/s; retry"
            )
        if not self._pending.done():
            if now >= self._deadline:
                raise BodyTooSlow(f"the body did not arrive within {limits.deadline_seconds:g} s")
            if now >= self._last_piece + limits.stall_seconds:
                raise BodyTooSlow(f"the body paused over {limits.stall_seconds:g} s")
            return  # a window ended: checked on the next call
        pending, self._pending = self._pending, None
        try:
            chunk = pending.result()
        except StopAsyncIteration:
            self._complete = True
            return
        except ClientDisconnect:
            raise ClientDisconnected("the client went away before its body arrived") from None
        self._close_windows(now)
        self._last_piece = now
        self._window_bytes += len(chunk)
        if self._size + len(chunk) > limits.max_bytes:
            raise PayloadTooLarge(f"the body exceeds {limits.max_bytes} bytes")
        if not self._budget.take(len(chunk), self._arrival):
            raise ArrivingBytesFull(f"bodies arriving hold {self._budget.max_bytes} bytes already; retry")
        self._size += len(chunk)
        self._chunks.append(chunk)

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
