"""Rewrite the documentation's generated tables from the code: the metrics (docs/metrics.md),
the settings (docs/settings.md), the OTLP attributes read (docs/sources.md) and every command's
flags (docs/cli.md). Each table sits between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->``;
tests/unit/test_docs.py fails when a page differs from what this script writes.

    .venv/bin/python scripts/docs_tables.py
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Iterator
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"


def metrics() -> str:
    from kvlens.exporter.metrics import metrics_table

    return metrics_table()


def settings() -> str:
    from kvlens.config import settings_table

    return settings_table()


def otlp() -> str:
    from kvlens.sources.otlp import attributes_table

    return attributes_table()


def _commands() -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every command's parser, by its command line, in the order `kvlens --help` lists them."""
    from kvlens.cli import parser_of

    def walk(name: str, parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
        subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subparsers:
            yield name, parser
            return
        for sub_name, sub in subparsers[0].choices.items():
            yield from walk(f"{name} {sub_name}", sub)
            if f"{name} {sub_name}" == "kvlens simulate":  # its own parser (see parser_of)
                yield "kvlens simulate serve", parser_of(["simulate", "serve"])

    yield from walk("kvlens", parser_of([]))


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _flag_rows(parser: argparse.ArgumentParser) -> Iterator[str]:
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        if action.option_strings:
            name = ", ".join(action.option_strings)
            if action.nargs != 0:
                name += " " + formatter._format_args(action, action.dest.upper())
        else:
            name = formatter._format_args(action, action.dest)
        meaning = formatter._expand_help(action) if action.help else ""
        yield f"| `{name}` | {_cell(meaning)} |"


def cli() -> str:
    """A section per command: its description and a table of its arguments and flags."""
    sections = []
    for name, parser in _commands():
        rows = ["| argument | meaning |", "|---|---|", *_flag_rows(parser)]
        description = " ".join((parser.description or "").split())
        sections.append(f"### `{name}`\n\n" + (f"{description}\n\n" if description else "") + "\n".join(rows))
    return "\n\n".join(sections)


# page -> its generated tables, by marker name
TABLES: dict[str, dict[str, Callable[[], str]]] = {
    "metrics.md": {"metrics": metrics},
    "settings.md": {"settings": settings},
    "sources.md": {"otlp": otlp},
    "cli.md": {"cli": cli},
}


def rendered(page: str) -> str:
    """The page as it should be: its tables regenerated, the rest as it is."""
    text = (DOCS / page).read_text()
    for name, table in TABLES[page].items():
        pattern = rf"(<!-- {name}:start -->\n).*?(\n<!-- {name}:end -->)"
        if not re.search(pattern, text, flags=re.S):
            raise ValueError(f"docs/{page} lacks the markers of its {name} table")
        body = table()
        text = re.sub(pattern, lambda m, body=body: m.group(1) + body + m.group(2), text, flags=re.S)
    return text


def main() -> None:
    for page in TABLES:
        (DOCS / page).write_text(rendered(page))


if __name__ == "__main__":
    main()
