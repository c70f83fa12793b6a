"""Output at the terminal: its width (``COLUMNS`` when set, as rich reads it; 80 when stdout is
no terminal), plain lines wrapped between words, never through a number, a ratio as every text
report spells it (:func:`percent`), a name's control characters shown as their escapes
(:func:`visible`), and the one rich console every table and line printed with
rich goes through (:func:`console`)."""

from __future__ import annotations

import functools
import re
import shutil
import textwrap
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console
    from rich.text import Text

NARROWEST = 80  # what every text output is laid out to fit; wider terminals may show more


def percent(value: float | None, digits: int = 2) -> str:
    """A ratio as a percentage (``0.0154`` -> ``1.54 %``); ``n/a`` where there is none."""
    return "n/a" if value is None else f"{100 * value:.{digits}f} %"


# What would end a line or act on the screen rather than show: C0 and C1 controls, DEL, and the
# separators str.splitlines also breaks at (U+2028, U+2029)
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(found: re.Match[str]) -> str:
    char = found.group()
    return _ESCAPES.get(char) or (f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}")


def visible(text: str) -> str:
    """``text`` with each control character shown as its escape (``a\\nb``, ``\\x1b``, ``\\u2028``),
    as Python's repr spells it: a name from the records or the command line (an arm, an endpoint,
    a request id) put into a line of a report stays inside that line, and an escape sequence is
    never sent to whoever reads the file. Text without one is returned as it is."""
    return _CONTROL.sub(_escape, text)


# The same but the newline: text kvlens prints on lines of its own at a terminal (rich's)
_CONTROL_IN_LINES = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029]")


def printable(text: str) -> str:
    """``text`` with each control character but the newline shown as its escape (as
    :func:`visible`): what kvlens prints at a terminal may hold a name from the records or the
    command line, whose ESC or CSI would set a window's title, clear the screen or recolour it,
    and whose carriage return would overwrite the line, instead of showing."""
    return _CONTROL_IN_LINES.sub(_escape, text)


def width() -> int:
    return shutil.get_terminal_size((NARROWEST, 24)).columns


def wrap(line: str, columns: int, indent: str = "  ") -> list[str]:
    """``line`` in lines of at most ``columns``, continued with ``indent``; a word longer than
    the width (a path) keeps its own line whole."""
    if len(line) <= columns:
        return [line]  # as laid out: its spaces may align columns
    return textwrap.wrap(
        line, columns, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False
    ) or [""]


def wrapped(lines: list[str], columns: int) -> list[str]:
    return [part for line in lines for part in wrap(line, columns)]


def console(**options: Any) -> Console:
    """A rich console on which a string is always text as written: every string kvlens prints
    with rich may hold a name from the records or the command line (a model, tenant, request id,
    arm, file name), and rich would read "[/x]" as markup (MarkupError), "[bold]z" as a style
    (its brackets lost) and ":smile:" as an emoji, in a table's title, header or cell as in a
    line; and it would pass a name's escape sequences to the terminal, so every string it renders
    goes through :func:`printable`. Styles are given as ``rich.text.Text`` spans, never as markup
    in a string. (rich is the analyze extra: imported here, when a table is printed.)"""
    return _text_console()(markup=False, emoji=False, **options)


@functools.cache
def _text_console() -> type[Console]:
    from rich.console import Console

    class TextConsole(Console):
        def render_str(self, text: str, **options: Any) -> Text:
            return super().render_str(printable(text), **options)

    return TextConsole
