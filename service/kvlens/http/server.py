"""The HTTP server's bootstrap, shared by every server of the package (``kvlens serve``,
``kvlens simulate serve``): uvicorn, with the connection deadlines it lacks.

uvicorn (0.54, h11) arms no timer before a request head arrives: a socket that sends nothing, or
stops inside its headers, stays open for good, and its ``limit_concurrency`` counts such sockets,
so 1,000 of them make every request answer 503, health probes included. Nor does it arm one while
an answer waits for its reader: an answer nobody reads stays in the transport's buffer for good (a
closing transport waits for it too), so six unread 8 MiB answers held 142 MiB. kvlens keeps uvicorn
(its ASGI handling is what FastAPI is tested with) and replaces the one piece that lacks the
deadlines: :class:`GuardedH11Protocol`, uvicorn's h11 protocol with a head deadline, a write
deadline and a connection cap that evicts idle connections instead of refusing busy ones
(``uvicorn.Config(http=...)`` takes a protocol class). Admission of work is the app's job
(:class:`~kvlens.http.bodies.IngestGate`), so idle sockets never count against requests.

TLS is terminated by that protocol too (``loop.start_tls`` on the accepted socket), not by
``create_server(ssl=...)``: asyncio would hold a handshake up to 60 s and hand the protocol a
connection only once it completed, so stalled handshakes escaped both the head deadline and the
cap. Here a connection counts from its TCP accept, and its handshake and request head share the
one ``header_timeout``.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import resource
import signal
import ssl
from collections import Counter
from types import FrameType
from typing import Any, ClassVar, Final, Protocol

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)
KEEP_ALIVE_SECONDS = 5
M_MMAP_THRESHOLD: Final = -3  # mallopt's parameter number in glibc's malloc.h
LARGE_BUFFER_BYTES: Final = 1024 * 1024
_REFUSED = (
    b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
)


class ConnectionGuard:
    """The open connections and what a connection may cost: at most ``max_connections`` at once
    (past it the oldest one still in its TLS handshake or waiting for a request head is closed to
    make room), ``header_timeout`` seconds to finish the handshake and send a whole request
    head, and ``write_timeout`` seconds for its reader to take some of an answer once the
    connection's writes are paused (None: no such deadline). Used from the event loop only."""

    def __init__(
        self, max_connections: int, header_timeout: float, write_timeout: float | None = None
    ) -> None:
        self.max_connections = max_connections
        self.header_timeout = header_timeout
        self.write_timeout = write_timeout
        self._open: dict[Guarded, None] = {}  # insertion-ordered: the oldest first
        self.closed: Counter[str] = Counter()

    @property
    def open(self) -> int:
        return len(self._open)

    def admit(self, connection: Guarded) -> bool:
        """Take a new connection, closing the oldest idle one to make room; False when none is."""
        if len(self._open) >= self.max_connections:
            self.closed["over_capacity"] += 1
            idle = next((c for c in self._open if c.waiting_for_head), None)
            if idle is None:
                return False
            idle.close_idle()
            self._open.pop(idle, None)
        self._open[connection] = None
        return True

    def release(self, connection: Guarded) -> None:
        self._open.pop(connection, None)


class Guarded(Protocol):
    @property
    def waiting_for_head(self) -> bool: ...

    def close_idle(self) -> None: ...


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, under a :class:`ConnectionGuard`: a request head (after the TLS
    handshake, when ``tls`` is set) must arrive within ``header_timeout`` of the connection opening
    (or of the first byte of the next request on a kept-alive connection); an answer whose reader
    takes nothing of it for ``write_timeout`` (the transport's buffer stays over its high-water
    mark) is dropped and the connection aborted; past ``max_connections`` the oldest idle
    connection is closed, a handshake in progress included."""

    guard: ClassVar[ConnectionGuard]
    tls: ClassVar[ssl.SSLContext | None] = None
    _head_timer: asyncio.TimerHandle | None = None
    _write_timer: asyncio.TimerHandle | None = None
    _handshaking: asyncio.Transport | None = None  # the TCP transport while its TLS handshake runs
    _handshake: asyncio.Task[None] | None = None  # held: the loop keeps only a weak reference
    _serving = False  # uvicorn's side of the protocol was started
    _early = b""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if self.tls is None:
            self._serve(transport)
        if not self.guard.admit(self):
            if self.tls is None:
                transport.write(_REFUSED)
            transport.close()
            return
        self._arm_head_timer()
        if self.tls is not None:
            self._handshaking = transport
            transport.pause_reading()  # the bytes are the handshake's until start_tls takes them
            self._handshake = self.loop.create_task(self._start_tls(transport, self.tls))

    async def _start_tls(self, transport: asyncio.Transport, context: ssl.SSLContext) -> None:
        try:
            secured = await self.loop.start_tls(
                transport,
                self,
                context,
                server_side=True,
                ssl_handshake_timeout=2 * self.guard.header_timeout,  # the head timer closes first
            )
        except (OSError, asyncio.TimeoutError) as error:  # ssl.SSLError is an OSError
            log.debug("kvlens: TLS handshake failed (%s)", type(error).__name__)
            secured = None
        self._handshaking = None
        if secured is None or transport.is_closing():
            self._cancel_head_timer()
            self.guard.release(self)
            transport.close()
            return
        self._serve(secured)

    def _serve(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._serving = True
        early, self._early = self._early, b""
        if early:
            self.data_received(early)

    @property
    def waiting_for_head(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def data_received(self, data: bytes) -> None:
        if not self._serving:  # decrypted with the handshake's last flight, before start_tls returns
            self._early += data
            return
        super().data_received(data)
        if self.transport.is_closing():
            return
        if not self.waiting_for_head:
            self._cancel_head_timer()
        elif self._head_timer is None:  # the first bytes of a next request: its head is now due
            self._arm_head_timer()

    def pause_writing(self) -> None:
        # The transport holds more than its high-water mark of answer unsent: the reader must take
        # some within write_timeout, else the answer is dropped. Not close(): a closing transport
        # still waits for its buffer to drain, which an unread answer never does.
        super().pause_writing()
        timeout = self.guard.write_timeout
        if timeout is not None and self._write_timer is None:
            self._write_timer = self.loop.call_later(timeout, self._write_timeout)

    def resume_writing(self) -> None:
        self._cancel_write_timer()
        super().resume_writing()

    def _cancel_write_timer(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _write_timeout(self) -> None:
        self._write_timer = None
        self.guard.closed["write_timeout"] += 1
        self._open_transport().abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        self._cancel_write_timer()
        self.guard.release(self)
        if self._serving:
            super().connection_lost(exc)

    def close_idle(self) -> None:
        self._cancel_head_timer()
        self._open_transport().close()

    def _open_transport(self) -> asyncio.Transport:
        return self._handshaking if self._handshaking is not None else self.transport

    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self.guard.header_timeout, self._head_timeout)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        transport = self._open_transport()
        if self.waiting_for_head and not transport.is_closing():
            self.guard.closed["header_timeout"] += 1
            transport.close()


def guarded_protocol(guard: ConnectionGuard, tls: ssl.SSLContext | None = None) -> type[GuardedH11Protocol]:
    """The protocol class for ``uvicorn.Config(http=...)``: :class:`GuardedH11Protocol` bound to
    ``guard`` (and terminating TLS with ``tls``); uvicorn's own keep-alive and concurrency settings
    go with it as :func:`build_server` sets them."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"guard": guard, "tls": tls})


def config(
    app: Any,
    host: str,
    port: int,
    guard: ConnectionGuard,
    log_level: str,
    log_config: dict[str, Any],
    tls: ssl.SSLContext | None = None,
) -> uvicorn.Config:
    """uvicorn's settings for every server of the package: the guarded protocol (deadlines, the
    cap, TLS), no access log, one worker (counters and the simulated fleet live in this process),
    and no ``limit_concurrency``: idle sockets must not count, the guard closes them and the app
    admits work itself."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        log_config=log_config,
        access_log=False,
        workers=1,
        http=guarded_protocol(guard, tls),
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
        limit_concurrency=None,
    )


def prepare_process(max_connections: int) -> None:
    """What a server's process does before it listens: as many sockets as the hard limit allows
    (a warning when that is under the connection cap), and large buffers back to the kernel when
    freed (a refused or dropped body or answer of 16 MiB, rather than kept in the heap)."""
    sockets = raise_open_files_limit()
    return_large_buffers()
    if sockets < max_connections + 64:
        log.warning(
            "kvlens: the open-files limit (%d) is under max_connections (%d): raise it or lower the cap",
            sockets,
            max_connections,
        )


def raise_open_files_limit() -> int:
    """Let the process hold as many sockets as its hard limit allows (up to 1M): the soft limit is
    often 1,024, under the connection cap. Returns the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else 1 << 20
    wanted = min(wanted, 1 << 20)
    if soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError):
            pass
    return soft


def return_large_buffers() -> bool:
    """Have glibc give every buffer of LARGE_BUFFER_BYTES or more its own mapping, returned to the
    kernel when it is freed. Returns False where it cannot (another C library: nothing to do).

    glibc's default is a threshold that rises to the size of the largest such buffer freed (up to
    32 MiB), and the trim threshold with it: after one 16 MiB scrape was refused, the next ones
    were carved out of the heap of the thread that inflated them and stayed there, up to 17 MiB
    per executor thread (a soak with a gzip bomb every 30 s grew 58 MiB in 10 minutes, and
    ``malloc_trim`` gives back no arena's top but the main one). A fixed threshold ends the rise;
    the cost is a fresh mapping per large body, which is rare and small beside inflating it.
    """
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return False
        mallopt = ctypes.CDLL(None).mallopt
    except (ValueError, OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, LARGE_BUFFER_BYTES))


def run_until_stopped(server: uvicorn.Server) -> int:
    """Serve until a signal stops ``server``; the exit status: 130 after SIGINT (Ctrl-C), as a
    shell reports it, else 0. uvicorn raises the signal again once it has shut down, which ends in
    KeyboardInterrupt (130 in :func:`kvlens.cli.main`), but not in a process that inherited SIGINT
    ignored (a job started in the background of a script): there it returns, and this says 130."""
    signals: list[int] = []
    handle_exit = server.handle_exit

    def recorded(sig: int, frame: FrameType | None) -> None:
        signals.append(sig)
        handle_exit(sig, frame)

    server.handle_exit = recorded  # type: ignore[method-assign]
    server.run()
    return 128 + signal.SIGINT if signal.SIGINT in signals else 0
