"""JSON lines into a DuckDB table, for the ``duckdb`` engine (:func:`kvlens.analysis.duckdb.inputs.load`).

A regular file (plain or gzip) whose every line is a record the strict decoder accepts is
inserted in one ``read_json`` statement, which DuckDB runs in a thread while the decoder proves
the lines a chunk at a time (:func:`_whole_file`); the first chunk that fails stops DuckDB, and
the file is then read a chunk at a time as follows (so is a pipe, and a file of another format).

A chunk of lines that the strict decoder accepts (:func:`kvlens.analysis.reader.parsed_of`:
every line one valid kvlens record of known fields only) is written to a temporary file and
parsed by DuckDB's ``read_json`` into typed columns: building a Python object for each value
and a column from them cost about the decoding again (``records.wire._Columns``), parsing the
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
(tests/unit/test_jsonl_load.py draws tricky lines to hold them to it). The temporary files, a
chunk (about 8 MiB) each, are in the system's temporary directory (``TMPDIR``): up to
:data:`COMMIT_CHUNKS` of them, kept until their transaction commits.

With ``hashes`` (``analyze``'s diagnosis), the records holding ``prefix_hashes`` also go to a
table of their own (:data:`HASHES_COLUMNS`, by ``src`` and ``row``), parsed from the text by a
second ``read_json`` for the files and chunks whose text may name them
(:func:`mentions_hashes`) and taken from the batch for the rest: in the records' table, empty
columns of them held 130 MB at 10M records.

Parsing each line once, by DuckDB alone, was tried and measured slower than the two parses: to
prove a line is what the validator accepts, every field must be read (the counts as JSON text)
and each of DuckDB's leniencies ruled out per row and per chunk, which cost more CPU than the
strict decode it saves (5.7 against 4.3 CPU s for 1M records). The decoder instead works one
chunk ahead, in a thread, while DuckDB parses (:func:`kvlens.analysis.reader.parsed_of`).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from kvlens import records, sqltext
from kvlens.analysis import reader
from kvlens.analysis.duckdb.engine import duckdb_module
from kvlens.analysis.duckdb.sql import labels_to_check
from kvlens.errors import InputError
from kvlens.records.labels import beyond_short_ascii
from kvlens.sources import jsonlines

STAGED = "kvlens_parsed_lines"  # a chunk with labels past ASCII waits here for the Python label check
# Chunks inserted in one transaction: a commit a chunk cost about a tenth of the read phase's CPU.
# Their files are kept until it commits, to be inserted again should DuckDB refuse a later
# chunk of it (an error aborts the whole transaction).
COMMIT_CHUNKS = 8
_KINDS = {spec.name: spec.kind for spec in records.FIELDS}
INTERRUPT_EVERY = 0.01  # seconds between interrupts of a DuckDB statement being stopped
# Distinct labels past printable ASCII fetched into Python at a time to be checked there, so
# that a file of millions of distinct such names is never held in Python at once (2M fetched
# at once took 1.4 GB more RSS).
LABELS_AT_A_TIME = 65_536
# The diagnosis's prefix potential reads these, kept apart from the records (a table of them for
# the few records that hold hashes): an empty column of each in the records' table held 130 MB
# of 10M records, past analyze's peak RSS goal of 1 GiB.
# With them, what the report's sections read of those records beyond the analysis's columns.
HASHES_COLUMNS = {
    "block_size": "BIGINT",
    "prefix_hashes": "JSON",
    "request_id": "VARCHAR",
    "replica": "VARCHAR",
    "tenant": "VARCHAR",
}


def mentions_hashes(text: bytes) -> bool:
    """Whether some line of ``text`` may hold ``prefix_hashes`` (a key spelled with escapes
    needs a backslash); when not, no record of it does, and its hashes are not read."""
    return b"prefix_hashes" in text or b"\\" in text


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
    hashes: str | None = None,
) -> None:
    """Insert the valid records of the JSON-lines file ``path`` into ``table``: ``columns`` (name:
    SQL type), then ``src``, then ``row``, the record's number among the file's valid records
    (from 0, in the file's order). Lines, skips and formats go to ``result``. ``hashes``: a
    table of ``src, row, block_size, prefix_hashes`` (:data:`HASHES_COLUMNS`) that gets the
    records holding ``prefix_hashes`` (:func:`mentions_hashes`)."""
    names = ", ".join(columns)
    with tempfile.TemporaryDirectory(prefix="kvlens-lines-") as directory:
        parse = _Parser(connection, table, columns, src, Path(directory), hashes)
        if _whole_file(parse, path, result, format_name=format_name, model=model, progress=progress):
            connection.execute(f"DROP TABLE IF EXISTS {STAGED}")
            return
        try:
            items = reader.parsed_of(
                [path], result, parse, format_name=format_name, model=model, progress=progress
            )
            for item in items:
                if not isinstance(item, records.RecordBatch) or not len(item):
                    continue
                parse.commit()  # the batch's rows are not among those a rollback inserts again
                chunk = _columns_of(item, columns)
                chunk["src"] = np.full(len(item), src, np.int32)
                chunk["row"] = np.arange(parse.offset, parse.offset + len(item), dtype=np.int64)
                connection.register("chunk", chunk)
                connection.execute(f"INSERT INTO {table} SELECT {names}, src, row FROM chunk")
                connection.unregister("chunk")
                parse.batch_hashes(item)
                parse.offset += len(item)
        except BaseException:
            parse.abandon()
            raise
        parse.commit()
    connection.execute(f"DROP TABLE IF EXISTS {STAGED}")


def _whole_file(
    parse: _Parser,
    path: str,
    result: reader.ReadResult,
    *,
    format_name: str | None,
    model: str | None,
    progress: Callable[[int], None] | None,
) -> bool:
    """Insert every record of the regular file ``path`` in one statement, when every line of it
    is a record the strict decoder accepts; False, nothing inserted, when one is not (or the
    file is another format, a pipe, read with ``model``): the caller reads it a chunk at a time.

    DuckDB parses the whole file (in a thread: it releases the GIL) while this thread proves its
    lines a chunk at a time with the strict decoder, as :func:`kvlens.analysis.reader.parsed_of`
    does for a chunk; a chunk that fails stops DuckDB early. One statement over the file costs
    DuckDB less than a statement, a temporary file and a check a chunk, and the two parses
    overlap on two cores. The rows are inserted in one transaction, rolled back on failure; the
    checks are :meth:`_Parser.insert_checked` and :meth:`_Parser.settle`'s, as for a chunk.
    The file is read twice, once by each parser: one written meanwhile (a log still growing, a
    file replaced) changes size, times or inode, and is then read a chunk at a time, so that
    DuckDB's rows are kept only when it read the lines the decoder proved."""
    if path == "-" or model is not None or format_name not in (None, "kvlens") or not os.path.isfile(path):
        return False
    if not sqltext.duckdb_names(path):  # the chunks are read under names of their own
        return False
    if (before := _identity(path)) is None:
        return False
    labels = list(records.LABEL_FIELDS)
    query = parse.lines_query(path, labels, "gzip" if jsonlines.is_gzip(path) else "none")
    outcome: list[int | BaseException] = []

    def insert() -> None:
        try:
            outcome.append(parse.insert_checked(query, labels))
        except BaseException as error:  # handed to the reading thread
            outcome.append(error)

    read = 0

    def counted(size: int) -> None:
        nonlocal read
        read += size
        if progress is not None:
            progress(size)

    warnings: list[str] = []  # logged if the file is inserted here, else when it is read again
    thread = threading.Thread(target=insert, name="kvlens-read-json", daemon=True)
    lines, proven, started, mentioned = 0, True, False, False
    try:
        chunks = reader.file_chunks([path], result, format_name, counted, warnings.append)
        for _, _, chunk, file_format in chunks:
            if not started:
                started = True
                if file_format != "kvlens":
                    proven = False
                    break
                parse.connection.execute("BEGIN")
                parse.open = True
                thread.start()
            count = reader.record_lines(chunk)
            refused = bool(outcome) and isinstance(outcome[0], BaseException)  # no use going on
            if refused or not count or records.strict_records(chunk) != count:
                proven = False
                break
            lines += count
            mentioned = mentioned or mentions_hashes(chunk)
        _stop(parse, thread, interrupt=not proven)
    except BaseException:  # Ctrl-C (also while DuckDB is awaited), an unreadable file: DuckDB
        _stop(parse, thread, interrupt=True)  # stops too, nothing is kept
        parse.abandon()
        raise
    inserted = outcome[0] if outcome else None  # an error (DuckDB refused the text): read again
    settled = None
    try:
        if proven and isinstance(inserted, int) and lines:
            settled = parse.settle(inserted, query, labels, lines)
            if settled == lines and mentioned and parse.hashes is not None:
                parse.insert_hashes(path, "gzip" if jsonlines.is_gzip(path) else "none")
    except (*parse.refused, parse.too_small):
        settled = None  # DuckDB refused the text (a duplicate key among the hashes' fields)
    except BaseException:
        parse.abandon()
        raise
    # else DuckDB may have read other lines (settle may read the file again: checked after it)
    if settled == lines and _identity(path) == before:
        parse.commit()
        result.lines += lines
        for warning in warnings:
            reader.log.warning("%s", warning)
        return True
    parse.abandon()
    if progress is not None and read:
        progress(-read)  # the chunks are read again
    return False


def _identity(path: str) -> tuple[int, ...] | None:
    """What changes when the file is written or replaced: its inode, size and times (None: it
    is gone)."""
    try:
        status = os.stat(path)
    except OSError:
        return None
    return (status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns)


def _stop(parse: _Parser, thread: threading.Thread, *, interrupt: bool) -> None:
    """Wait for DuckDB's insert in ``thread`` to end, interrupting it first if asked."""
    # DuckDB forgets an interrupt that comes before its statement starts (it then parsed the
    # whole file while this waited): interrupted again until the thread ends
    while interrupt and thread.is_alive():
        parse.connection.interrupt()
        thread.join(INTERRUPT_EVERY)
    if thread.is_alive():
        thread.join()


class _Parser:
    """``parse`` for :func:`kvlens.analysis.reader.parsed_of`: inserts the chunk's records into
    the table (rows from :attr:`offset` on, which it advances) and returns their number, or
    None when a check fails or DuckDB refuses the text (nothing inserted).

    One statement parses, checks and inserts the rows that pass the checks; when fewer than the
    chunk's lines pass, they are deleted and the chunk is parsed into the temp table
    :data:`STAGED`, where :func:`kvlens.records.labels_valid` checks the distinct labels (the
    statement checks them only as printable ASCII of at most
    :data:`~kvlens.records.MAX_LABEL_BYTES`), then inserted from it. The inserts run in
    transactions of up to :data:`COMMIT_CHUNKS` chunks (:meth:`commit`); when DuckDB refuses a
    chunk's text, the transaction is rolled back and its earlier chunks inserted again."""

    def __init__(
        self,
        connection: Any,
        table: str,
        columns: Mapping[str, str],
        src: int,
        directory: Path,
        hashes: str | None = None,
    ) -> None:
        duckdb = duckdb_module()
        self.connection = connection
        self.table = table
        self.hashes = hashes
        self.columns = columns
        self.src = int(src)
        self.directory = directory
        self.offset = 0  # the file's valid records inserted so far
        self.refused = (duckdb.InvalidInputException, duckdb.ConversionException)
        self.too_small = duckdb.OutOfMemoryException
        self.enabled = True
        self.files = 0
        self.open = False  # a transaction is open
        # in it: file, labels, lines, offset, whether it may hold hashes
        self.inserted: list[tuple[Path, list[str], int, int, bool]] = []

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
        if not self.open:
            self.connection.execute("BEGIN")
            self.open = True
        mentioned = self.hashes is not None and mentions_hashes(chunk)
        try:
            count = self._insert(self.lines_query(file, labels), labels, lines)
            if count is not None and mentioned:
                self.insert_hashes(file)  # DuckDB may refuse the hashes' fields' text alone
        except (*self.refused, self.too_small) as error:
            # text DuckDB refuses (a duplicate key), or read_json's buffers (32 MiB) do not fit
            # in memory: the validator reads the chunk, and for good after the latter
            file.unlink()
            self.enabled = not isinstance(error, self.too_small)
            self._again()
            return None
        if count is None:
            file.unlink()
            return None
        self.inserted.append((file, labels, lines, self.offset, mentioned))
        self.offset += count
        if len(self.inserted) >= COMMIT_CHUNKS:
            self.commit()
        return count

    def commit(self) -> None:
        """Commit the open transaction, if any."""
        if self.open:
            self.connection.execute("COMMIT")
            self.open = False
        for file, *_ in self.inserted:
            file.unlink()
        self.inserted.clear()

    def abandon(self) -> None:
        """Roll the open transaction back (the load failed)."""
        if self.open:
            self.open = False
            with contextlib.suppress(Exception):  # the connection may be what failed
                self.connection.execute("ROLLBACK")

    def _again(self) -> None:
        """Roll the transaction back (an error aborted it) and insert its chunks again, each
        as it was: the same text, offset and checks (they passed, and pass again)."""
        self.connection.execute("ROLLBACK")
        self.open = False
        offset = self.offset
        for file, labels, lines, start, mentioned in self.inserted:
            self.offset = start
            if self._insert(self.lines_query(file, labels), labels, lines) != lines:
                raise InputError(f"{file}: DuckDB read a chunk of lines otherwise the second time")
            if mentioned:
                self.insert_hashes(file)
            file.unlink()
        self.inserted.clear()
        self.offset = offset

    def lines_query(self, file: Path | str, labels: list[str], compression: str = "none") -> str:
        """The lines of ``file`` as a query: the wanted columns, those the checks read, ordinality."""
        wanted = {**self.columns, "prompt_tokens": "BIGINT", "cached_tokens": "BIGINT"}
        wanted.update(dict.fromkeys(labels, "VARCHAR"))
        typed = "{" + ", ".join(f"{name}: '{sql}'" for name, sql in wanted.items()) + "}"
        # an empty string is an absent value, as in a batch
        selected = ", ".join(
            f"NULLIF({name}, '') AS {name}" if _KINDS[name] is str else name for name in wanted
        )
        # the file's name, never a pattern (a walked directory's log[12].jsonl would be read as
        # the log1.jsonl beside it); ordinality: the line's place in the file (checked with 4
        # threads on 190 MB files; a chunk is smaller than one of read_json's 32 MiB buffers)
        return (
            f"SELECT {selected}, ordinality FROM read_json({sqltext.duckdb_path(str(file))}, "
            "format = 'newline_delimited', "
            f"records = true, compression = '{compression}', columns = {typed}) WITH ORDINALITY"
        )

    def insert_hashes(self, file: Path | str, compression: str = "none") -> None:
        """Insert into the hashes table the records of ``file`` (inserted from :attr:`offset` on,
        every line a record) that hold ``prefix_hashes``: a second parse of the text, for the
        files and chunks that may hold them only."""
        typed = "{" + ", ".join(f"{name}: '{sql}'" for name, sql in HASHES_COLUMNS.items()) + "}"
        # an empty string is an absent value, as in a batch
        selected = ", ".join(
            f"NULLIF({name}, '')" if sql == "VARCHAR" else name for name, sql in HASHES_COLUMNS.items()
        )
        self.connection.execute(
            f"INSERT INTO {self.hashes} SELECT {self.src}, {self.offset} + ordinality - 1, "
            f"{selected} FROM read_json({sqltext.duckdb_path(str(file))}, "
            f"format = 'newline_delimited', records = true, compression = '{compression}', "
            f"columns = {typed}) WITH ORDINALITY WHERE prefix_hashes IS NOT NULL"
        )

    def batch_hashes(self, batch: records.RecordBatch) -> None:
        """Insert into the hashes table the records of ``batch`` (inserted from :attr:`offset`
        on) that hold ``prefix_hashes``, as JSON text."""
        rows = [i for i, hashes in enumerate(batch.prefix_hashes) if hashes is not None]
        if self.hashes is None or not rows:
            return
        found = {
            "row": np.array(rows, dtype=np.int64) + self.offset,
            "block_size": np.array(
                [batch.block_size[i] if batch.block_size[i] >= 0 else None for i in rows], dtype=object
            ),
            "prefix_hashes": np.array(
                [msgspec.json.encode(batch.prefix_hashes[i]).decode() for i in rows], dtype=object
            ),
            **{
                name: np.array([getattr(batch, name)[i] or None for i in rows], dtype=object)
                for name in ("request_id", "replica", "tenant")
            },
        }
        self.connection.register("chunk_hashes", found)
        self.connection.execute(
            f"INSERT INTO {self.hashes} SELECT {self.src}, row, {', '.join(HASHES_COLUMNS)} FROM chunk_hashes"
        )
        self.connection.unregister("chunk_hashes")

    def _insert(self, lines_query: str, labels: list[str], lines: int) -> int | None:
        return self.settle(self.insert_checked(lines_query, labels), lines_query, labels, lines)

    def _insert_statement(self) -> str:
        return (
            f"INSERT INTO {self.table} SELECT {', '.join(self.columns)}, {self.src}, "
            f"{self.offset} + ordinality - 1 FROM "
        )

    def insert_checked(self, lines_query: str, labels: list[str]) -> int:
        """Insert the rows of ``lines_query`` that pass both checks (labels as printable
        ASCII only); their number."""
        ascii_labels = " AND ".join(f"({name} IS NULL OR NOT {beyond_short_ascii(name)})" for name in labels)
        # no error() for a failed check: an error aborts the transaction the insert is in
        ((count,),) = self.connection.execute(
            f"{self._insert_statement()} ({lines_query}) "
            f"WHERE cached_tokens <= prompt_tokens AND ({ascii_labels or 'true'})"
        ).fetchall()
        return int(count)

    def settle(self, count: int, lines_query: str, labels: list[str], lines: int) -> int | None:
        """``lines`` when the rows :meth:`insert_checked` inserted (``count``) are all of them,
        or when the rest fail only the ASCII check and :func:`kvlens.records.labels_valid`
        accepts their labels (all inserted then); else None, nothing inserted."""
        insert = self._insert_statement()
        if count != lines:  # cached_tokens above prompt_tokens, or a label past ASCII
            self._delete()
            if self._staged(lines_query, labels) is None:
                return None
            ((count,),) = self.connection.execute(f"{insert} {STAGED}").fetchall()
            if count != lines:  # never seen: DuckDB read other lines than the decoder
                self._delete()
                return None
        return int(count)

    def _delete(self) -> None:
        """Delete the rows the current chunk inserted."""
        self.connection.execute(f"DELETE FROM {self.table} WHERE src = {self.src} AND row >= {self.offset}")

    def _staged(self, lines_query: str, labels: list[str]) -> int | None:
        """The chunk's number of lines, parsed into :data:`STAGED`, when both checks pass."""
        self.connection.execute(f"CREATE OR REPLACE TEMP TABLE {STAGED} AS {lines_query}")
        ((count, cached_over),) = self.connection.execute(
            f"SELECT count(*), count(*) FILTER (WHERE cached_tokens > prompt_tokens) FROM {STAGED}"
        ).fetchall()
        if cached_over:
            return None
        if labels:
            found = self.connection.execute(labels_to_check(STAGED, labels))
            while batch := found.fetchmany(LABELS_AT_A_TIME):
                if not records.labels_valid(label for (label,) in batch):
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
