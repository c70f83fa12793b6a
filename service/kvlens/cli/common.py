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
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvlens import logs, terminal
from kvlens.errors import SettingsError
from kvlens.limits import DEFAULT_MEMORY_LIMIT, DEFAULT_PORT, ENV_PREFIX

if TYPE_CHECKING:  # the server's modules load when a server is built: offline commands skip them
    import uvicorn

    from kvlens.config import Settings
    from kvlens.exporter.aggregator import Aggregator
    from kvlens.fleet.subscriber import KVEvents

log = logging.getLogger("kvlens")


class HelpFormatter(argparse.HelpFormatter):
    """Each flag's help ends with its default (as ``ArgumentDefaultsHelpFormatter``), except where
    there is none to tell (None, an off switch, an empty list) or the help already says it; the
    examples (the epilog) keep their lines, as ``RawDescriptionHelpFormatter`` would."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith(EXAMPLES):
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help = action.help or ""
        default = action.default
        # `is`, not `in`: 0 and 0.0 equal False, and they are defaults worth telling
        quiet = default is None or default is False or default == [] or default == argparse.SUPPRESS
        quiet = quiet or "default:" in help
        if quiet or not (action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE)):
            return help
        return f"{help} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """A command's parser: a flag it does not know is its error, shown with its own usage
    (argparse hands a subcommand's unknown flags up to ``kvlens``, whose usage tells nothing)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras


EXAMPLES = "examples:\n"


def examples(*commands: str) -> str:
    """An epilog of example command lines, each continued with a backslash (so it still pastes
    into a shell) where it would pass 80 columns."""
    lines = []
    for command in commands:
        line = " "
        for word in command.split(" "):
            if len(line) + 1 + len(word) > 77 and line.strip():
                lines.append(line + " \\")
                line = "     "
            line += " " + word
        lines.append(line)
    return EXAMPLES + "\n".join(lines)


def log_flags(parser: argparse.ArgumentParser) -> None:
    """``--log-level`` and ``--log-format`` on every command (their defaults from the environment)."""
    parser.add_argument(
        "--log-level",
        type=str.lower,
        choices=logs.LEVELS,
        metavar="LEVEL",
        default=(os.environ.get(f"{ENV_PREFIX}LOG_LEVEL") or "info").lower(),  # empty: unset
        help=f"the least severe log lines shown: {', '.join(logs.LEVELS)} (env {ENV_PREFIX}LOG_LEVEL)",
    )
    parser.add_argument(
        "--log-format",
        type=str.lower,
        choices=logs.FORMATS,
        metavar="FORMAT",
        default=(os.environ.get(f"{ENV_PREFIX}LOG_FORMAT") or "text").lower(),
        help=f"log lines on stderr: text, or one JSON object per line (env {ENV_PREFIX}LOG_FORMAT)",
    )


def configure_logging(args: argparse.Namespace) -> dict[str, Any]:
    """Install the logging the flags (or their variables) ask for; the same dictionary is
    uvicorn's ``log_config``. A value from the environment is not checked by argparse's choices."""
    for name, allowed in (("log_level", logs.LEVELS), ("log_format", logs.FORMATS)):
        value = getattr(args, name)
        if value not in allowed:
            variable = f"{ENV_PREFIX}{name.upper()}"
            raise SettingsError(f"{variable}={os.environ.get(variable)!r} is not one of {', '.join(allowed)}")
    import logging.config  # its handlers and sockets: not for a --help

    config = logs.config(args.log_level, args.log_format)
    logging.config.dictConfig(config)
    return config


def server_flags(sub: argparse.ArgumentParser) -> None:
    sub.add_argument("--host", help=f"listen address (env {ENV_PREFIX}HOST; default: 127.0.0.1)")
    sub.add_argument("--port", type=int, help=f"listen port (env {ENV_PREFIX}PORT; default: {DEFAULT_PORT})")
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
    sub.add_argument(
        "--json",
        action="store_true",
        help="print the report as JSON (its schema key names a file in kvlens/schemas)",
    )
    sub.add_argument("--markdown", action="store_true", help="print the report as Markdown")


def scale_flags(sub: argparse.ArgumentParser) -> None:
    sub.add_argument(
        "--memory-limit",
        metavar="SIZE",
        help=(
            "DuckDB's memory before it spills, e.g. 4GiB "
            f"(default: analyze_memory_limit, {DEFAULT_MEMORY_LIMIT})"
        ),
    )


def percentiles_flag(sub: argparse.ArgumentParser) -> None:
    """``--percentiles`` (default 50,90,95,99), parsed by :func:`kvlens.stats.parse_percentiles`
    for every command that takes it (compare, experiment prefix-cache, experiment quantization):
    a bad list exits 2 with the rule it breaks."""
    from kvlens import stats

    def parse(text: str) -> tuple[float, ...]:
        try:
            return stats.parse_percentiles(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    sub.add_argument(
        "--percentiles",
        type=parse,
        # a string default goes through `type` as typed text would (and shows as typed)
        default=",".join(stats.percentile_name(q) for q in stats.DEFAULT_PERCENTILES),
        metavar="P,P,...",
        help="percentiles of every latency table, ascending, each above 0 and below 100",
    )


def engine_flag(sub: argparse.ArgumentParser) -> None:
    """``--engine`` of the commands that read records (chosen by ``analyze.choose_engine``)."""
    sub.add_argument(
        "--engine",
        choices=("auto", "numpy", "duckdb"),
        default="auto",
        help=(
            "duckdb: out of core (the scale extra); auto: duckdb when installed, but numpy for "
            "local JSON lines under 16 MiB (numpy alone reports per-session reuse)"
        ),
    )


def settings_from(args: argparse.Namespace, **overrides: Any) -> Settings:
    from kvlens.config import load_settings  # pydantic: only for the commands that build settings

    return load_settings(
        args.config,
        **overrides,
        host=args.host,
        port=args.port,
        scrape_targets=getattr(args, "scrape", None),
        scrape_username=getattr(args, "scrape_username", None),
        scrape_password_file=getattr(args, "scrape_password_file", None),
        kv_events=kv_events_from(getattr(args, "kv_events", None)),
        kv_events_dns=getattr(args, "kv_events_dns", None),
        kv_events_shard=getattr(args, "kv_events_shard", None),
        isolation_probes=getattr(args, "isolation_probe", None),
        isolation_every_seconds=getattr(args, "isolation_every", None),
        kv_events_require_cache_salt=getattr(args, "require_cache_salt", None),
        kv_events_trtllm=named_urls(getattr(args, "kv_events_trtllm", None), "--kv-events-trtllm", "url"),
        tails=tails_from(
            getattr(args, "tail", None), getattr(args, "formats", None), getattr(args, "model", None)
        ),
    )


def kv_events_from(pairs: list[str] | None) -> list[dict[str, str]] | None:
    return named_urls(pairs, "--kv-events", "endpoint")


def named_urls(pairs: list[str] | None, flag: str, key: str) -> list[dict[str, str]] | None:
    """``NAME=URL`` flags as settings objects ``{"name": NAME, key: URL}``."""
    if not pairs:
        return None
    named = []
    for pair in pairs:
        name, _, url = pair.partition("=")
        if not url:
            example = "r0=tcp://10.0.0.5:5557" if key == "endpoint" else "t0=http://10.0.0.7:8000"
            raise SettingsError(f"{flag} takes NAME=URL, e.g. {example}")
        named.append({"name": name, key: url})
    return named


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


def build_server(
    settings: Settings,
    aggregator: Aggregator,
    args: argparse.Namespace,
    quieter: str | None = None,
    kv_events: KVEvents | None = None,
) -> uvicorn.Server:
    """``quieter``: a least level for uvicorn's lines when the command prints its own (demo);
    ``kv_events``: an index fed in process (the demo) instead of from the settings' publishers."""
    from prometheus_client import CollectorRegistry, ProcessCollector

    from kvlens.exporter import server
    from kvlens.exporter.app import create_app
    from kvlens.http.server import prepare_process

    check_port_free(settings)
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)  # process_start_time_seconds shows restarts
    app = create_app(settings, registry, aggregator, kv_events)
    prepare_process(settings.max_connections)  # a refused bomb's 16 MiB goes back to the kernel
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
    level = args.log_level
    if quieter is not None and logs.LEVELS.index(quieter) > logs.LEVELS.index(level):
        level = quieter
    return server.build_server(settings, app, guard, level, logs.config(args.log_level, args.log_format))


@contextlib.contextmanager
def read_progress(files: list[str]) -> Iterator[Callable[[int], None] | None]:
    """A progress bar on stderr for long inputs read at a terminal."""
    sizes = [Path(f).stat().st_size for f in files if f != "-" and Path(f).is_file()]
    if not sys.stderr.isatty() or sum(sizes) < 64 * 1024 * 1024:
        yield None
        return
    from rich.progress import Progress

    with Progress(console=terminal.console(stderr=True), transient=True) as bar:  # stdout is the report
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

    with Progress(console=terminal.console(stderr=True), transient=True) as bar:  # stdout is the report
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


def print_report(text: str, table: Callable[[], None]) -> None:
    """A report at a terminal as ``table`` prints it (rich: the analyze extra), else as its text:
    into a file or a pipe, and at a terminal without rich (the ``serve`` install prints every
    report; its tables are a nicety)."""
    if sys.stdout.isatty():
        try:
            import rich  # noqa: F401
        except ImportError:
            pass
        else:
            table()
            return
    print(text, end="")


def make_room_for(*paths: Path | None) -> None:
    """An output path's folder made (with its parents), then the path checked as
    :func:`check_writable` does: ``--html runs/report.html`` before ``runs/`` exists is a
    place to write, not a mistake."""
    for path in paths:
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
    check_writable(*paths)


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


def trace_format_flags(parser: argparse.ArgumentParser) -> None:
    """The flags that say how a trace is read (``simulate``, ``replay``, ``experiment``)."""
    from kvlens.simulate.trace import CONVERSATIONS, FORMATS

    parser.add_argument(
        "--trace-format",
        choices=FORMATS,
        metavar="FORMAT",
        help=f"read the trace as this format: {', '.join(FORMATS)} (default: told by its content)",
    )
    parser.add_argument(
        "--session-rate",
        type=float,
        metavar="PER_S",
        help=f"{CONVERSATIONS} conversations: start one every 1/PER_S s, in file-name order "
        "(default: all at 0, the files recording no offset between them)",
    )
