"""The label rule: what a model's, replica's or tenant's name must be to become a Prometheus
label (and a Parquet or DuckDB column value). Defined once here, by :data:`MAX_LABEL_BYTES` and
:func:`allowed`; its three spellings are all built from those two:

- :func:`valid_label`, Python, which decides (records, settings, the exporter);
- :func:`invalid_label_sql`, SQL with an RE2 pattern (:func:`re2_pattern`), for rows no Python
  reads when too many distinct labels are too many to check in Python;
- :func:`beyond_short_ascii`, a GLOB prefilter, which leaves only the labels Python must see:
  short text of :data:`SHORT_ASCII` (the allowed characters of ASCII) is valid without a look.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterable
from typing import Final

MAX_LABEL_BYTES: Final = 128


def allowed(point: int) -> bool:
    """Whether the code point ``point`` may be in a label: Python's ``str.isprintable`` (which no
    surrogate is; UTF-8 cannot hold a lone one either)."""
    return chr(point).isprintable() and not 0xD800 <= point <= 0xDFFF


def valid_label(value: str) -> bool:
    """Printable, valid UTF-8 (no lone surrogates) and short: safe for any exposition."""
    if not value.isprintable():  # all(allowed(ord(c)) for c in value), at C speed
        return False
    try:
        return len(value.encode("utf-8")) <= MAX_LABEL_BYTES
    except UnicodeEncodeError:
        return False


def checked_label(value: str) -> str:
    """``value`` when it is a valid label, else ValueError (a pydantic validator)."""
    if not valid_label(value):
        raise ValueError(f"must be printable UTF-8 of at most {MAX_LABEL_BYTES} bytes")
    return value


def labels_valid(labels: Iterable[str | None]) -> bool:
    """Whether every one of ``labels`` is a valid label; None and "" are absent ones."""
    return all(valid_label(label) for label in set(labels) if label)


def _runs(points: range, member: Callable[[int], bool]) -> list[tuple[int, int]]:
    """The runs of ``points`` that are members, as (first, last)."""
    runs: list[tuple[int, int]] = []
    start = None
    for point in points:
        if member(point):
            if start is None:
                start = point
        elif start is not None:
            runs.append((start, point - 1))
            start = None
    if start is not None:
        runs.append((start, points[-1]))
    return runs


def _short_ascii() -> tuple[str, str]:
    """The allowed characters of ASCII, one run (' '..'~'): one byte each, so text of them alone
    is valid up to MAX_LABEL_BYTES characters."""
    (run,) = _runs(range(128), allowed)
    low, high = chr(run[0]), chr(run[1])
    if {low, high} & set("]-!'^\\"):  # written into a GLOB class between quotes
        raise AssertionError(f"the GLOB class cannot hold {low!r}..{high!r}")
    return low, high


SHORT_ASCII: Final = _short_ascii()


@functools.cache
def re2_pattern() -> str:
    """A regular expression (RE2, DuckDB's) of the strings of allowed characters, built from
    :func:`allowed` code point by code point: RE2's Unicode classes are of another Unicode
    version (they know thousands of characters Python 3.11 does not, which a JSON line would
    then have refused and Parquet kept)."""
    refused = _runs(range(sys.maxunicode + 1), lambda point: not allowed(point))
    excluded = "".join(f"\\x{{{low:x}}}-\\x{{{high:x}}}" for low, high in refused)
    return f"[^{excluded}]*"


def invalid_label_sql(name: str) -> str:
    """SQL: the text column ``name`` is not a valid label (its every row matched by RE2)."""
    too_long = f"octet_length(encode({name})) > {MAX_LABEL_BYTES}"
    return f"({too_long} OR NOT regexp_full_match({name}, '{re2_pattern()}'))"


def beyond_short_ascii(name: str) -> str:
    """SQL: the text column ``name`` holds a character outside :data:`SHORT_ASCII` (a native
    GLOB, no RE2) or more than :data:`MAX_LABEL_BYTES` bytes. Short text of those characters is
    a valid label; the others are for :func:`valid_label`."""
    low, high = SHORT_ASCII
    return f"({name} GLOB '*[!{low}-{high}]*' OR strlen({name}) > {MAX_LABEL_BYTES})"
