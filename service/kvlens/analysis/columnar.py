"""``kvlens analyze`` out of core: the reducer as SQL, run by DuckDB in-process (the ``scale``
extra).

The records never sit in Python: JSON lines go through the same reader and validator as the
numpy path, one block at a time, into a DuckDB table (spilled to disk past ``memory_limit``);
Parquet files are scanned where they lie, checked against the bounds
:class:`kvlens.records.Record` declares, and copied into memory once only when they fit in
half the limit (:func:`working_set`). The per-record decisions of :func:`kvlens.reduce.reduce`
are the view of :func:`reduced_sql`, derived as each scan reads; the engine computes a
:class:`kvlens.analysis.report.Summary` (exact integer sums per model, length group and hit;
exact order statistics; fixed-point TTFT sums) in a few scans (:func:`summarize`) and the
report is built from it by the same code as the numpy path's, so the two agree field by field
(tests/unit/test_columnar.py draws random record sets to hold them to it).

Exact order statistics in bounded memory: an engine's sort or its ``quantile`` aggregate either
holds a group's values in memory or sorts all of them; instead each wanted rank is found by
narrowing a value range with histograms (about :data:`BIN_VALUES` values a bin) until the
range holds one distinct value or few enough values to sort. The histograms are counted in
numpy over chunks of the records (:data:`CHUNK_ROWS`, ranges of row numbers that the scans
prune to), not by the engine's hash aggregate (several times dearer per value); a sample read
first predicts the bins holding the ranks, whose values the first pass keeps, so one read of
the records usually suffices (:func:`order_statistics`). Records that fit in one chunk are read
once and each part ranked by ``np.partition``.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from kvlens import definitions, records
from kvlens.analysis import jsonl_load, reader, report, sqltext
from kvlens.errors import InputError

DEFAULT_MEMORY_LIMIT = "2GiB"
BINS = 1 << 18  # histogram bins of a part a pass, at most (a part past 268M values gets fuller bins)
BIN_VALUES = 1024  # values a bin is sized for: a pass leaves ranges of about that many to fetch
FETCH_MAX = 16384  # values in range fetched to pick the rank directly
# Distinct labels outside printable ASCII that :func:`kvlens.records.valid_label` checks in
# Python, at most; past it every row is matched by :func:`_printable_pattern` instead.
MAX_LABELS_CHECKED = 100_000

# The columns the analysis reads, in the record's order. `src`/`row` keep the input order
# (file, line or row), which calibration's residual sample follows.
ANALYSIS_COLUMNS = (
    "model",
    "prompt_tokens",
    "cached_tokens",
    "queue_seconds",
    "prefill_seconds",
    "ttft_seconds",
    "arrival_time",  # only its range is read (the report's time range)
)
SCALAR_COLUMNS = tuple(spec.name for spec in records.FIELDS if spec.kind is not list)
_SQL_TYPE = {int: "BIGINT", float: "DOUBLE", str: "VARCHAR"}
_SPEC = {spec.name: spec for spec in records.FIELDS}


def _duckdb() -> Any:
    try:
        import duckdb
    except ModuleNotFoundError as error:
        raise InputError(f"this needs {reader.scale_extra()}") from error
    return duckdb


@dataclass
class Engine:
    """A DuckDB connection with a memory limit it honours by spilling to ``temp_directory``."""

    memory_limit: str = DEFAULT_MEMORY_LIMIT
    temp_directory: str | None = None  # default: a new directory, removed on close
    threads: int | None = None
    connection: Any = field(init=False)
    prefill_counts: dict[str, int] = field(init=False, default_factory=dict)  # set by summarize
    # first and last arrival time and how many records have one: set by summarize
    arrivals: tuple[float | None, float | None, int] = field(init=False, default=(None, None, 0))
    _spill: tempfile.TemporaryDirectory[str] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        duckdb = _duckdb()
        if self.temp_directory is None:
            try:
                self._spill = tempfile.TemporaryDirectory(prefix="kvlens-duckdb-")
            except OSError as error:  # CPython names no file when no candidate is writable
                raise InputError(
                    f"no temporary directory for DuckDB to spill to ({error.strerror or error}): "
                    "set TMPDIR to a writable directory"
                ) from error
        self.connection = duckdb.connect(":memory:")
        spill = self.temp_directory or self._spill.name  # type: ignore[union-attr]
        try:
            self.connection.execute(f"SET memory_limit = {sqltext.duckdb_text(self.memory_limit)}")
        except duckdb.Error as error:
            raise InputError(f"memory limit {self.memory_limit!r} is not a size DuckDB takes") from error
        self.connection.execute(f"SET temp_directory = {sqltext.duckdb_text(spill)}")
        self.connection.execute("SET preserve_insertion_order = false")
        self.connection.execute("SET enable_progress_bar = false")
        # every pass reads the Parquet footers again (the order statistics a chunk at a time)
        self.connection.execute("SET parquet_metadata_cache = true")
        if self.threads:
            self.connection.execute(f"SET threads = {int(self.threads)}")

    @property
    def spill_directory(self) -> str:
        """Where DuckDB writes what passes the memory limit."""
        return self.temp_directory or self._spill.name  # type: ignore[union-attr]

    def spilled(self) -> int:
        """Bytes DuckDB holds in temporary files now (past the memory limit)."""
        rows = self.connection.execute(
            "SELECT COALESCE(SUM(size), 0) FROM duckdb_temporary_files()"
        ).fetchall()
        return int(rows[0][0])

    def close(self) -> None:
        self.connection.close()
        if self._spill is not None:
            self._spill.cleanup()


@contextlib.contextmanager
def engine_errors(memory_limit: str, spill: str | os.PathLike[str] | None = None) -> Iterator[None]:
    """DuckDB's errors as :class:`InputError` (a clear message and exit 2, never a trace):
    running out of memory names the limit to raise, or the temporary directory ``spill`` when
    that is what ran out (DuckDB caps its temporary files at the free space of their disk);
    the rest (a corrupt file, an unreadable URL) carry DuckDB's own first line, which names
    the file."""
    duckdb = _duckdb()
    try:
        yield
    except duckdb.OutOfMemoryException as error:
        if "max_temp_directory_size" in str(error):
            raise InputError(
                f"DuckDB's temporary directory {spill or 'TMPDIR'} is full (it spills there past the "
                f"memory limit {memory_limit}): free space there, set TMPDIR to a larger disk, or "
                "raise --memory-limit"
            ) from error
        raise InputError(
            f"DuckDB needed more than the memory limit {memory_limit} (it spills what it can to "
            "disk, but some steps need a minimum): raise --memory-limit or analyze_memory_limit"
        ) from error
    except duckdb.Error as error:
        raise InputError(f"DuckDB: {str(error).splitlines()[0]}") from error


@dataclass
class Loaded:
    """The records view in the engine, and how the input read."""

    read: reader.ReadResult
    files: list[str]
    parquet: bool = False  # some input is Parquet
    in_memory: bool = True  # every record is in a DuckDB table (else Parquet is scanned where it lies)
    unchecked: Unchecked | None = None  # Parquet in place whose checks wait for the sums (``check_later``)

    @property
    def records(self) -> int:
        return self.read.lines - self.read.skipped_total - self.read.ignored


def load(
    engine: Engine,
    paths: Sequence[str],
    *,
    columns: Sequence[str] = ANALYSIS_COLUMNS,
    format_name: str | None = None,
    model: str | None = None,
    progress: Callable[[int], None] | None = None,
    check_later: bool = False,
) -> Loaded:
    """Create the view ``records`` (``columns`` plus ``src`` and ``row``) of the valid records
    of ``paths``, counting skipped lines and rows in the result as the numpy path does.

    ``check_later``: Parquet scanned in place gets no scan of its own to check it; the view
    checks each row as it reads until :func:`summarize`, given :attr:`Loaded.unchecked`,
    checks every row in its sums scan (one scan fewer). The rejected rows of
    :attr:`Loaded.read` are counted only then."""
    files = _objects(engine, reader.resolve(paths))
    result = reader.ReadResult(batch=records.batch_from_objects([]).batch)
    con = engine.connection
    typed = ", ".join(f"{name} {_SQL_TYPE[_SPEC[name].kind]}" for name in columns)
    con.execute(f"CREATE OR REPLACE TEMP TABLE jsonl_records ({typed}, src INTEGER, row BIGINT)")
    parquet = [(index, path) for index, path in enumerate(files) if reader.is_parquet(path)]
    scanned = {index for index, _ in parquet}
    for index, path in enumerate(files):
        if index not in scanned:
            jsonl_load.load_file(
                con,
                "jsonl_records",
                {name: _SQL_TYPE[_SPEC[name].kind] for name in columns},
                index,
                path,
                result,
                format_name=format_name,
                model=model,
                progress=progress,
            )
    jsonl = "SELECT * FROM jsonl_records"
    view, in_memory, unchecked = jsonl, True, None
    if parquet:
        rows = _parquet_rows(engine, [path for _, path in parquet])
        in_memory = _fits_in_memory(engine, rows, columns)
        checks = _parquet_checks(engine, parquet, columns)
        result.lines += rows
        for _, path in parquet:
            result.formats[path] = "parquet"
        if in_memory or not check_later:
            view += f" UNION ALL {_parquet_view(engine, checks, result, in_memory)}"
        else:
            unchecked = Unchecked(checks, jsonl, result)
            view += (
                f" UNION ALL SELECT {checks.names}, src, row FROM ({checks.checked}) WHERE rejection IS NULL"
            )
    con.execute(f"CREATE OR REPLACE TEMP VIEW records AS {view}")
    return Loaded(read=result, files=files, parquet=bool(parquet), in_memory=in_memory, unchecked=unchecked)


def _objects(engine: Engine, files: list[str]) -> list[str]:
    """``files`` with each URL replaced by the objects DuckDB lists for it (a glob's, in name
    order), named as DuckDB names them: the schema check and each row's file are keyed by the
    names it reports (``file://`` gives local paths, ``s3://`` its keys), never by the pattern."""
    out: list[str] = []
    for path in files:
        if "://" not in path:
            out.append(path)
            continue
        found = engine.connection.execute("SELECT file FROM glob(?) ORDER BY file", [path]).fetchall()
        if not found:
            raise InputError(f"{path}: the URL names no Parquet object")
        out.extend(str(name) for (name,) in found)
    return out


def _parquet_rows(engine: Engine, paths: list[str]) -> int:
    """Rows of the Parquet files, from their footers."""
    listed = ", ".join(sqltext.duckdb_path(path) for path in paths)
    ((rows,),) = engine.connection.execute(
        f"SELECT COALESCE(SUM(num_rows), 0) FROM parquet_file_metadata([{listed}])"
    ).fetchall()
    return int(rows)


def _fits_in_memory(engine: Engine, rows: int, columns: Sequence[str]) -> bool:
    """Whether ``rows`` Parquet rows fit in :data:`MATERIALIZE_SHARE` of the memory limit, at
    :data:`COLUMN_BYTES` a column."""
    ((limit,),) = engine.connection.execute("SELECT current_setting('memory_limit')").fetchall()
    return rows * COLUMN_BYTES * (len(columns) + 3) <= MATERIALIZE_SHARE * _bytes(str(limit))


@dataclass(frozen=True)
class _ParquetChecks:
    """The Parquet files as SQL: ``scan``, every row with its ``src`` and ``row``; ``checked``,
    the wanted columns (``selected``: NULL where no file has one) with each row's
    ``rejection`` (:func:`rejection_sql`; NULL: valid)."""

    columns: tuple[str, ...]
    scan: str
    selected: str
    checked: str
    path_of: dict[int, str]

    @property
    def names(self) -> str:
        return ", ".join(self.columns)


def _parquet_checks(engine: Engine, parquet: list[tuple[int, str]], columns: Sequence[str]) -> _ParquetChecks:
    present = _check_parquet_schema(engine, [path for _, path in parquet], columns)
    listed = ", ".join(sqltext.duckdb_path(path) for _, path in parquet)
    src = " ".join(
        f"WHEN {sqltext.duckdb_text(sqltext.scanned_name(path))} THEN {index}" for index, path in parquet
    )
    scan = (
        f"SELECT *, CASE filename {src} END AS src, file_row_number AS row FROM read_parquet([{listed}], "
        "union_by_name = true, filename = true, file_row_number = true, hive_partitioning = false)"
    )
    # DuckDB binds a name without case: `model` reads a file's Model (checked as model). An
    # empty string is an absent value, as in a line (a warehouse's export may hold '')
    selected = ", ".join(
        (f"NULLIF({name}, '') AS {name}" if _SPEC[name].kind is str else name)
        if name in present
        else f"CAST(NULL AS {_SQL_TYPE[_SPEC[name].kind]}) AS {name}"
        for name in columns
    )
    invalid = _invalid_labels(
        engine, scan, [name for name in columns if name in present and _SPEC[name].is_label]
    )
    checked = f"SELECT {selected}, src, row, {rejection_sql(present, invalid)} AS rejection FROM ({scan})"
    return _ParquetChecks(tuple(columns), scan, selected, checked, dict(parquet))


def _invalid_labels(engine: Engine, scan: str, labels: Sequence[str]) -> bool | None:
    """Whether some of the ``labels`` columns of ``scan`` hold an invalid label (each then in
    the table ``invalid_labels``), or None when there are more than :data:`MAX_LABELS_CHECKED`
    distinct labels outside printable ASCII or too long. Short printable ASCII is valid; the few
    distinct others are checked by :func:`kvlens.records.valid_label`, the JSON lines' check, so
    that the scans after it check no label row by row: matching every row with a pattern of
    Python's printable characters cost three times the bare scan, building the pattern 0.15 s
    a run, and a length check every row ~1.4 CPU s at 100M rows."""
    if not labels:
        return False
    distinct = jsonl_load.labels_to_check(f"({scan})", list(labels))
    found = [
        label
        for (label,) in engine.connection.execute(f"{distinct} LIMIT {MAX_LABELS_CHECKED + 1}").fetchall()
    ]
    if len(found) > MAX_LABELS_CHECKED:
        return None
    invalid = [label for label in found if not records.valid_label(label)]
    if not invalid:
        return False
    # each load adds its own: a label's validity is the string's, whichever load found it
    engine.connection.execute("CREATE TEMP TABLE IF NOT EXISTS invalid_labels (label VARCHAR PRIMARY KEY)")
    engine.connection.execute(
        "INSERT OR IGNORE INTO invalid_labels SELECT DISTINCT unnest($labels::VARCHAR[])", {"labels": invalid}
    )
    return True


def _parquet_view(engine: Engine, checks: _ParquetChecks, result: reader.ReadResult, in_memory: bool) -> str:
    """The valid rows of the Parquet files as SQL; rejected rows are counted by reason in
    ``result`` (with the first few named by file and row), as the validator does for lines.
    ``in_memory``: the rows are checked and copied into a table in one scan, and every later
    scan reads that table (not Parquet pages to decode and check again). Else one scan checks
    the files and keeps the rejected rows' numbers, and every later scan reads the files where
    they lie (:func:`_left_out`). A copy past the memory limit would spill to disk and every
    scan would read it back."""
    if not in_memory:
        return _left_out(engine, checks, result)
    engine.connection.execute(f"CREATE OR REPLACE TEMP TABLE parquet_records AS {checks.checked}")
    _count_rejected(
        engine, checks, result, "SELECT rejection, src, row FROM parquet_records WHERE rejection IS NOT NULL"
    )
    return f"SELECT {checks.names}, src, row FROM parquet_records WHERE rejection IS NULL"


def _left_out(
    engine: Engine, checks: _ParquetChecks, result: reader.ReadResult, rejected: bool = True
) -> str:
    """The valid rows of Parquet scanned in place as SQL: a scan of the files keeps the rejected
    rows' numbers in a table (DuckDB spills it if need be) and counts them in ``result``; every
    later scan reads only the columns it needs and leaves those rows out by an anti-join (none
    when every row passed): not the checks again, which read every column (the model's name
    too) and cost about a third of a scan. ``rejected`` False (a scan has counted none): no
    table, no scan."""
    valid = f"SELECT {checks.selected}, src, row FROM ({checks.scan})"
    if rejected:
        engine.connection.execute(
            "CREATE OR REPLACE TEMP TABLE parquet_rejected AS "
            f"SELECT rejection, src, row FROM ({checks.checked}) WHERE rejection IS NOT NULL"
        )
        if _count_rejected(engine, checks, result, "SELECT * FROM parquet_rejected"):
            valid = (
                f"SELECT * FROM ({valid}) AS scanned ANTI JOIN parquet_rejected AS out "
                "ON scanned.src = out.src AND scanned.row = out.row"
            )
    return f"SELECT {checks.names}, src, row FROM ({valid})"


def _count_rejected(
    engine: Engine, checks: _ParquetChecks, result: reader.ReadResult, rejections: str
) -> int:
    """Counts the rows of ``rejections`` (``rejection, src, row``) by reason in ``result`` and
    names the first few; returns how many."""
    con = engine.connection
    rejected = 0
    for reason_field, count in con.execute(
        f"SELECT rejection, count(*) FROM ({rejections}) GROUP BY ALL"
    ).fetchall():
        result.skipped[reason_field.split(":")[1]] += int(count)
        rejected += int(count)
    room = reader.MAX_EXAMPLES - len(result.examples)
    if room > 0 and rejected:
        for rejection, src_index, row in con.execute(
            f"SELECT rejection, src, row FROM ({rejections}) ORDER BY src, row LIMIT {room}"
        ).fetchall():
            field_name, reason = rejection.split(":")
            result.examples.append(
                {
                    "file": checks.path_of[int(src_index)],
                    "row": int(row),
                    "field": field_name or None,
                    "reason": reason,
                    "message": records.reason_message(field_name or None, reason),
                }
            )
    return rejected


@dataclass(frozen=True)
class Unchecked:
    """Parquet scanned in place that :func:`load` left unchecked (``check_later``): the sums
    scan of :func:`summarize` reads :meth:`source` and checks every row as it sums, then
    :meth:`settle` counts the rejected rows and makes the records view stop checking."""

    checks: _ParquetChecks
    jsonl: str  # the JSON-lines records (checked as they were read)
    result: reader.ReadResult

    def source(self) -> str:
        """Every record with its ``rejection``; a rejected row's values are NULL, so that the
        sums' expressions cannot overflow on them (the square of 2^62 tokens, 1e300 seconds in
        fixed point) and their names make no groups: they are counted by rejection alone."""
        nulled = ", ".join(
            f"CASE WHEN rejection IS NULL THEN {name} END AS {name}" for name in self.checks.columns
        )
        return (
            f"SELECT *, CAST(NULL AS VARCHAR) AS rejection FROM ({self.jsonl}) AS lines UNION ALL "
            f"SELECT {nulled}, src, row, rejection FROM ({self.checks.checked}) AS rows_checked"
        )

    def settle(self, engine: Engine, rejected: bool) -> None:
        """After the sums scan (which found ``rejected`` rows or none)."""
        view = _left_out(engine, self.checks, self.result, rejected)
        engine.connection.execute(f"CREATE OR REPLACE TEMP VIEW records AS {self.jsonl} UNION ALL {view}")


def _check_parquet_schema(engine: Engine, paths: list[str], columns: Sequence[str]) -> set[str]:
    """The wanted columns some file has; an error naming the file and column when a file lacks
    a required column, stores one in a type that is not the record's (a DECIMAL or TIMESTAMP is
    an integer underneath, a BLOB a byte array: DuckDB would read 1.50 tokens as 1), nests it,
    or has two columns that DuckDB would both read as it (it binds names without case).

    Only top-level columns count: a struct's child named ``prompt_tokens`` is not the record's.
    ``parquet_schema`` lists each file's schema tree depth first, each group with its number
    of children, from which the top level is read."""
    listed = ", ".join(sqltext.duckdb_path(path) for path in paths)
    rows = engine.connection.execute(
        "SELECT file_name, name, type, repetition_type, num_children, converted_type, logical_type "
        f"FROM parquet_schema([{listed}])"
    ).fetchall()
    trees: dict[str, list[tuple[Any, ...]]] = {}
    for row in rows:
        trees.setdefault(row[0], []).append(row[1:])
    present: set[str] = set()
    for path in paths:
        top = _top_level(trees.get(sqltext.scanned_name(path), []))
        for name in columns:
            spec = _SPEC[name]
            named = [column for column in top if column[0].lower() == name]
            if len(named) > 1:
                raise InputError(
                    f"{path}: columns {named[0][0]!r} and {named[1][0]!r} both name the record's {name} "
                    "(names are read without case)"
                )
            if not named:
                if spec.required:
                    raise InputError(f"{path}: the Parquet file has no column {name!r} (required)")
                continue
            column, physical, repetition, children, converted, logical = named[0]
            if children or repetition == "REPEATED" or not _fits(spec.kind, physical, converted, logical):
                raise InputError(
                    f"{path}: column {column!r} is {_described(physical, repetition, children, converted)} "
                    f"in the Parquet file; a record's {name} is {_WANTED[spec.kind]}"
                )
            present.add(name)
    return present


def _top_level(tree: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """The root's children of a depth-first schema tree (rows of name, type, repetition,
    number of children, converted type, logical type; the root first)."""
    if not tree:
        return []
    top = []
    left = [int(tree[0][3] or 0)]  # children still to come at each open level, the root's first
    for node in tree[1:]:
        if len(left) == 1:
            top.append(node)
        left[-1] -= 1
        if node[3]:
            left.append(int(node[3]))
        while len(left) > 1 and left[-1] == 0:
            left.pop()
    return top


_INTEGER_ANNOTATIONS = {None, *(f"{sign}INT_{bits}" for sign in ("", "U") for bits in (8, 16, 32, 64))}
_TEXT_ANNOTATIONS = {"UTF8", "ENUM", "JSON"}
_WANTED = {
    int: "an integer (INT32 or INT64)",
    float: "a number (FLOAT or DOUBLE)",
    str: "text (UTF-8 BYTE_ARRAY)",
}


def _fits(kind: type, physical: str | None, converted: str | None, logical: str | None) -> bool:
    """Whether DuckDB reads a Parquet leaf of these types as a value of the record's ``kind`` (a
    duration stored as an integer is refused: its unit is unknown)."""
    if kind is int:
        return (
            physical in ("INT32", "INT64")
            and converted in _INTEGER_ANNOTATIONS
            and (logical is None or logical.startswith("IntType"))
        )
    if kind is float:
        return physical in ("FLOAT", "DOUBLE") and converted is None and logical is None
    return physical == "BYTE_ARRAY" and (
        converted in _TEXT_ANNOTATIONS or (logical or "").startswith(("StringType", "EnumType", "JsonType"))
    )


def _described(
    physical: str | None, repetition: str | None, children: int | None, converted: str | None
) -> str:
    if children:
        return f"a nested column ({converted or 'STRUCT'})"
    annotated = physical if converted in _INTEGER_ANNOTATIONS else f"{physical} ({converted})"
    return f"a repeated {annotated}" if repetition == "REPEATED" else str(annotated)


def rejection_sql(columns: set[str] | Sequence[str], invalid_labels: bool | None = None) -> str:
    """``'field:reason'`` of the first rule a row breaks (in the record's field order), else
    NULL: the bounds are read off :data:`kvlens.records.FIELDS`, the schema's own.
    ``invalid_labels`` (:func:`_invalid_labels`): False, every label is valid; True, the
    invalid ones are in the table ``invalid_labels``; None, unknown: each row's length is
    checked and the row matched by :func:`_printable_pattern`."""
    rules: list[tuple[str, str, str]] = []
    for spec in records.FIELDS:
        if spec.name not in columns:
            if spec.required:
                rules.append(("TRUE", spec.name, "missing"))
            continue
        name = spec.name
        if spec.required:
            rules.append((f"{name} IS NULL", name, "missing"))
        if spec.kind is float:
            rules.append((f"(isnan({name}) OR isinf({name}))", name, "not_finite"))
        if spec.kind in (int, float) and spec.low is not None:
            rules.append((f"{name} < {sqltext.number(spec.low)}", name, "out_of_range"))
        if spec.kind in (int, float) and spec.high is not None:
            rules.append((f"{name} > {sqltext.number(spec.high)}", name, "out_of_range"))
        if spec.kind is str and spec.is_label:
            if invalid_labels is None:
                rules.append(
                    (
                        f"(octet_length(encode({name})) > {records.MAX_LABEL_BYTES} "
                        f"OR NOT regexp_full_match({name}, '{_printable_pattern()}'))",
                        name,
                        "invalid_label",
                    )
                )
            elif invalid_labels:
                rules.append((f"{name} IN (SELECT label FROM invalid_labels)", name, "invalid_label"))
        elif spec.kind is str and spec.max_length is not None:
            rules.append((f"length({name}) > {spec.max_length}", name, "too_long"))
        if name == "cached_tokens":
            rules.append(("cached_tokens > prompt_tokens", name, "cached_exceeds_prompt"))
    cases = " ".join(f"WHEN {condition} THEN '{name}:{reason}'" for condition, name, reason in rules)
    return f"CASE {cases} END"


@functools.cache
def _printable_pattern() -> str:
    """A regular expression (RE2, DuckDB's) of the strings :func:`kvlens.records.valid_label`
    calls printable, built from Python's own ``str.isprintable`` code point by code point:
    RE2's Unicode classes are of another Unicode version (they know thousands of characters
    Python 3.11 does not, which a JSON line would then have refused and Parquet kept)."""
    ranges, start = [], None
    for point in range(sys.maxunicode + 1):
        printable = chr(point).isprintable() and not 0xD800 <= point <= 0xDFFF
        if not printable and start is None:
            start = point
        elif printable and start is not None:
            ranges.append((start, point - 1))
            start = None
    if start is not None:
        ranges.append((start, sys.maxunicode))
    excluded = "".join(f"\\x{{{low:x}}}-\\x{{{high:x}}}" for low, high in ranges)
    return f"[^{excluded}]*"


# ---------------------------------------------------------------------------------------------
# The reducer as SQL


def reduced_sql(
    source: str,
    edges: Sequence[int],
    default_model: str,
    keep: Sequence[str] = (),
    text: Callable[[str], str] = sqltext.duckdb_text,
) -> str:
    """The per-record decisions of :func:`kvlens.reduce.reduce` over ``source``: the model by
    raw name (``default_model`` when none), hit (``h > 0``), the prompt-length group (the edges
    at or below ``n``: numpy's ``searchsorted(..., side="right")``), the squares that ``C(n)``
    and ``C(h)`` sum from, and the TTFT split with its completeness. ``text`` writes the
    default model's literal (:mod:`kvlens.analysis.sqltext`: DuckDB's, or the printed
    script's)."""
    group = (
        " + ".join(
            f"CASE WHEN prompt_tokens >= {sqltext.number(int(edge))} THEN 1 ELSE 0 END" for edge in edges
        )
        or "0"
    )
    other = "ttft_seconds - queue_seconds - prefill_seconds"
    complete = "(queue_seconds IS NOT NULL AND prefill_seconds IS NOT NULL AND ttft_seconds IS NOT NULL)"
    return f"""SELECT
  COALESCE(model, {text(default_model)}) AS model,
  prompt_tokens,
  cached_tokens,
  cached_tokens > 0 AS hit,
  {group} AS length_group,
  prompt_tokens * prompt_tokens AS prompt_squares,
  cached_tokens * cached_tokens AS cached_squares,
  ttft_seconds,
  queue_seconds,
  prefill_seconds,
  prefill_seconds / CAST(GREATEST(prompt_tokens - cached_tokens, 1) AS DOUBLE) AS prefill_per_computed_token,
  {complete} AS ttft_complete,
  CASE WHEN {complete} THEN {other} < 0 ELSE FALSE END AS ttft_overlapped,
  CASE WHEN {complete} THEN GREATEST({other}, 0.0) END AS ttft_other{"".join(f", {name}" for name in keep)}
FROM {source}"""


FIXED = float(definitions.FIXED_POINT_SECONDS)


def _exact(column: str) -> str:
    """An exact integer sum: DECIMAL(38,0) does not overflow where a BIGINT sum of squares
    would (a billion 10M-token prompts), in any engine."""
    return f"SUM(CAST({column} AS DECIMAL(38,0)))"


def _fixed(column: str) -> str:
    """A sum of durations in fixed point (:data:`FIXED`), exact in any engine."""
    return f"SUM(CAST(CAST(FLOOR({column} * {sqltext.number(FIXED)}) AS BIGINT) AS DECIMAL(38,0)))"


def cells_sql(reduced: str) -> str:
    """Exact sums per (model, length group, hit)."""
    return f"""SELECT model, length_group, hit,
  COUNT(*) AS requests,
  {_exact("prompt_tokens")} AS prompt_tokens,
  {_exact("cached_tokens")} AS cached_tokens,
  {_exact("prompt_squares")} AS prompt_squares,
  {_exact("cached_squares")} AS cached_squares
FROM ({reduced}) AS reduced_rows GROUP BY model, length_group, hit"""


def decomposition_sql(reduced: str) -> str:
    return f"""SELECT COUNT(*) AS requests,
  SUM(CASE WHEN ttft_overlapped THEN 1 ELSE 0 END) AS overlapped,
  {_fixed("queue_seconds")} AS queue, {_fixed("prefill_seconds")} AS prefill, {_fixed("ttft_other")} AS other
FROM ({reduced}) AS reduced_rows WHERE ttft_complete"""


def cost_models_sql(
    names: Sequence[str], cost_for: Callable[[str], definitions.CostModel], text: Callable[[str], str]
) -> str:
    """The cost models of ``names`` as a VALUES list, text written by ``text``
    (:mod:`kvlens.analysis.sqltext`)."""
    rows = []
    for name in names:
        cost = cost_for(name)
        rows.append(f"({text(name)}, {sqltext.number(cost.a)}, {sqltext.number(cost.b)}, {text(cost.unit)})")
    return "(VALUES " + ", ".join(rows) + ") AS cost_models(model, a, b, unit)"


# ---------------------------------------------------------------------------------------------
# Exact order statistics in bounded memory

Part = tuple[str, int, bool]  # (series, length group or -1 for all records, hit)


SERIES = (*report.LATENCY_COLUMNS, "prefill_per_computed_token", "all_ttft")
_PART_STRIDE = 1 << 20  # parts are keyed by one integer: series * stride + (group + 1) * 2 + hit


def _part_key(part: Part) -> int:
    return SERIES.index(part[0]) * _PART_STRIDE + (part[1] + 1) * 2 + int(part[2])


def _part_of(key: int) -> Part:
    series, rest = divmod(key, _PART_STRIDE)
    group, hit = divmod(rest, 2)
    return SERIES[series], group - 1, bool(hit)


CHUNK_ROWS = 1 << 20  # records read into numpy at once by the order statistics: ~50 MB of arrays


@dataclass(frozen=True)
class Series:
    """Values to rank, read a chunk at a time: ``sql(where)`` selects, of the rows matching
    ``where`` (one of ``chunks``, which together cover every row once), an integer column ``g``
    and value columns ``v0, v1, ...``. Value ``i`` of a row belongs to the part keyed
    ``keys[i] + g`` when ``grouped[i]``, else ``keys[i]`` (:func:`_part_key`). NULLs are not
    ranked."""

    sql: Callable[[str], str]
    keys: tuple[int, ...]
    grouped: tuple[bool, ...]
    chunks: tuple[str, ...] = ("TRUE",)
    columns: tuple[int, ...] | None = None  # the value column each key reads (default: v0, v1, ...)
    sample: str | None = None  # rows read first to predict where the ranks lie (:func:`_predict`)


def _series(chunks: tuple[str, ...], sample: str | None = None) -> Series:
    """Each latency value of the ``reduced`` view once per series it is ranked in (per group;
    TTFT also over all records): one read of a record serves every series."""
    group = "(length_group + 1) * 2 + CAST(hit AS INTEGER)"
    selected = ", ".join(f"{name} AS v{index}" for index, name in enumerate(SERIES[:-1]))
    return Series(
        sql=lambda where: f"SELECT {group} AS g, {selected} FROM reduced WHERE {where}",
        keys=(
            *(index * _PART_STRIDE for index in range(len(SERIES) - 1)),
            _part_key(("all_ttft", -1, False)),
        ),
        grouped=(*(True for _ in SERIES[:-1]), False),
        chunks=chunks,
        columns=(*range(len(SERIES) - 1), SERIES.index("ttft_seconds")),  # all records' TTFT: read once
        sample=sample,
    )


def row_chunks(records: int, last_row: int) -> tuple[str, ...]:
    """Predicates on ``row`` (a record's line or row in its file) that split ``records`` into
    reads of about :data:`CHUNK_ROWS`: ranges of row numbers (of every file at once), which
    DuckDB prunes to the Parquet row groups and table row groups that hold them."""
    count = -(-records // CHUNK_ROWS)
    if count <= 1:
        return ("TRUE",)
    width = -(-(last_row + 1) // count)
    return tuple(f"row >= {start} AND row < {start + width}" for start in range(0, last_row + 1, width))


SAMPLE_BLOCKS = 16  # the sample is this many blocks of rows spread over the row numbers


def sample_rows(records: int, last_row: int) -> str | None:
    """A predicate on ``row`` picking about :data:`CHUNK_ROWS` records in
    :data:`SAMPLE_BLOCKS` blocks spread over the row numbers (pruned to their row groups like a
    chunk), or None when the records are one chunk (read once anyway)."""
    if records <= CHUNK_ROWS:
        return None
    block = max(1, CHUNK_ROWS * (last_row + 1) // records // SAMPLE_BLOCKS)
    step = (last_row + 1) // SAMPLE_BLOCKS
    return " OR ".join(
        f"(row >= {index * step} AND row < {index * step + block})" for index in range(SAMPLE_BLOCKS)
    )


@dataclass
class _Target:
    part: Part
    rank: int
    low: float  # the values of the target's window lie in [low, high] (infinite: not known yet)
    high: float
    offset: int  # rank within the window
    count: int  # values within the window
    first_bin: int = -1  # the bin of the first pass that holds it (-1: before the first pass)
    value: float | None = None


def _root(values: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """``values ** (1/16)`` by four square roots: nearly a logarithm over the few decades
    latencies span, and monotone (IEEE square roots are correctly rounded), defined at 0."""
    return np.sqrt(np.sqrt(np.sqrt(np.sqrt(values))))


ROOT_BELOW = 0.25  # a part whose mean lies in the lowest quarter of [min, max] is binned on the root scale


@dataclass(frozen=True)
class _Scale:
    """How the first pass bins a part: ``[lo, hi]`` in the scale's units, ``nb`` bins."""

    lo: float
    hi: float
    nb: int
    root: bool


def _scales(bounds: dict[Part, tuple[int, float, float]], means: dict[Part, float]) -> dict[Part, _Scale]:
    """Each part's first-pass scale: the root scale when its mean is low in its range (a long
    tail: linear bins would hold nearly all values in the first few; the mean only chooses the
    bins, never a value), its values are not negative and the root separates min and max."""
    out = {}
    for part, (count, low, high) in bounds.items():
        nb = _bins_for(count)
        mean = means.get(part)
        if mean is not None and high > low >= 0 and (mean - low) / (high - low) < ROOT_BELOW:
            root_low, root_high = (float(_root(np.float64(x))) for x in (low, high))
            if root_high > root_low:
                out[part] = _Scale(root_low, root_high, nb, True)
                continue
        out[part] = _Scale(low, high, nb, False)
    return out


def _bins_for(count: int) -> int:
    """Bins for ``count`` values: about :data:`BIN_VALUES` a bin (an even spread is left to
    fetch after one pass)."""
    return max(2, min(BINS, -(-count // BIN_VALUES)))


class _Layout:
    """The first pass's bins of every part laid end to end: a value's bin is one index into
    one array of counts. Its position ``(x - lo) / (hi - lo) * nb`` (``x`` the value or its
    :func:`_root`) is monotone in the value, and so is the bin (its floor, clipped), so each bin
    holds a run of the part's sorted values; every pass computes it by the same numpy code."""

    def __init__(self, parts: list[Part], scales: dict[Part, _Scale]) -> None:
        self.parts = parts
        self.index = {_part_key(part): i for i, part in enumerate(parts)}
        self.lo = np.array([scales[p].lo for p in parts], dtype=np.float64)
        self.span = np.array(
            [scales[p].hi - scales[p].lo for p in parts], dtype=np.float64
        )  # > 0, maybe subnormal
        self.nb = np.array([scales[p].nb for p in parts], dtype=np.int64)
        self.root = np.array([scales[p].root for p in parts], dtype=np.bool_)
        self.offset = np.concatenate(([0], np.cumsum(self.nb)))
        self.total = int(self.offset[-1])

    def place(
        self, values: npt.NDArray[np.float64], part: int
    ) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]:
        """The positions of one part's values and the layout indexes of their bins."""
        x = _root(values) if self.root[part] else values
        position = (x - self.lo[part]) / self.span[part] * self.nb[part]
        floor = np.floor(position)
        np.clip(floor, 0, self.nb[part] - 1, out=floor)
        bins = floor.astype(np.int64)
        bins += self.offset[part]
        return position, bins


def _split(
    got: dict[str, Any], series: Series, index: dict[int, int]
) -> Iterator[tuple[int, npt.NDArray[np.float64], npt.NDArray[np.int32]]]:
    """The values of one read of ``series`` (``got``) of each part in ``index`` (part key:
    position), with the ``g`` of each value's row. The rows are sorted by ``g`` once, so each
    part is a slice of every column."""
    columns = series.columns or tuple(range(len(series.keys)))
    g = np.asarray(got["g"], dtype=np.int64)
    small = g.size and g.min() >= -(1 << 15) and g.max() < 1 << 15
    order = np.argsort(g.astype(np.int16) if small else g, kind="stable")  # int16: a radix sort
    g = g[order]
    starts = np.concatenate(([0], np.flatnonzero(np.diff(g)) + 1, [g.size]))
    rows_g = g.astype(np.int32)  # each value's g, carried along: 4 bytes a value
    slices = [
        (int(g[start]), int(start), int(end)) for start, end in itertools.pairwise(starts) if end > start
    ]
    for column_index in sorted(set(columns)):
        column = got[f"v{column_index}"]
        values = np.asarray(column, dtype=np.float64)[order]
        mask = getattr(column, "mask", None)  # a masked array where the column has NULLs
        present = None if mask is None or not np.any(mask) else ~np.asarray(mask)[order]
        for key, grouped in (
            (k, gr)
            for c, k, gr in zip(columns, series.keys, series.grouped, strict=True)
            if c == column_index
        ):
            for value_of_g, start, end in slices if grouped else [(0, 0, g.size)]:
                part = index.get(key + value_of_g if grouped else key)
                if part is None:
                    continue
                chosen, of_g = values[start:end], rows_g[start:end]
                if present is not None:
                    chosen, of_g = chosen[present[start:end]], of_g[present[start:end]]
                if chosen.size:
                    yield part, chosen, of_g


def _read(engine: Engine, series: Series, layout: _Layout, wheres: Sequence[str] = ()) -> Iterator[Placed]:
    """Per chunk (``wheres``, default: every chunk): the values of parts that have a target,
    their positions and the layout indexes of their bins, each part placed with its own
    constants (not a lookup of them for every value)."""
    for where in wheres or series.chunks:
        got = engine.connection.execute(series.sql(where)).fetchnumpy()
        pieces = [
            (chosen, *layout.place(chosen, part), of_g)
            for part, chosen, of_g in _split(got, series, layout.index)
        ]
        if not pieces:
            continue
        placed = (
            np.concatenate([piece[0] for piece in pieces]),
            np.concatenate([piece[1] for piece in pieces]),
            np.concatenate([piece[2] for piece in pieces]),
            np.concatenate([piece[3] for piece in pieces]),
        )
        del pieces, got  # the caller holds this chunk while the next is fetched: not its pieces too
        yield placed


def _ranked_whole(
    engine: Engine, series: Series, parts: list[Part], targets: list[_Target], tail: Tail | None
) -> None:
    """``series`` in one chunk: every value is in memory at once, so each part's ranks are
    picked by ``np.partition`` in one read (the value at a rank is the same by any method), with
    no bins and no second pass. ``tail``: its part's values and their ``g`` are kept for
    :meth:`Tail.at_least`."""
    index = {_part_key(part): position for position, part in enumerate(parts)}
    got = engine.connection.execute(series.sql(series.chunks[0])).fetchnumpy()
    values: dict[int, list[npt.NDArray[np.float64]]] = {}
    groups: dict[int, list[npt.NDArray[np.int32]]] = {}
    for at, chosen, of_g in _split(got, series, index):
        values.setdefault(at, []).append(chosen)
        groups.setdefault(at, []).append(of_g)
    whole = {at: np.concatenate(pieces) for at, pieces in values.items()}
    for position, part in enumerate(parts):
        own = [target for target in targets if target.part == part]
        ordered = np.partition(whole[position], sorted({target.rank for target in own}))
        for target in own:
            target.value = float(ordered[target.rank])
    if tail is not None and (kept := index.get(_part_key(tail.part))) is not None:
        tail.whole = (whole[kept], np.concatenate(groups[kept]))


Placed = tuple[
    npt.NDArray[np.float64], npt.NDArray[np.float64], npt.NDArray[np.int64], npt.NDArray[np.int32]
]  # values, positions, bins, and the g of each value's row


def order_statistics(
    engine: Engine,
    series: Series,
    wanted: dict[Part, list[int]],
    bounds: dict[Part, tuple[int, float, float]],
    means: dict[Part, float] | None = None,
    tail: Tail | None = None,
) -> dict[tuple[Part, int], float]:
    """The values at ``wanted`` ranks (0-based, ascending) of each part of ``series``;
    ``bounds`` gives each part's count, min and max; ``means`` (optional) each part's mean,
    which picks the first pass's bin scale (:func:`_scales`).

    The values are read into numpy a chunk at a time (an engine's hash aggregate over every
    value cost several times more). The first pass counts every part's values in bins (about
    :data:`BIN_VALUES` each) and keeps, for each target, the bin holding its rank. Each later
    pass reads the values again and keeps only those in the targets' windows: a window of at
    most :data:`FETCH_MAX` values is kept whole and sorted; a larger one (ties, a crowded bin)
    is counted in finer bins and shrinks to the one holding the rank, with its min and max.
    ``tail``: the first pass also counts that part's values by bin and ``g`` (:class:`Tail`).
    Records that are one chunk are read once and ranked whole (:func:`_ranked_whole`)."""
    targets = [
        _Target(part, rank, bounds[part][1], bounds[part][2], rank, bounds[part][0])
        for part, ranks in wanted.items()
        for rank in ranks
    ]
    for target in targets:
        if target.low == target.high:
            target.value = target.low
    open_targets = [t for t in targets if t.value is None]
    if open_targets and len(series.chunks) == 1:
        _ranked_whole(
            engine, series, sorted({t.part for t in open_targets}, key=_part_key), open_targets, tail
        )
    elif open_targets:
        parts = sorted({t.part for t in open_targets}, key=_part_key)
        layout = _Layout(parts, _scales({part: bounds[part] for part in parts}, means or {}))

        def reads() -> Iterator[Placed]:
            return _read(engine, series, layout)

        predicted = None
        if series.sample is not None:
            sampled = np.zeros(layout.total, dtype=np.int64)
            for _, _, bins, _ in _read(engine, series, layout, [series.sample]):
                sampled += np.bincount(bins, minlength=layout.total)
            predicted = _predict(layout, open_targets, sampled, bounds)
        by_row = None if tail is None else layout.index.get(_part_key(tail.part))
        stored = _first_pass(layout, open_targets, reads(), predicted, tail if by_row is not None else None)
        if stored is not None and all(predicted[t.first_bin] for t in open_targets):  # type: ignore[index]
            reads = lambda: iter(stored)  # noqa: E731  (every window's values are in memory)
        while open_targets := [t for t in targets if t.value is None]:
            _next_pass(layout, open_targets, reads())
    return {(t.part, t.rank): float(t.value) for t in targets if t.value is not None}


@dataclass
class Tail:
    """One part's values counted by ``g`` (the row's group key) and first-pass bin, with the
    values the first pass kept: how many of each ``g`` lie at or above a value found later
    (:meth:`at_least`) without another read of the records."""

    part: Part
    layout: _Layout | None = None
    predicted: npt.NDArray[np.bool_] | None = None
    stored: list[Placed] | None = None
    counts: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    bins: int = 0
    whole: tuple[npt.NDArray[np.float64], npt.NDArray[np.int32]] | None = (
        None  # every value and g (one chunk)
    )

    def count(self, groups: npt.NDArray[np.int32], bins: npt.NDArray[np.int64], nb: int) -> None:
        self.bins = nb
        got = np.bincount(groups * nb + bins, minlength=(int(groups.max(initial=0)) + 1) * nb)
        if got.size > self.counts.size:
            got[: self.counts.size] += self.counts
            self.counts = got
        else:
            self.counts[: got.size] += got

    def at_least(self, threshold: float) -> dict[int, int] | None:
        """Values >= ``threshold`` by ``g`` (none: left out), or None when the first pass did not
        keep the values of the bin holding it (a single chunk, too many values, a prediction
        missed): every bin above it is counted, and its own values compared one by one."""
        if self.whole is not None:
            values, groups = self.whole
            return {
                g: int(count) for g, count in enumerate(np.bincount(groups[values >= threshold])) if count
            }
        if self.layout is None or self.stored is None or self.predicted is None or not self.bins:
            return None
        part = self.layout.index[_part_key(self.part)]
        (bin_,) = self.layout.place(np.array([threshold], dtype=np.float64), part)[1]
        if not self.predicted[bin_]:
            return None
        local = int(bin_ - self.layout.offset[part])
        above = [self.counts.reshape(-1, self.bins)[:, local + 1 :].sum(axis=1)]
        for values, _, bins, groups in self.stored:
            above.append(np.bincount(groups[(bins == bin_) & (values >= threshold)]))
        size = max(len(counts) for counts in above)
        by_g = np.sum([np.pad(counts, (0, size - len(counts))) for counts in above], axis=0)
        return {g: int(count) for g, count in enumerate(by_g) if count}


STORE_MAX = 1 << 23  # values the first pass keeps in the predicted bins (24 bytes each: ~200 MB)
SAMPLE_SIGMAS = 5.0  # the predicted bins span this many standard errors of the sample's quantile
WHOLE_PART = 1 << 16  # a part of at most this many values is kept whole (its sample is too thin)


def _predict(
    layout: _Layout,
    targets: list[_Target],
    sampled: npt.NDArray[np.int64],
    bounds: dict[Part, tuple[int, float, float]],
) -> npt.NDArray[np.bool_]:
    """The first-pass bins likely to hold the targets' ranks, from a sample's histogram: the
    bins between the sample's quantiles at the rank's fraction plus and minus
    :data:`SAMPLE_SIGMAS` standard errors (whole small parts). Only the cost depends on it: a
    rank outside costs the pass it would have cost anyway."""
    predicted = np.zeros(layout.total, dtype=np.bool_)
    for target in targets:
        part = layout.parts.index(target.part)
        start, end = int(layout.offset[part]), int(layout.offset[part + 1])
        count = bounds[target.part][0]
        own = np.cumsum(sampled[start:end])
        size = int(own[-1])
        if count <= WHOLE_PART:
            predicted[start:end] = True
            continue
        if size < 100:
            continue  # too thin a sample: this target will need a second read
        fraction = (target.rank + 0.5) / count
        margin = SAMPLE_SIGMAS * np.sqrt(fraction * (1 - fraction) / size) + 2 / size
        low = int(np.searchsorted(own, (fraction - margin) * size, side="left"))
        high = int(np.searchsorted(own, (fraction + margin) * size, side="left"))
        predicted[start + low : start + min(high, end - start - 1) + 1] = True
    return predicted


def _first_pass(
    layout: _Layout,
    targets: list[_Target],
    reads: Iterator[Placed],
    predicted: npt.NDArray[np.bool_] | None,
    tail: Tail | None = None,
) -> list[Placed] | None:
    """Counts every value in its bin and sets each target's bin; keeps the values of the
    ``predicted`` bins (None past :data:`STORE_MAX`: they are read again). ``tail``: counts
    its part's values by ``g`` and bin too."""
    counts = np.zeros(layout.total, dtype=np.int64)
    stored: list[Placed] | None = None if predicted is None else []
    size = 0
    if tail is not None:
        tail.layout, tail.predicted = layout, predicted
        part = layout.index[_part_key(tail.part)]
        start, end = int(layout.offset[part]), int(layout.offset[part + 1])
    for values, position, bins, groups in reads:
        counts += np.bincount(bins, minlength=layout.total)
        if tail is not None:
            inside = (bins >= start) & (bins < end)
            tail.count(groups[inside], bins[inside] - start, end - start)
        if stored is not None and predicted is not None:
            chosen = predicted[bins]
            size += int(np.count_nonzero(chosen))
            if size > STORE_MAX:
                stored = None
            else:
                stored.append((values[chosen], position[chosen], bins[chosen], groups[chosen]))
    for target in targets:
        part = layout.parts.index(target.part)
        own = counts[layout.offset[part] : layout.offset[part + 1]]
        before = np.cumsum(own)
        found = int(np.searchsorted(before, target.offset, side="right"))
        target.first_bin = int(layout.offset[part]) + found
        target.count = int(own[found])
        target.offset -= int(before[found]) - target.count
        target.low, target.high = -np.inf, np.inf
    if tail is not None:
        tail.stored = stored
    return stored


@dataclass
class _Window:
    """Values of one layout bin within [low, high]: kept whole, or counted in ``nb`` finer bins
    (linear between ``low`` and ``high`` when both are known, else in the bin's own position)."""

    first_bin: int
    low: float
    high: float
    base: int = 0  # the layout offset of the bin's part (the bin within its part: first_bin - base)
    nb: int = 0  # 0: keep the values
    kept: list[npt.NDArray[np.float64]] = field(default_factory=list)
    counts: npt.NDArray[np.int64] | None = None
    mins: npt.NDArray[np.float64] | None = None
    maxs: npt.NDArray[np.float64] | None = None

    def take(self, values: npt.NDArray[np.float64], position: npt.NDArray[np.float64]) -> None:
        if not self.nb:
            self.kept.append(values)
            return
        if np.isfinite(self.low):
            fine = (values - self.low) / (self.high - self.low) * self.nb
        else:
            fine = (position - (self.first_bin - self.base)) * self.nb
        sub = np.clip(np.floor(fine), 0, self.nb - 1).astype(np.int64)
        assert self.counts is not None and self.mins is not None and self.maxs is not None
        self.counts += np.bincount(sub, minlength=self.nb)
        np.minimum.at(self.mins, sub, values)
        np.maximum.at(self.maxs, sub, values)


def _next_pass(layout: _Layout, targets: list[_Target], reads: Iterator[Placed]) -> None:
    windows: dict[tuple[int, float, float], _Window] = {}
    for target in targets:
        key = (target.first_bin, target.low, target.high)
        if key not in windows:
            part = layout.parts.index(target.part)
            window = windows[key] = _Window(
                target.first_bin, target.low, target.high, base=int(layout.offset[part])
            )
            if target.count > FETCH_MAX:
                window.nb = _bins_for(target.count)
                window.counts = np.zeros(window.nb, dtype=np.int64)
                window.mins = np.full(window.nb, np.inf)
                window.maxs = np.full(window.nb, -np.inf)
    by_bin: dict[int, list[_Window]] = {}
    for window in windows.values():
        by_bin.setdefault(window.first_bin, []).append(window)
    marked = np.zeros(layout.total, dtype=np.bool_)
    marked[list(by_bin)] = True
    for values, position, bins, _ in reads:
        chosen = marked[bins]
        if not chosen.any():
            continue
        bins, position, values = bins[chosen], position[chosen], values[chosen]
        for first_bin, group in by_bin.items():
            inside = bins == first_bin
            if not inside.any():
                continue
            for window in group:
                keep = inside & (values >= window.low) & (values <= window.high)
                window.take(values[keep], position[keep])
    for target in targets:
        window = windows[(target.first_bin, target.low, target.high)]
        if not window.nb:
            ordered = np.sort(np.concatenate(window.kept))
            target.value = float(ordered[target.offset])
            continue
        assert window.counts is not None and window.mins is not None and window.maxs is not None
        before = np.cumsum(window.counts)
        found = int(np.searchsorted(before, target.offset, side="right"))
        target.count = int(window.counts[found])
        target.offset -= int(before[found]) - target.count
        target.low, target.high = float(window.mins[found]), float(window.maxs[found])
        if target.low == target.high:
            target.value = target.low


# ---------------------------------------------------------------------------------------------
# The summary


def totals_sql(reduced: str, by: str | None = None) -> str:
    """Everything the summary sums, per (model, length group, hit), in one scan: the cells,
    each series' count, min, max and sum (the order statistics' bounds and scale), the TTFT
    decomposition, the prefill groups' sums, the arrival times' range and the last row number
    (:func:`row_chunks`). Per-model rows are
    added up in Python, exactly (integers; min and max of floats). ``by``: a column of
    ``reduced`` grouped by too, selected last."""
    series = ", ".join(f"COUNT({name}), MIN({name}), MAX({name}), SUM({name})" for name in SERIES[:-1])
    timed = "FILTER (WHERE prefill_seconds IS NOT NULL)"
    complete = "FILTER (WHERE ttft_complete)"

    # DuckDB sums BIGINT into HUGEINT (128 bits): exact, and faster than DECIMAL(38,0). The
    # terms fit in BIGINT: n^2 <= 1e14 (records.MAX_TOKENS), 86,400 s * 2^40 < 2^63.
    def _exact(column: str) -> str:
        return f"SUM({column})"

    def _fixed(column: str) -> str:
        return f"SUM(CAST(FLOOR({column} * {sqltext.number(FIXED)}) AS BIGINT))"

    return f"""SELECT model, length_group, hit, COUNT(*),
  {_exact("prompt_tokens")}, {_exact("cached_tokens")},
  {_exact("prompt_squares")}, {_exact("cached_squares")},
  {series},
  COUNT(*) {complete}, COUNT(*) FILTER (WHERE ttft_overlapped),
  {_fixed("queue_seconds")} {complete}, {_fixed("prefill_seconds")} {complete},
  {_fixed("ttft_other")} {complete},
  {_exact("prompt_tokens")} {timed}, {_exact("cached_tokens")} {timed},
  MIN(arrival_time), MAX(arrival_time), COUNT(arrival_time), MAX(row){f", {by}" if by else ""}
FROM ({reduced}) AS reduced_rows GROUP BY model, length_group, hit{f", {by}" if by else ""}"""


MATERIALIZE_SHARE = 0.5  # of the memory limit: Parquet rows are copied into memory when they fit in it
COLUMN_BYTES = 10  # a column of a row in a DuckDB table, measured: 91 MB for 1M rows of 10 columns


def working_set(engine: Engine, loaded: Loaded) -> str:
    """The table or view the summary scans: ``records``, which :func:`load` has put in memory
    when it fits (:attr:`Loaded.in_memory`)."""
    del engine, loaded  # load decides; kept as the step between load and summarize
    return "records"


_UNITS = {
    "bytes": 1,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
}


def _bytes(setting: str) -> float:
    """DuckDB's ``memory_limit`` as it reports it (``'1.8 GiB'``) in bytes."""
    number, _, unit = setting.partition(" ")
    return float(number) * _UNITS.get(unit, 1)


def _int(value: Any) -> int:
    return 0 if value is None else int(value)


KEPT = ("src", "row", "arrival_time")  # columns of the records the reduced view keeps as they are


def summarize(
    engine: Engine, source: str, edges: Sequence[int], default_model: str, unchecked: Unchecked | None = None
) -> report.Summary:
    """The :class:`kvlens.analysis.report.Summary` of the records in ``source``: one scan for
    the sums and bounds (:func:`totals_sql`), the order statistics (a sample, then one read of
    the records in chunks, rarely more: :func:`order_statistics`), one scan for the slowest
    requests. Nothing is materialized: each scan reads ``source`` (a table of JSON-lines
    records, or the Parquet files where they lie) and derives the decisions as it reads.
    Records each model's count of timed requests in ``engine.prefill_counts`` for
    :func:`calibration_inputs`, and the arrival times' range in ``engine.arrivals``.
    ``unchecked`` (:attr:`Loaded.unchecked`): the sums scan checks those Parquet rows too,
    grouped by rejection as well, and settles them (the rejected rows counted, the view of
    ``source`` checks no more)."""
    con = engine.connection
    con.execute(f"CREATE OR REPLACE TEMP VIEW reduced AS {reduced_sql(source, edges, default_model, KEPT)}")
    totals = totals_sql("SELECT * FROM reduced")
    if unchecked is not None:
        checked = reduced_sql(
            f"({unchecked.source()}) AS records_checked", edges, default_model, (*KEPT, "rejection")
        )
        totals = totals_sql(checked, by="rejection")
    rejected = False
    cells: dict[report.Key, report.Cell] = {}
    bounds: dict[Part, tuple[int, float, float]] = {}
    sums: dict[Part, float] = {}  # of each part's values: only the first pass's bin scale reads them
    decomposition = [0, 0, 0, 0, 0]
    prefill_sums: dict[report.Group, tuple[int, int, int]] = {}
    timed_by_model: dict[str, int] = {}
    last_row = 0

    def widen(part: Part, count: int, low: float, high: float, total: float) -> None:
        sums[part] = sums.get(part, 0.0) + total
        if part in bounds:
            known = bounds[part]
            count, low, high = known[0] + count, min(known[1], low), max(known[2], high)
        bounds[part] = (count, low, high)

    for row in con.execute(totals).fetchall():
        if unchecked is not None and row[-1] is not None:
            rejected = True  # counted by :meth:`Unchecked.settle`
            continue
        model, g, hit = str(row[0]), int(row[1]), bool(row[2])
        requests, n, h, n2, h2 = (int(value) for value in row[3:8])
        cells[(model, g, hit)] = report.Cell(requests, n, h, (n2 + n) // 2, (h2 + h) // 2)
        at = 8
        for name in SERIES[:-1]:
            count, low, high, total = row[at : at + 4]
            at += 4
            if count:
                widen((name, g, hit), int(count), float(low), float(high), float(total))
                if name == "ttft_seconds":
                    widen(("all_ttft", -1, False), int(count), float(low), float(high), float(total))
        for index, value in enumerate(row[at : at + 5]):
            decomposition[index] += _int(value)
        timed_n, timed_h = _int(row[at + 5]), _int(row[at + 6])
        timed = _int(row[8 + 4 * SERIES.index("prefill_seconds")])
        if timed:
            before = prefill_sums.get((g, hit), (0, 0, 0))
            prefill_sums[(g, hit)] = (before[0] + timed, before[1] + timed_n, before[2] + timed_h)
            timed_by_model[model] = timed_by_model.get(model, 0) + timed
        first, last, arrivals = row[at + 7 : at + 10]
        if arrivals:
            known = engine.arrivals
            engine.arrivals = (
                float(first) if known[0] is None else min(known[0], float(first)),
                float(last) if known[1] is None else max(known[1], float(last)),
                known[2] + int(arrivals),
            )
        last_row = max(last_row, int(row[at + 10]))
    if unchecked is not None:
        unchecked.settle(engine, rejected)
    engine.prefill_counts = timed_by_model
    records = sum(cell.requests for cell in cells.values())
    series = _series(row_chunks(records, last_row), sample_rows(records, last_row))
    fractions = {name: tuple(q / 100 for q in report.QUANTILES) for name in report.LATENCY_COLUMNS}
    fractions["prefill_per_computed_token"] = (0.5,)
    fractions["all_ttft"] = (1 - report.SLOWEST_SHARE,)
    wanted: dict[Part, list[int]] = {}
    for part, (count, _, _) in bounds.items():
        ranks = [definitions.quantile_ranks(count, fraction) for fraction in fractions[part[0]]]
        wanted[part] = sorted({rank for low, high, _ in ranks for rank in (low, high)})
    means = {part: sums[part] / bounds[part][0] for part in bounds}
    tail = Tail(("all_ttft", -1, False))  # the slowest requests: counted from the same read
    found = order_statistics(engine, series, wanted, bounds, means, tail)

    def quantiles_of(part: Part, fractions: tuple[float, ...]) -> list[float]:
        count = bounds[part][0]
        return definitions.quantiles(count, fractions, lambda ranks: [found[(part, rank)] for rank in ranks])

    def latency_of(part: Part) -> dict[str, Any]:
        count = bounds[part][0] if part in bounds else 0
        return report.percentiles_of(count, lambda ranks: [found[(part, rank)] for rank in ranks])

    groups = {(key[1], key[2]) for key in cells}
    latency = {
        group: {name: latency_of((name, *group)) for name in report.LATENCY_COLUMNS}
        for group in sorted(groups)
    }
    threshold, counted = None, None
    slowest: dict[report.Group, int] = {}
    if ("all_ttft", -1, False) in bounds:
        (threshold,) = quantiles_of(("all_ttft", -1, False), (1 - report.SLOWEST_SHARE,))
        counted = tail.at_least(threshold)
        if counted is not None:  # g = (length group + 1) * 2 + hit (:func:`_series`)
            slowest = {(g // 2 - 1, bool(g % 2)): count for g, count in counted.items()}
    if threshold is not None and counted is None:
        slowest = {
            (int(g), bool(hit)): int(count)
            for g, hit, count in con.execute(
                "SELECT length_group, hit, COUNT(*) FROM reduced WHERE ttft_seconds >= ? GROUP BY ALL",
                [threshold],
            ).fetchall()
        }
    prefill_groups: dict[report.Group, report.PrefillGroup] = {}
    for group, (count, n, h) in sorted(prefill_sums.items()):
        (median,) = quantiles_of(("prefill_seconds", *group), (0.5,))
        (per_token,) = quantiles_of(("prefill_per_computed_token", *group), (0.5,))
        prefill_groups[group] = report.PrefillGroup(count, n, h, median, per_token)
    return report.Summary(
        cells, latency, report.Decomposition(*decomposition), threshold, slowest, prefill_groups
    )


def arrival_range(engine: Engine, table: str) -> tuple[float | None, float | None, int]:
    """The first and last arrival time of the valid records in ``table`` (the
    :func:`working_set`), and how many have one."""
    first, last, count = engine.connection.execute(
        f"SELECT min(arrival_time), max(arrival_time), count(arrival_time) FROM {table}"
    ).fetchone() or (None, None, 0)
    return (None if first is None else float(first), None if last is None else float(last), int(count))


@contextlib.contextmanager
def _registered(engine: Engine, tables: dict[str, dict[str, Any]]) -> Iterator[None]:
    for name, table in tables.items():
        engine.connection.register(name, table)
    try:
        yield
    finally:
        for name in tables:
            engine.connection.unregister(name)


CALIBRATION_BATCH = 2_000_000  # points fetched into Python at once, about 32 bytes each


def calibration_inputs(engine: Engine, limit: int) -> Iterator[tuple[str, Any, Any, Any]]:
    """Per model (by name), ``n``, ``h`` and prefill seconds of its records with a prefill time,
    in input order; past ``limit`` records of a model, an even, deterministic sample of about
    ``limit`` of them (a fit needs the shape of the cloud, not every point). The models' points
    come in batches of about :data:`CALIBRATION_BATCH` (one batch: a single scan and fetch;
    more: one scan picks every model's points into a table, in DuckDB and spilled if need be,
    then each batch is read from it). Call after :func:`summarize` (it counts each model's
    timed records)."""
    con = engine.connection
    counts = engine.prefill_counts
    names = sorted(counts)
    batches: list[list[int]] = []
    size = 0
    for index, name in enumerate(names):
        expected = min(counts[name], limit)  # a sample is about limit: a batch may pass the size a little
        if not batches or size + expected > CALIBRATION_BATCH:
            batches.append([])
            size = 0
        batches[-1].append(index)
        size += expected
    rates = {
        "i": np.arange(len(names), dtype=np.int64),
        "m": np.array(names, dtype=object),
        "c": np.array(
            [counts[name] for name in names], dtype=np.uint64
        ),  # hash() is UBIGINT: no HUGEINT modulo
    }
    picked = (
        "SELECT rates.i, prompt_tokens, cached_tokens, prefill_seconds, src, row FROM reduced "
        "JOIN rates ON reduced.model = rates.m WHERE prefill_seconds IS NOT NULL "
        f"AND (rates.c <= {int(limit)} OR hash(src, row) % rates.c < {int(limit)})"
    )
    source = f"({picked})"
    if len(batches) > 1:
        with _registered(engine, {"rates": rates}):
            con.execute(f"CREATE OR REPLACE TEMP TABLE calibration_points AS {picked}")
        source = "calibration_points"
    try:
        for batch in batches:
            with _registered(engine, {"rates": rates}):
                rows = con.execute(
                    f"SELECT i, prompt_tokens, cached_tokens, prefill_seconds, src, row FROM {source} "
                    f"WHERE i BETWEEN {batch[0]} AND {batch[-1]}"
                ).fetchnumpy()
            # by model, then input order: numpy's sort of the fetched keys costs half DuckDB's ORDER BY
            order = np.lexsort((np.asarray(rows["row"]), np.asarray(rows["src"]), np.asarray(rows["i"])))
            models = np.asarray(rows["i"], dtype=np.int64)[order]
            n, h = (
                np.asarray(rows[name], dtype=np.int64)[order] for name in ("prompt_tokens", "cached_tokens")
            )
            seconds = np.asarray(rows["prefill_seconds"], dtype=np.float64)[order]
            edges = np.searchsorted(models, np.arange(batch[0], batch[-1] + 2))
            for index, low, high in zip(batch, edges[:-1], edges[1:], strict=True):
                yield names[index], n[low:high], h[low:high], seconds[low:high]
    finally:
        con.execute("DROP TABLE IF EXISTS calibration_points")


def convert(
    paths: Sequence[str],
    out: Path,
    *,
    format_name: str | None = None,
    model: str | None = None,
    memory_limit: str = DEFAULT_MEMORY_LIMIT,
) -> tuple[Loaded, int]:
    """Write the valid records of ``paths`` to one Parquet file (zstd), in input order, with
    every scalar field of the record (``prefix_hashes`` is not kept: a list of mixed ints and
    strings has no Parquet type, and only the in-memory diagnosis reads it). Returns how the
    input read and how many records were written."""
    engine = Engine(memory_limit=memory_limit)
    try:
        with engine_errors(memory_limit, engine.spill_directory):
            loaded = load(engine, paths, columns=SCALAR_COLUMNS, format_name=format_name, model=model)
            ((count,),) = engine.connection.execute(
                f"COPY (SELECT {', '.join(SCALAR_COLUMNS)} FROM records ORDER BY src, row) "
                f"TO {sqltext.duckdb_text(sqltext.scanned_name(str(out)))} (FORMAT parquet, COMPRESSION zstd)"
            ).fetchall()
        return loaded, int(count)
    finally:
        engine.close()
