"""A request body and the admission of the work it asks for, each bounded: shared by every
server of the package (``kvlens serve``, ``kvlens simulate serve``).

- :class:`ArrivingBodies`: at most ``max_arriving_bodies`` bodies arriving at once (one more is
  answered 503 with ``Retry-After`` before anything of its body is read), holding at most
  ``max_arriving_body_bytes`` together (a body that would cross it is answered 503 and closed).
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
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Final

from starlette.requests import ClientDisconnect, Request

from kvlens.errors import ArrivingBytesFull, BodyTooSlow, ClientDisconnected, PayloadTooLarge

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


class ArrivingBodies:
    """The bodies still arriving and the bytes they hold: at most ``max_bodies`` at once (the rest
    are refused before anything of their body is read) and ``max_bytes`` together. Used from the
    event loop only (no lock)."""

    def __init__(self, max_bodies: int, max_bytes: int) -> None:
        self.max_bodies = max_bodies
        self.max_bytes = max_bytes
        self.bodies = 0
        self.bytes = 0

    @contextlib.contextmanager
    def admit(self) -> Iterator[bool]:
        """Yields whether one more body may arrive now."""
        if self.bodies >= self.max_bodies:
            yield False
            return
        self.bodies += 1
        try:
            yield True
        finally:
            self.bodies -= 1

    def take(self, size: int) -> bool:
        """Reserve ``size`` bytes for a piece that arrived; False (nothing reserved) past the cap."""
        if self.bytes + size > self.max_bytes:
            return False
        self.bytes += size
        return True

    def give_back(self, size: int) -> None:
        self.bytes -= size


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
    """A request body received under :class:`BodyLimits`, its bytes counted against an
    :class:`ArrivingBodies` budget while it arrives (given back once it has arrived, or failed).

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
        self._chunks: list[bytes] = []
        self._size = 0
        self._complete = False
        now = self._clock()
        self._deadline = now + limits.deadline_seconds
        self._last_piece = now
        self._window_end = now + limits.window_seconds
        self._window_bytes = 0

    async def body(self) -> bytes:
        """The whole body; the bytes it held leave the arriving budget whatever the outcome."""
        declared = self._request.headers.get("content-length", "")
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
        self._budget.give_back(self._size)
        self._size = 0
        self._chunks = []

    async def _next(self) -> None:
        limits = self._limits
        self._close_windows(self._clock())
        if self._pending is None:
            self._pending = asyncio.ensure_future(self._stream.__anext__())
        now = self._clock()
        wait = min(self._deadline, self._last_piece + limits.stall_seconds, self._window_end) - now
        done, _ = await asyncio.wait([self._pending], timeout=max(0.0, wait))
        now = self._clock()
        if not done:
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
        if not self._budget.take(len(chunk)):
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
