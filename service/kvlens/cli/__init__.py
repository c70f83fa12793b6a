"""The ``kvlens`` command line: one module per command (each its ``add_parser`` and its ``run``),
as vLLM's ``entrypoints/cli/`` does. A command parses, calls its room and prints; the work lives
in the room."""

from __future__ import annotations

import argparse
import atexit
import errno
import gc
import importlib
import os
import signal
import sys
from collections.abc import Callable, Sequence
from types import ModuleType

from kvlens.cli import blas  # noqa: F401  # first: before numpy is imported
from kvlens.cli.common import Parser, configure_logging, examples, log_flags
from kvlens.errors import InputError, MissingExtra, SettingsError

# The interpreter's last garbage collections walk every object alive at exit (pydantic's
# schemas, numpy's and DuckDB's modules): 0.1-0.15 s at the end of every command. Frozen first,
# they are left to the operating system. The exit handlers, logging's flush and the standard
# streams' flush all still run; only the finalizers of cycles left unreachable are skipped
# (os._exit, as mypy ends, would skip everything).
atexit.register(gc.freeze)

# Each command's one line in the top-level help (its parser takes it from here, so `kvlens --help`
# imports no command), by the name of its module in kvlens.cli but for those in MODULES.
SUMMARIES = {
    "serve": "run the sidecar: POST /v1/records, GET /metrics",
    "demo": "run the sidecar fed live by the simulator replaying a real trace (bundled)",
    "analyze": "report, diagnose and calibrate recorded traffic",
    "convert": "write records as Parquet (what the duckdb engine reads fastest)",
    "compare": "compare cache-off / cold / warm replays of one request sequence",
    "simulate": "replay a trace on a fleet: reachable vs delivered reuse per policy and capacity",
    "replay": "replay a trace against an OpenAI-compatible endpoint as one arm; kvlens records out",
    "experiment": "the articles' experiments against endpoints",
    "bandwidth": "decode traffic model: would W4A16 speed up decode?",
    "import": "another benchmark tool's per-request results as kvlens records",
    "audit": "check the running fleet against the articles' rules (isolation of cache scopes)",
}
COMMANDS = tuple(SUMMARIES)
MODULES = {"import": "importer"}  # `import` is a Python keyword: no module can have that name
# Errors of a write to an open file: a full disk, a quota, a file past its size limit, a failing device.
_WRITE_FAILURES = {
    errno.ENOSPC,
    errno.EDQUOT,
    errno.EFBIG,
    errno.EIO,
}  # `import` is a Python keyword: no module can have that name


def command_modules(argv: Sequence[str]) -> list[ModuleType]:
    """The modules of the commands the parser needs: only the one ``argv`` runs (the others
    import the server, HTTP clients and the terminal UI: half a CPU second at every start of an
    offline command), or all of them for the top-level help or a name that is no command."""
    named = [name for name in COMMANDS if list(argv[:1]) == [name]]
    return [importlib.import_module(f"kvlens.cli.{MODULES.get(name, name)}") for name in named or COMMANDS]


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser_of(argv, summaries=True).parse_args(argv[2:] if _simulate_group(argv) else argv)
    args.argv = argv  # a command that can be resumed names itself (kvlens experiment)
    try:
        configure_logging(args)
    except SettingsError as error:
        print(f"kvlens: {error}", file=sys.stderr)
        return 2
    command: Callable[[argparse.Namespace], int] = args.run
    try:
        status = command(args)
        sys.stdout.flush()  # a write that fails at exit would be a traceback Python prints itself
        return status
    except KeyboardInterrupt:  # Ctrl-C is how demo, serve and a replay are stopped: not a defect
        return 128 + signal.SIGINT
    except BrokenPipeError:  # `kvlens analyze --json | head`: the reader has left; say no more
        # Python flushes stdout again at exit and would print that error too: point it nowhere.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except (SettingsError, InputError) as error:
        print(f"kvlens: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        if error.filename is None and error.errno in _WRITE_FAILURES:
            # stdout (or a file being written) on a full or failing disk: the output is cut,
            # which exit 1 says; the error is the operator's to mend, not a defect of kvlens
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second flush
            print(f"kvlens: cannot write the output: {error.strerror or error}", file=sys.stderr)
            return 1
        if error.filename is None:
            raise
        # A path the user named: missing, a directory, unreadable or unwritable. One line, no
        # traceback: this is an ordinary mistake, not a defect.
        print(f"kvlens: {error.filename}: {error.strerror or error}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as error:
        if (error.name or "").split(".")[0] != "rich":
            raise
        print(f"kvlens: {MissingExtra('this command', 'analyze')}", file=sys.stderr)
        return 2


class _Version(argparse.Action):
    """``--version``: the version is looked up only when asked (:data:`kvlens.__version__`)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **_: object) -> None:
        super().__init__(
            option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, help="show the version and exit"
        )

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        import kvlens

        print(f"kvlens {kvlens.__version__}")
        parser.exit()


def parser_of(argv: Sequence[str], summaries: bool = False) -> argparse.ArgumentParser:
    """``kvlens``'s parser, or ``simulate run``'s or ``simulate serve``'s: `simulate`'s optional
    TRACE would take `run` or `serve` for a trace, so each has its own parser (given the argv
    after them). ``summaries``: when ``argv`` names no command (the top-level help, a name that is
    no command), the commands as their names and summaries alone, without importing them."""
    if _simulate_group(argv):
        (simulate,) = command_modules(["simulate"])
        parser: argparse.ArgumentParser = simulate.group_parser(argv[1])
    else:
        parser = Parser(
            prog="kvlens",
            description="Is your prefix cache actually paying off?",
            epilog=examples("kvlens demo", "kvlens analyze records.jsonl", "kvlens COMMAND --help"),
        )
        parser.add_argument("--version", action=_Version)
        commands = parser.add_subparsers(required=True, metavar="COMMAND")
        if summaries and not (argv and argv[0] in COMMANDS):
            for name, summary in SUMMARIES.items():
                commands.add_parser(name, help=summary)
        else:
            for command in command_modules(argv):
                command.add_parser(commands)
    _log_flags_on_each_command(parser)
    return parser


def _simulate_group(argv: Sequence[str]) -> bool:
    """Whether ``argv`` is ``simulate run ...`` or ``simulate serve ...``
    (:func:`kvlens.cli.simulate.group_parser`)."""
    return len(argv) >= 2 and argv[0] == "simulate" and argv[1] in ("run", "serve")


def _log_flags_on_each_command(parser: argparse.ArgumentParser) -> None:
    """On the commands themselves (a subcommand's defaults would overwrite its parent's flags)."""
    subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subparsers:
        log_flags(parser)
        return
    for sub in dict.fromkeys(subparsers[0].choices.values()):  # an alias maps to the same parser
        _log_flags_on_each_command(sub)
