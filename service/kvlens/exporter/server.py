"""The HTTP server: uvicorn, with the connection deadlines it lacks, and TLS that follows renewals.

uvicorn (0.54, h11) arms no timer before a request head arrives: a socket that sends nothing, or
stops inside its headers, stays open for good, and its ``limit_concurrency`` counts such sockets,
so 1,000 of them make every request answer 503, health probes included. kvlens keeps uvicorn
(its ASGI handling is what FastAPI is tested with) and replaces the one piece that lacks the
deadline: :class:`GuardedH11Protocol`, uvicorn's h11 protocol with a head deadline and a connection
cap that evicts idle connections instead of refusing busy ones (``uvicorn.Config(http=...)``
takes a protocol class). Admission of work is the app's job (:class:`~kvlens.exporter.ingest.
IngestGate`), so idle sockets never count against requests.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import ssl
from typing import Any, ClassVar

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvlens.config import Settings
from kvlens.exporter.runtime import ConnectionGuard

log = logging.getLogger(__name__)
KEEP_ALIVE_SECONDS = 5
_REFUSED = (
    b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, under a :class:`ConnectionGuard`: a request head must arrive within
    ``header_timeout`` of the connection opening (or of the first byte of the next request on a
    kept-alive connection); past ``max_connections`` the oldest idle connection is closed."""

    guard: ClassVar[ConnectionGuard]
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if not self.guard.admit(self):
            transport.write(_REFUSED)
            transport.close()
            return
        self._arm_head_timer()

    @property
    def waiting_for_head(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def data_received(self, data: bytes) -> None:
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
        super().connection_lost(exc)

    def close_idle(self) -> None:
        self._cancel_head_timer()
        self.transport.close()

    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self.guard.header_timeout, self._head_timeout)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.waiting_for_head and not self.transport.is_closing():
            self.guard.closed["header_timeout"] += 1
            self.transport.close()


class KVLensServer(uvicorn.Server):
    """uvicorn's server, reloading the TLS certificate when its files change (for new handshakes;
    connections already open keep the certificate they started with)."""

    def __init__(self, config: uvicorn.Config, settings: Settings) -> None:
        super().__init__(config)
        self.settings = settings
        self._tls_files = _stamp(settings)
        self._next_tls_check = 0.0

    async def on_tick(self, counter: int) -> bool:
        now = asyncio.get_running_loop().time()
        if self.config.ssl is not None and now >= self._next_tls_check:
            self._next_tls_check = now + self.settings.tls_reload_seconds
            self._reload_tls()
        return await super().on_tick(counter)

    def _reload_tls(self) -> None:
        stamp = _stamp(self.settings)
        if stamp == self._tls_files:
            return
        context = self.config.ssl
        if context is None:
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


def build_server(settings: Settings, app: Any, guard: ConnectionGuard, log_level: str) -> KVLensServer:
    protocol = type("GuardedH11Protocol", (GuardedH11Protocol,), {"guard": guard})
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=log_level,
        access_log=False,
        workers=1,  # counters live in this process; more workers would split them
        http=protocol,
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
        limit_concurrency=None,  # idle sockets must not count: the app admits work itself
        ssl_certfile=str(settings.tls_cert_file) if settings.tls_cert_file else None,
        ssl_keyfile=str(settings.tls_key_file) if settings.tls_key_file else None,
    )
    return KVLensServer(config, settings)


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
