"""JSON lines into a DuckDB table, for the ``duckdb`` engine (:func:`kvlens.analysis.columnar.load`).

A chunk of lines that the strict decoder accepts (:func:`kvlens.analysis.reader.parsed_of`:
every line one valid kvlens record of known fields only) is written to a temporary file and
parsed by DuckDB's ``read_json`` into typed columns: building a Python object for each value
and a column from them cost several times the decoding (``records._wire_batch``), parsing the
text again in DuckDB a fraction of it. The values are the decoder's: every line is strict JSON
with each field of its kind (a count is a JSON integer, a duration a finite number, a label a
string), so DuckDB's leniencies (``5.0`` or ``"5"`` read into an integer column, NaN, trailing
commas) never meet the text. The two checks the decoder leaves, as
:func:`kvlens.records.batch_from_json_array` makes them (``cached_tokens <= prompt_tokens``,
valid labels), are made in the statement that inserts the rows. A chunk that fails one, or
that DuckDB refuses (it refuses a
duplicate key, where the decoder keeps the last value), is read by the Python validator as
before; so is every chunk holding a bad line, a blank line or another format, and every chunk
once read_json's buffers (32 MiB) do not fit in the memory limit. Either way the records, the
skipped lines' counts, reasons and line numbers, and the rows' order are the same
(tests/unit/test_jsonl_load.py draws tricky lines to hold them to it). The temporary file, one
chunk (about 8 MiB) at a time, is in the system's temporary directory (``TMPDIR``).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from kvlens import records
from kvlens.analysis import reader

STAGED = "kvlens_parsed_lines"  # a chunk with labels past ASCII waits here for the Python label check
_KINDS = {spec.name: spec.kind for spec in records.FIELDS}


def load_file(
    connection: Any,
    table: str,
    columns: Mapping[str, str],
    src: int,
    path: str,
    result: reader.ReadResult,
    *,
    format_name: str | None = None,
    model: str | None = None,
    progress: Callable[[int], None] | None = None,
) -> None:
    """Insert the valid records of the JSON-lines file ``path`` into ``table``: ``columns`` (name:
    SQL type), then ``src``, then ``row``, the record's number among the file's valid records
    (from 0, in the file's order). Lines, skips and formats go to ``result``."""
    names = ", ".join(columns)
    with tempfile.TemporaryDirectory(prefix="kvlens-lines-") as directory:
        parse = _Parser(connection, table, columns, src, Path(directory))
        for item in reader.parsed_of(
            [path], result, parse, format_name=format_name, model=model, progress=progress
        ):
            if isinstance(item, records.RecordBatch):
                if not len(item):
                    continue
                chunk = _columns_of(item, columns)
                chunk["src"] = np.full(len(item), src, np.int32)
                chunk["row"] = np.arange(parse.offset, parse.offset + len(item), dtype=np.int64)
                connection.register("chunk", chunk)
                connection.execute(f"INSERT INTO {table} SELECT {names}, src, row FROM chunk")
                connection.unregister("chunk")
                parse.offset += len(item)
    connection.execute(f"DROP TABLE IF EXISTS {STAGED}")


class _Parser:
    """``parse`` for :func:`kvlens.analysis.reader.parsed_of`: inserts the chunk's records into
    the table (rows from :attr:`offset` on, which it advances) and returns their number, or
    None when a check fails or DuckDB refuses the text (nothing inserted).

    One statement parses, checks and inserts; a check that fails raises inside it, so DuckDB
    rolls the whole insert back. Labels are checked there only as printable ASCII of at most
    :data:`~kvlens.records.MAX_LABEL_BYTES`; a chunk with another label is parsed into the temp
    table :data:`STAGED` instead, where :func:`kvlens.records.labels_valid` checks the distinct
    labels, then inserted from it."""

    def __init__(
        self, connection: Any, table: str, columns: Mapping[str, str], src: int, directory: Path
    ) -> None:
        import duckdb

        self.connection = connection
        self.table = table
        self.columns = columns
        self.src = int(src)
        self.directory = directory
        self.offset = 0  # the file's valid records inserted so far
        self.refused = (duckdb.InvalidInputException, duckdb.ConversionException)
        self.too_small = duckdb.OutOfMemoryException
        self.enabled = True
        self.files = 0

    def __call__(self, chunk: bytes, lines: int) -> int | None:
        if not self.enabled:
            return None
        # A label no line names is absent from every record: not read, nothing to check (a key
        # spelled with escapes needs a backslash).
        escaped = b"\\" in chunk
        labels = [name for name in records.LABEL_FIELDS if escaped or name.encode() in chunk]
        # a new name each time: DuckDB may cache a file's contents by name
        file = self.directory / f"{self.files}.jsonl"
        self.files += 1
        try:
            file.write_bytes(chunk)
        except OSError:  # the temporary directory is full or gone: the validator reads, as before
            file.unlink(missing_ok=True)
            self.enabled = False
            return None
        try:
            count = self._insert(self._read(file, labels), labels, lines)
        except self.too_small:  # read_json's buffers (32 MiB) do not fit: the validator reads
            self.enabled = False
            return None
        finally:
            file.unlink()
        if count is not None:
            self.offset += count
        return count

    def _read(self, file: Path, labels: list[str]) -> str:
        """The chunk's lines as a query: the wanted columns, those the checks read, ordinality."""
        wanted = {**self.columns, "prompt_tokens": "BIGINT", "cached_tokens": "BIGINT"}
        wanted.update(dict.fromkeys(labels, "VARCHAR"))
        typed = "{" + ", ".join(f"{name}: '{sql}'" for name, sql in wanted.items()) + "}"
        # an empty string is an absent value, as in a batch
        selected = ", ".join(
            f"NULLIF({name}, '') AS {name}" if _KINDS[name] is str else name for name in wanted
        )
        quoted = str(file).replace("'", "''")
        # ordinality: the line's place in the file (checked with 4 threads on 190 MB files; a
        # chunk is smaller than one of read_json's 32 MiB buffers anyway)
        return (
            f"SELECT {selected}, ordinality FROM read_json('{quoted}', format = 'newline_delimited', "
            f"records = true, columns = {typed}) WITH ORDINALITY"
        )

    def _insert(self, lines_query: str, labels: list[str], lines: int) -> int | None:
        insert = (
            f"INSERT INTO {self.table} SELECT {', '.join(self.columns)}, {self.src}, "
            f"{self.offset} + ordinality - 1 FROM "
        )
        ascii_labels = " AND ".join(
            f"({name} IS NULL OR regexp_full_match({name}, '[ -~]{{0,{records.MAX_LABEL_BYTES}}}'))"
            for name in labels
        )
        try:
            ((count,),) = self.connection.execute(
                f"{insert} ({lines_query}) WHERE CASE "
                "WHEN cached_tokens > prompt_tokens THEN error('kvlens: cached_tokens') "
                f"WHEN NOT ({ascii_labels or 'true'}) THEN error('kvlens: labels') ELSE true END"
            ).fetchall()
        except self.refused as error:
            if "kvlens: labels" not in str(error):
                return None  # cached_tokens above prompt_tokens, or text DuckDB refuses
            count = self._staged(lines_query, labels)
            if count is None:
                return None
            self.connection.execute(f"{insert} {STAGED}")
        if count != lines:  # never seen: DuckDB read other lines than the decoder
            self.connection.execute(
                f"DELETE FROM {self.table} WHERE src = {self.src} AND row >= {self.offset}"
            )
            return None
        return int(count)

    def _staged(self, lines_query: str, labels: list[str]) -> int | None:
        """The chunk's number of lines, parsed into :data:`STAGED`, when both checks pass (the
        insert may have stopped at a label before reaching a count above its prompt)."""
        try:
            self.connection.execute(f"CREATE OR REPLACE TEMP TABLE {STAGED} AS {lines_query}")
        except self.refused:
            return None
        checks = ", ".join(
            ["count(*)", "count(*) FILTER (WHERE cached_tokens > prompt_tokens)"]
            + [f"list(DISTINCT {name})" for name in labels]
        )
        ((count, cached_over, *values),) = self.connection.execute(
            f"SELECT {checks} FROM {STAGED}"
        ).fetchall()
        return int(count) if not cached_over and all(map(records.labels_valid, values)) else None


def _columns_of(batch: records.RecordBatch, columns: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in columns:
        if name == "model":
            names = np.array([*batch.model_names, None], dtype=object)
            out[name] = names[batch.model_codes]  # -1 (none) picks the trailing None
        else:
            values = getattr(batch, name)
            if isinstance(values, np.ndarray):
                # absent counts are -1 in a batch; NaN becomes NULL in DuckDB's scan
                absent = values.dtype.kind == "i" and bool((values < 0).any())
                out[name] = np.where(values < 0, np.nan, values) if absent else values
            else:
                out[name] = np.array(values, dtype=object)
    return out
