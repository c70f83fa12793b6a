"""What several commands share: server and input flags, settings from flags, the sidecar's
server, progress bars on stderr."""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvlens.config import ENV_PREFIX, Settings, load_settings
from kvlens.errors import SettingsError

if TYPE_CHECKING:  # the server's modules load when a server is built: offline commands skip them
    import uvicorn

    from kvlens.exporter.aggregator import Aggregator

log = logging.getLogger("kvlens")


def server_flags(sub: argparse.ArgumentParser) -> None:
    sub.add_argument("--host", help=f"listen address (env {ENV_PREFIX}HOST; default 127.0.0.1)")
    sub.add_argument("--port", type=int, help=f"listen port (env {ENV_PREFIX}PORT; default 9433)")
    sub.add_argument(
        "--config",
        type=Path,
        default=os.environ.get(f"{ENV_PREFIX}CONFIG") or None,
        help=f"YAML settings file (env {ENV_PREFIX}CONFIG); environment variables override it",
    )


def input_flags(sub: argparse.ArgumentParser) -> None:
    sub.add_argument("--format", dest="input_format", help="kvlens, sglang or openai-usage (default: detect)")
    sub.add_argument("--model", help="model for records that carry none (SGLang)")
    sub.add_argument("--config", type=Path, help="YAML settings: prompt_length_edges, cost_models, ...")
    sub.add_argument("--json", action="store_true", help="print the report as JSON (schema in the README)")
    sub.add_argument("--markdown", action="store_true", help="print the report as Markdown")


def scale_flags(sub: argparse.ArgumentParser) -> None:
    sub.add_argument(
        "--memory-limit", metavar="SIZE", help="DuckDB's memory before it spills, e.g. 2GiB (the default)"
    )


def settings_from(args: argparse.Namespace, **overrides: Any) -> Settings:
    return load_settings(
        args.config,
        **overrides,
        host=args.host,
        port=args.port,
        scrape_targets=getattr(args, "scrape", None),
        scrape_username=getattr(args, "scrape_username", None),
        scrape_password_file=getattr(args, "scrape_password_file", None),
        kv_events=kv_events_from(getattr(args, "kv_events", None)),
        kv_events_shard=getattr(args, "kv_events_shard", None),
        tails=tails_from(
            getattr(args, "tail", None), getattr(args, "formats", None), getattr(args, "model", None)
        ),
    )


def kv_events_from(pairs: list[str] | None) -> list[dict[str, str]] | None:
    if not pairs:
        return None
    publishers = []
    for pair in pairs:
        name, _, endpoint = pair.partition("=")
        if not endpoint:
            raise SettingsError("--kv-events takes NAME=URL, e.g. r0=tcp://10.0.0.5:5557")
        publishers.append({"name": name, "endpoint": endpoint})
    return publishers


def tails_from(
    globs: list[str] | None, formats: list[str] | None, model: str | None
) -> list[dict[str, str]] | None:
    """Pair each --tail with the --format given for it (kvlens when none)."""
    if not globs:
        if formats:
            raise SettingsError("--format needs a --tail to apply to")
        return None
    formats = formats or []
    if len(formats) > len(globs):
        raise SettingsError("more --format than --tail flags")
    padded = formats + ["kvlens"] * (len(globs) - len(formats))
    return [
        {"path": path, "format": format_name, **({"model": model} if model else {})}
        for path, format_name in zip(globs, padded, strict=True)
    ]


def build_server(settings: Settings, aggregator: Aggregator, log_level: str) -> uvicorn.Server:
    from prometheus_client import CollectorRegistry, ProcessCollector

    from kvlens.exporter import server
    from kvlens.exporter.app import create_app

    check_port_free(settings)
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)  # process_start_time_seconds shows restarts
    app = create_app(settings, registry, aggregator)
    sockets = server.raise_open_files_limit()
    server.return_large_buffers()  # a refused bomb's 16 MiB goes back to the kernel
    if sockets < settings.max_connections + 64:
        log.warning(
            "kvlens: the open-files limit (%d) is under max_connections (%d): raise it or lower the cap",
            sockets,
            settings.max_connections,
        )
    if settings.ingest_open:
        log.warning(
            "ingest (POST /v1/records, /v1/traces) listens on %s without a token: anyone "
            "who reaches this port can push records. Set KVLENS_INGEST_TOKEN (and KVLENS_PLUGIN_TOKEN in "
            "vLLM), or listen on 127.0.0.1.",
            settings.host,
        )
    for note in settings.cost_model_notes():
        log.info("%s", note)
    guard = app.state.sidecar.health.connections
    assert guard is not None
    return server.build_server(settings, app, guard, log_level)


@contextlib.contextmanager
def read_progress(files: list[str]) -> Iterator[Callable[[int], None] | None]:
    """A progress bar on stderr for long inputs read at a terminal."""
    sizes = [Path(f).stat().st_size for f in files if f != "-" and Path(f).is_file()]
    if not sys.stderr.isatty() or sum(sizes) < 64 * 1024 * 1024:
        yield None
        return
    from rich.console import Console
    from rich.progress import Progress

    with Progress(console=Console(stderr=True), transient=True) as bar:  # stdout is the report
        task = bar.add_task("reading", total=sum(sizes))
        yield lambda count: bar.advance(task, count)


@contextlib.contextmanager
def run_progress(runs: int) -> Iterator[Callable[[int], None] | None]:
    """A progress bar on stderr (requests replayed, all runs) when it is a terminal."""
    if not sys.stderr.isatty():
        yield None
        return
    try:
        from rich.progress import Progress
    except ModuleNotFoundError:
        yield None
        return
    from rich.console import Console

    with Progress(console=Console(stderr=True), transient=True) as bar:  # stdout is the report
        task = bar.add_task(f"simulating {runs} runs", total=None)
        yield lambda count: bar.advance(task, count)


def check_writable(*paths: Path | None) -> None:
    """Refuse, before any work, an output path that cannot be written (a missing folder, a
    directory, a read-only place), so a long analysis is not lost at its end."""
    for path in paths:
        if path is None:
            continue
        if path.is_dir():
            raise IsADirectoryError(errno.EISDIR, "is a directory, not a file to write", str(path))
        folder = path.parent if str(path.parent) else Path(".")
        if not folder.is_dir():
            raise FileNotFoundError(errno.ENOENT, "its folder does not exist", str(path))
        if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
            raise PermissionError(errno.EACCES, "cannot be written here", str(path))


def check_port_free(settings: Settings) -> None:
    """Say which address is taken, and how to pick another, before the server starts (uvicorn
    would log a bind error and exit 3)."""
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((settings.host, settings.port))
        except OSError as error:
            raise SettingsError(
                f"cannot listen on {settings.host}:{settings.port} ({error.strerror or error}): "
                f"pick another port with --port (or {ENV_PREFIX}PORT)"
            ) from None
