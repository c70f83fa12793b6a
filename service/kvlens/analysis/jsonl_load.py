"""JSON lines into a DuckDB table, for the ``duckdb`` engine (:func:`kvlens.analysis.columnar.load`).

A chunk of lines that the strict decoder accepts (:func:`kvlens.analysis.reader.parsed_of`:
every line one valid kvlens record of known fields only) is written to a temporary file and
parsed by DuckDB's ``read_json`` into typed columns: building a Python object for each value
and a column from them cost several times the decoding (``records._wire_batch``), parsing the
text again in DuckDB a fraction of it. The values are the decoder's: every line is strict JSON
with each field of its kind (a count is a JSON integer, a duration a finite number, a label a
string), so DuckDB's leniencies (``5.0`` or ``"5"`` read into an integer column, NaN, trailing
commas) never meet the text. The two checks the decoder leaves are made here on the parsed
columns, as :func:`kvlens.records.batch_from_json_array` makes them: ``cached_tokens <=
prompt_tokens`` and valid labels. A chunk that fails one, or that DuckDB refuses (it refuses a
duplicate key, where the decoder keeps the last value), is read by the Python validator as
before; so is every chunk holding a bad line, a blank line or another format, and every chunk
once read_json's buffers (32 MiB) do not fit in the memory limit. Either way the records, the
skipped lines' counts, reasons and line numbers, and the rows' order are the same
(tests/unit/test_jsonl_load.py draws tricky lines to hold them to it).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from kvlens import records
from kvlens.analysis import reader

STAGED = "kvlens_parsed_lines"  # the temp table a parsed chunk waits in before its checks
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
        parse = _Parser(connection, columns, Path(directory))
        offset = 0
        for item in reader.parsed_of(
            [path], result, parse, format_name=format_name, model=model, progress=progress
        ):
            if isinstance(item, records.RecordBatch):
                if not len(item):
                    continue
                chunk = _columns_of(item, columns)
                chunk["src"] = np.full(len(item), src, np.int32)
                chunk["row"] = np.arange(offset, offset + len(item), dtype=np.int64)
                connection.register("chunk", chunk)
                connection.execute(f"INSERT INTO {table} SELECT {names}, src, row FROM chunk")
                connection.unregister("chunk")
                offset += len(item)
            else:
                connection.execute(
                    f"INSERT INTO {table} SELECT {names}, {int(src)}, {offset} + ordinality - 1 FROM {STAGED}"
                )
                offset += item
    connection.execute(f"DROP TABLE IF EXISTS {STAGED}")


class _Parser:
    """``parse`` for :func:`kvlens.analysis.reader.parsed_of`: the chunk's lines into the temp
    table :data:`STAGED` (the wanted columns, those the checks read, and each line's ordinal);
    their number, or None when a check fails or DuckDB refuses the text."""

    def __init__(self, connection: Any, columns: Mapping[str, str], directory: Path) -> None:
        import duckdb

        self.connection = connection
        self.directory = directory
        self.refused = (duckdb.InvalidInputException, duckdb.ConversionException)
        self.too_small = duckdb.OutOfMemoryException
        self.enabled = True
        self.files = 0
        self.columns = {**columns, "prompt_tokens": "BIGINT", "cached_tokens": "BIGINT"}

    def __call__(self, chunk: bytes, lines: int) -> int | None:
        if not self.enabled:
            return None
        # A label no line names is absent from every record: not read, nothing to check (a key
        # spelled with escapes needs a backslash).
        escaped = b"\\" in chunk
        labels = [name for name in records.LABEL_FIELDS if escaped or name.encode() in chunk]
        wanted = {**self.columns, **dict.fromkeys(labels, "VARCHAR")}
        typed = "{" + ", ".join(f"{name}: '{sql}'" for name, sql in wanted.items()) + "}"
        # an empty string is an absent value, as in a batch
        selected = ", ".join(
            f"NULLIF({name}, '') AS {name}" if _KINDS[name] is str else name for name in wanted
        )
        # a new name each time: DuckDB may cache a file's contents by name
        file = self.directory / f"{self.files}.jsonl"
        self.files += 1
        file.write_bytes(chunk)
        quoted = str(file).replace("'", "''")
        try:
            # ordinality: the line's place in the file (checked with 4 threads on 190 MB files;
            # a chunk is smaller than one of read_json's 32 MiB buffers anyway)
            self.connection.execute(
                f"CREATE OR REPLACE TEMP TABLE {STAGED} AS SELECT {selected}, ordinality "
                f"FROM read_json('{quoted}', format = 'newline_delimited', records = true, "
                f"columns = {typed}) WITH ORDINALITY"
            )
        except self.refused:
            return None
        except self.too_small:  # read_json's buffers (32 MiB) do not fit: the validator reads
            self.enabled = False
            return None
        finally:
            file.unlink()
        checks = ["count(*)", "count(*) FILTER (WHERE cached_tokens > prompt_tokens)"]
        checks += [f"list(DISTINCT {name})" for name in labels]
        ((count, cached_over, *distinct),) = self.connection.execute(
            f"SELECT {', '.join(checks)} FROM {STAGED}"
        ).fetchall()
        if count != lines or cached_over or not all(map(records.labels_valid, distinct)):
            return None
        return int(count)


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
