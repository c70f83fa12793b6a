"""``kvlens serve``'s server: the shared bootstrap of :mod:`kvlens.http.server` (uvicorn with the
connection deadlines it lacks), from the sidecar's settings, with TLS that follows renewals."""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from typing import Any

import uvicorn

from kvlens.http import server as http_server
from kvlens.http.server import ConnectionGuard
from kvlens.http.settings import ServerSettings

log = logging.getLogger(__name__)


class KVLensServer(uvicorn.Server):
    """uvicorn's server, reloading the TLS certificate when its files change (for new handshakes;
    connections already open keep the certificate they started with)."""

    def __init__(self, config: uvicorn.Config, settings: ServerSettings, tls: ssl.SSLContext | None) -> None:
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


def _stamp(settings: ServerSettings) -> tuple[Any, ...]:
    stamps: list[Any] = []
    for path in (settings.tls_cert_file, settings.tls_key_file):
        try:
            status = os.stat(path) if path is not None else None
        except OSError:
            status = None
        stamps.append(None if status is None else (status.st_mtime_ns, status.st_size, status.st_ino))
    return tuple(stamps)


def build_server(
    settings: ServerSettings,
    app: Any,
    guard: ConnectionGuard,
    log_level: str,
    log_config: dict[str, Any] | None = None,
) -> KVLensServer:
    """``log_config``: the command line's logging (``kvlens.logs``), so uvicorn's lines share its
    format; None keeps uvicorn's own."""
    tls = tls_context(settings)
    logging_config = uvicorn.config.LOGGING_CONFIG if log_config is None else log_config
    config = http_server.config(app, settings.host, settings.port, guard, log_level, logging_config, tls)
    if tls is not None:
        log.info("kvlens: serving HTTPS on port %d", settings.port)
    return KVLensServer(config, settings, tls)


def tls_context(settings: ServerSettings) -> ssl.SSLContext | None:
    """The server's TLS context (Python's defaults for servers: TLS 1.2 or later), or None."""
    if settings.tls_cert_file is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    key = settings.tls_key_file
    context.load_cert_chain(str(settings.tls_cert_file), str(key) if key is not None else None)
    return context
