"""The HTTP server: uvicorn, with the connection deadlines it lacks, and TLS that follows renewals.

uvicorn (0.54, h11) arms no timer before a request head arrives: a socket that sends nothing, or
stops inside its headers, stays open for good, and its ``limit_concurrency`` counts such sockets,
so 1,000 of them make every request answer 503, health probes included. kvlens keeps uvicorn
(its ASGI handling is what FastAPI is tested with) and replaces the one piece that lacks the
deadline: :class:`GuardedH11Protocol`, uvicorn's h11 protocol with a head deadline and a connection
cap that evicts idle connections instead of refusing busy ones (``uvicorn.Config(http=...)``
takes a protocol class). Admission of work is the app's job (:class:`~kvlens.exporter.ingest.
IngestGate`), so idle sockets never count against requests.

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
from types import FrameType
from typing import Any, ClassVar, Final

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvlens.config import Settings
from kvlens.exporter.runtime import ConnectionGuard

log = logging.getLogger(__name__)
KEEP_ALIVE_SECONDS = 5
M_MMAP_THRESHOLD: Final = -3  # mallopt's parameter number in glibc's malloc.h
LARGE_BUFFER_BYTES: Final = 1024 * 1024
_REFUSED = (
    b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, under a :class:`ConnectionGuard`: a request head (after the TLS
    handshake, when ``tls`` is set) must arrive within ``header_timeout`` of the connection opening
    (or of the first byte of the next request on a kept-alive connection); past
    ``max_connections`` the oldest idle connection is closed, a handshake in progress included."""

    guard: ClassVar[ConnectionGuard]
    tls: ClassVar[ssl.SSLContext | None] = None
    _head_timer: asyncio.TimerHandle | None = None
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

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
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


class KVLensServer(uvicorn.Server):
    """uvicorn's server, reloading the TLS certificate when its files change (for new handshakes;
    connections already open keep the certificate they started with)."""

    def __init__(self, config: uvicorn.Config, settings: Settings, tls: ssl.SSLContext | None) -> None:
        super().__init__(config)
        self.settings = settings
        self.tls = tls
        self._tls_files = _stamp(settings)
        self._next_tls_check = 0.0

    async def on_tick(self, counter: int) -> bool:
        now = asyncio.get_running_loop().time()
        if self.tls is not None and now >= self._next_tls_check:
            self._next_tls_check = now + self.settings.tls_reload_seconds
            self._reload_tls(self.tls)
        return await super().on_tick(counter)

    def _reload_tls(self, context: ssl.SSLContext) -> None:
        stamp = _stamp(self.settings)
        if stamp == self._tls_files:
            return
        try:
            context.load_cert_chain(str(self.settings.tls_cert_file), str(self.settings.tls_key_file))
        except (OSError, ssl.SSLError) as error:  # half-written files: try again on the next check
            log.warning("kvlens: the renewed TLS certificate does not load yet (%s)", type(error).__name__)
            return
        self._tls_files = stamp
        log.info("kvlens: TLS certificate reloaded")


def _stamp(settings: Settings) -> tuple[Any, ...]:
    stamps: list[Any] = []
    for path in (settings.tls_cert_file, settings.tls_key_file):
        try:
            status = os.stat(path) if path is not None else None
        except OSError:
            status = None
        stamps.append(None if status is None else (status.st_mtime_ns, status.st_size, status.st_ino))
    return tuple(stamps)


def guarded_protocol(guard: ConnectionGuard, tls: ssl.SSLContext | None = None) -> type[GuardedH11Protocol]:
    """The protocol class for ``uvicorn.Config(http=...)``: :class:`GuardedH11Protocol` bound to
    ``guard`` (and terminating TLS with ``tls``); uvicorn's own keep-alive and concurrency settings
    go with it as :func:`build_server` sets them."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"guard": guard, "tls": tls})


def build_server(
    settings: Settings,
    app: Any,
    guard: ConnectionGuard,
    log_level: str,
    log_config: dict[str, Any] | None = None,
) -> KVLensServer:
    """``log_config``: the command line's logging (``kvlens.logs``), so uvicorn's lines share its
    format; None keeps uvicorn's own."""
    tls = tls_context(settings)
    protocol = guarded_protocol(guard, tls)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=log_level,
        log_config=uvicorn.config.LOGGING_CONFIG if log_config is None else log_config,
        access_log=False,
        workers=1,  # counters live in this process; more workers would split them
        http=protocol,
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
        limit_concurrency=None,  # idle sockets must not count: the app admits work itself
    )
    if tls is not None:
        log.info("kvlens: serving HTTPS on port %d", settings.port)
    return KVLensServer(config, settings, tls)


def tls_context(settings: Settings) -> ssl.SSLContext | None:
    """The server's TLS context (Python's defaults for servers: TLS 1.2 or later), or None."""
    if settings.tls_cert_file is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    key = settings.tls_key_file
    context.load_cert_chain(str(settings.tls_cert_file), str(key) if key is not None else None)
    return context


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
