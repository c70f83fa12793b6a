"""Every literal kvlens writes into SQL, made here: text, numbers and file names.

SQL has two readers. DuckDB runs in kvlens's own process; its dialect is known (a string is
``'...'`` with a quote doubled, a backslash an ordinary character), so any text is written
exactly (:func:`duckdb_text`, :func:`duckdb_path`). The script ``kvlens analyze --print-sql``
prints is run in an engine kvlens does not know, and dialects read one literal differently:
Spark SQL, Hive, BigQuery and MySQL take a backslash as an escape (``'x\\'`` does not end where
DuckDB, Trino, DataFusion and PostgreSQL end it, and a name ending in ``\\'`` injects SQL), and
Spark SQL and Hive replace ``${...}`` inside literals with variables. No spelling of a quote or
a backslash is read alike by all, so a printed literal holds only characters that mean
themselves in every one, :data:`PORTABLE`; text with another is refused naming it
(:func:`portable_text`), never written in a form some engine reads as other text or as SQL.
Numbers are finite, written as Python's ``repr`` (``1e-05``, ``0.5``), which every one reads.
"""

from __future__ import annotations

import math
import os
import re

from kvlens.errors import InputError, SettingsError

# Characters a printed literal never holds, and why.
UNPORTABLE = {
    "'": "it ends a string literal (ANSI engines double it, others escape it with a backslash)",
    "\\": "Spark SQL, Hive, BigQuery and MySQL read it as an escape, ANSI engines as itself",
    "$": "Spark SQL and Hive replace ${...} inside string literals with variables",
    ";": "tools that split a script into statements at each ; would cut the literal",
}
PORTABLE = (
    "printable characters (Python's str.isprintable: no control character, no line break) but "
    + " ".join(UNPORTABLE)
)


def portable_text(value: str, what: str) -> str:
    """``value`` as a string literal every dialect reads as ``value`` (:data:`PORTABLE`), or a
    :class:`SettingsError` naming ``what`` (the setting it comes from) and the character."""
    for char in value:
        if char in UNPORTABLE or not char.isprintable():
            why = UNPORTABLE.get(char, "it is not printable")
            raise SettingsError(
                f"{what} {value!r} holds {char!r}, which the printed SQL cannot hold the same way in "
                f"every engine ({why}): --print-sql takes names of {PORTABLE}"
            )
    return f"'{value}'"


def duckdb_text(value: str) -> str:
    """``value`` as a DuckDB string literal (any text: a quote doubled, nothing else special)."""
    return "'" + value.replace("'", "''") + "'"


def number(value: float) -> str:
    """A finite number as a literal every dialect reads (NaN and infinities have no literal in
    most)."""
    if not math.isfinite(value):
        raise ValueError(f"a SQL number must be finite, not {value!r}")
    return repr(int(value)) if isinstance(value, int) else repr(float(value))


def scanned_name(path: str) -> str:
    """The name DuckDB gives a local file it reads by :func:`duckdb_path` (its ``filename``
    column, ``parquet_schema``'s ``file_name``): absolute; a URL as it is."""
    return path if "://" in path else os.path.abspath(path)


def duckdb_names(path: str) -> bool:
    """Whether :func:`duckdb_path` can name ``path`` to DuckDB: its pattern matcher never finds
    a name holding a backslash, so a path with both a backslash and one of ``*?[`` (which make
    DuckDB read it as a pattern) cannot be."""
    name = scanned_name(path)
    return "://" in path or "\\" not in name or not re.search(r"[*?\[]", name)


def duckdb_path(path: str) -> str:
    """``path`` as SQL text DuckDB reads as that one file: absolute (DuckDB expands a leading
    ``~``) with each of ``*?[`` in brackets (DuckDB reads them as a pattern: a file named
    ``x*.parquet`` would read ``x1.parquet`` beside it too). A URL is left as it is: its
    wildcards are meant. A path DuckDB cannot name (:func:`duckdb_names`) is refused, naming it
    (JSON lines of such a name are read a chunk at a time instead, never by their name)."""
    if "://" in path:
        return duckdb_text(path)
    if not duckdb_names(path):
        raise InputError(
            f"{path}: DuckDB cannot read a file whose path holds both a backslash and one of *?[ "
            "(it reads such a name as a pattern and never matches a backslash): rename it"
        )
    return duckdb_text(re.sub(r"([*?\[])", r"[\1]", scanned_name(path)))
