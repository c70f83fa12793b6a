"""The ``kvlens`` command line: one module per command (each its ``add_parser`` and its ``run``),
as vLLM's ``entrypoints/cli/`` does. A command parses, calls its room and prints; the work lives
in the room."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence

from kvlens import __version__
from kvlens.cli import analyze, bandwidth, compare, convert, demo, experiment, replay, serve, simulate
from kvlens.config import ENV_PREFIX
from kvlens.console import install_hint
from kvlens.errors import InputError, SettingsError

COMMANDS = (serve, demo, analyze, convert, compare, simulate, replay, experiment, bandwidth)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # `simulate`'s optional TRACE would take `serve` for a trace: the server has its own parser.
    serving = argv[:2] == ["simulate", "serve"]
    parser = simulate.serve_parser() if serving else _parser()
    args = parser.parse_args(argv[2:] if serving else argv)
    logging.basicConfig(
        level=os.environ.get(f"{ENV_PREFIX}LOG_LEVEL", "INFO"), format="%(levelname)s %(name)s: %(message)s"
    )
    # httpx logs every request's URL at INFO, and a scrape URL's query may hold a secret.
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    command: Callable[[argparse.Namespace], int] = args.run
    try:
        return command(args)
    except (SettingsError, InputError) as error:
        print(f"kvlens: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        if error.filename is None:
            raise
        # A path the user named: missing, a directory, unreadable or unwritable. One line, no
        # traceback: this is an ordinary mistake, not a defect.
        print(f"kvlens: {error.filename}: {error.strerror or error}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as error:
        if (error.name or "").split(".")[0] not in ("rich", "scipy"):
            raise
        print(f"kvlens: this command needs the analyze extra: {install_hint('analyze')}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvlens", description="Is your prefix cache actually paying off?")
    parser.add_argument("--version", action="version", version=f"kvlens {__version__}")
    commands = parser.add_subparsers(required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(commands)
    return parser
