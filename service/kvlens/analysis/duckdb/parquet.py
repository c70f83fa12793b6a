"""Parquet for the ``duckdb`` engine: scanned where it lies (a local file, a directory's files,
an ``s3://`` glob), its schema checked against the record's, every row checked by the bounds
:class:`kvlens.records.Record` declares (:func:`kvlens.analysis.duckdb.sql.rejection_sql`), the
rejected rows counted by reason and named as the validator names lines; copied into memory
once only when the rows fit in :data:`MATERIALIZE_SHARE` of the memory limit and in
:data:`MATERIALIZE_MAX_BYTES`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvlens import records, sqltext
from kvlens.analysis import reader
from kvlens.analysis.duckdb.engine import Engine
from kvlens.analysis.duckdb.sql import SPEC, labels_to_check, rejection_sql, sql_type
from kvlens.errors import InputError

# Distinct labels outside printable ASCII that :func:`kvlens.records.valid_label` checks in
# Python, at most; past it every row is matched by the RE2 pattern instead.
MAX_LABELS_CHECKED = 100_000
MATERIALIZE_SHARE = 0.5  # of the memory limit: Parquet rows are copied into memory when they fit in it
# ... and in this, whatever the limit: the scans after the copy need up to 0.75 GiB besides (the
# 100M records scanned in place peak at 0.89 GiB), and analyze's peak RSS goal is 1 GiB. A
# copy of 10M rows (1.0 GB, chosen when the limit's half was the only bound) peaked at 1.41 GiB;
# scanned in place they peak at 0.68 GiB and ran no slower.
MATERIALIZE_MAX_BYTES = 256 * 1024 * 1024
COLUMN_BYTES = 10  # a column of a row in a DuckDB table, measured: 91 MB for 1M rows of 10 columns


def rows(engine: Engine, paths: list[str]) -> int:
    """Rows of the Parquet files, from their footers."""
    listed = ", ".join(sqltext.duckdb_path(path) for path in paths)
    ((count,),) = engine.connection.execute(
        f"SELECT COALESCE(SUM(num_rows), 0) FROM parquet_file_metadata([{listed}])"
    ).fetchall()
    return int(count)


def fits_in_memory(engine: Engine, count: int, columns: Sequence[str]) -> bool:
    """Whether ``count`` Parquet rows fit in :data:`MATERIALIZE_SHARE` of the memory limit and
    in :data:`MATERIALIZE_MAX_BYTES`, at :data:`COLUMN_BYTES` a column."""
    copy = count * COLUMN_BYTES * (len(columns) + 3)
    return copy <= min(MATERIALIZE_SHARE * engine.memory_limit_bytes(), MATERIALIZE_MAX_BYTES)


@dataclass(frozen=True)
class Checks:
    """The Parquet files as SQL: ``scan``, every row with its ``src`` and ``row``; ``checked``,
    the wanted columns (``selected``: NULL where no file has one) with each row's
    ``rejection`` (:func:`kvlens.analysis.duckdb.sql.rejection_sql`; NULL: valid)."""

    columns: tuple[str, ...]
    scan: str
    selected: str
    checked: str
    path_of: dict[int, str]

    @property
    def names(self) -> str:
        return ", ".join(self.columns)


def checks(engine: Engine, parquet: list[tuple[int, str]], columns: Sequence[str]) -> Checks:
    """The :class:`Checks` of the files ``parquet`` (their ``src`` and path), their schemas
    checked first (:func:`_present`)."""
    present = _present(engine, [path for _, path in parquet], columns)
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
        (f"NULLIF({name}, '') AS {name}" if SPEC[name].kind is str else name)
        if name in present
        else f"CAST(NULL AS {sql_type(name)}) AS {name}"
        for name in columns
    )
    invalid = invalid_labels(
        engine, scan, [name for name in columns if name in present and SPEC[name].is_label]
    )
    checked = f"SELECT {selected}, src, row, {rejection_sql(present, invalid)} AS rejection FROM ({scan})"
    return Checks(tuple(columns), scan, selected, checked, dict(parquet))


def invalid_labels(engine: Engine, scan: str, labels: Sequence[str]) -> bool | None:
    """Whether some of the ``labels`` columns of ``scan`` hold an invalid label (each then in
    the table ``invalid_labels``), or None when there are more than :data:`MAX_LABELS_CHECKED`
    distinct labels outside printable ASCII or too long. Short printable ASCII is valid; the few
    distinct others are checked by :func:`kvlens.records.valid_label`, the JSON lines' check, so
    that the scans after it check no label row by row: matching every row with a pattern of
    Python's printable characters cost three times the bare scan, building the pattern 0.15 s
    a run, and a length check every row ~1.4 CPU s at 100M rows."""
    if not labels:
        return False
    distinct = labels_to_check(f"({scan})", list(labels))
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


def view(engine: Engine, checked: Checks, result: reader.ReadResult, in_memory: bool) -> str:
    """The valid rows of the Parquet files as SQL; rejected rows are counted by reason in
    ``result`` (with the first few named by file and row), as the validator does for lines.
    ``in_memory``: the rows are checked and copied into a table in one scan, and every later
    scan reads that table (not Parquet pages to decode and check again). Else one scan checks
    the files and keeps the rejected rows' numbers, and every later scan reads the files where
    they lie (:func:`left_out`). A copy past the memory limit would spill to disk and every
    scan would read it back."""
    if not in_memory:
        return left_out(engine, checked, result)
    engine.connection.execute(f"CREATE OR REPLACE TEMP TABLE parquet_records AS {checked.checked}")
    _count_rejected(
        engine, checked, result, "SELECT rejection, src, row FROM parquet_records WHERE rejection IS NOT NULL"
    )
    return f"SELECT {checked.names}, src, row FROM parquet_records WHERE rejection IS NULL"


def left_out(engine: Engine, checked: Checks, result: reader.ReadResult, rejected: bool = True) -> str:
    """The valid rows of Parquet scanned in place as SQL: a scan of the files keeps the rejected
    rows' numbers in a table (DuckDB spills it if need be) and counts them in ``result``; every
    later scan reads only the columns it needs and leaves those rows out by an anti-join (none
    when every row passed): not the checks again, which read every column (the model's name
    too) and cost about a third of a scan. ``rejected`` False (a scan has counted none): no
    table, no scan."""
    valid = f"SELECT {checked.selected}, src, row FROM ({checked.scan})"
    if rejected:
        engine.connection.execute(
            "CREATE OR REPLACE TEMP TABLE parquet_rejected AS "
            f"SELECT rejection, src, row FROM ({checked.checked}) WHERE rejection IS NOT NULL"
        )
        if _count_rejected(engine, checked, result, "SELECT * FROM parquet_rejected"):
            valid = (
                f"SELECT * FROM ({valid}) AS scanned ANTI JOIN parquet_rejected AS out "
                "ON scanned.src = out.src AND scanned.row = out.row"
            )
    return f"SELECT {checked.names}, src, row FROM ({valid})"


def _count_rejected(engine: Engine, checked: Checks, result: reader.ReadResult, rejections: str) -> int:
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
                    "file": checked.path_of[int(src_index)],
                    "row": int(row),
                    "field": field_name or None,
                    "reason": reason,
                    "message": records.reason_message(field_name or None, reason),
                }
            )
    return rejected


@dataclass(frozen=True)
class Unchecked:
    """Parquet scanned in place that :func:`kvlens.analysis.duckdb.inputs.load` left unchecked
    (``check_later``): the sums scan of :func:`kvlens.analysis.duckdb.summary.summarize` reads
    :meth:`source` and checks every row as it sums, then :meth:`settle` counts the rejected rows
    and makes the records view stop checking."""

    checks: Checks
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
        valid = left_out(engine, self.checks, self.result, rejected)
        engine.connection.execute(f"CREATE OR REPLACE TEMP VIEW records AS {self.jsonl} UNION ALL {valid}")


def _present(engine: Engine, paths: list[str], columns: Sequence[str]) -> set[str]:
    """The wanted columns some file has; an error naming the file and column when a file lacks
    a required column, stores one in a type that is not the record's (a DECIMAL or TIMESTAMP is
    an integer underneath, a BLOB a byte array: DuckDB would read 1.50 tokens as 1), nests it,
    or has two columns that DuckDB would both read as it (it binds names without case).

    Only top-level columns count: a struct's child named ``prompt_tokens`` is not the record's.
    ``parquet_schema`` lists each file's schema tree depth first, each group with its number
    of children, from which the top level is read."""
    listed = ", ".join(sqltext.duckdb_path(path) for path in paths)
    schema = engine.connection.execute(
        "SELECT file_name, name, type, repetition_type, num_children, converted_type, logical_type "
        f"FROM parquet_schema([{listed}])"
    ).fetchall()
    trees: dict[str, list[tuple[Any, ...]]] = {}
    for node in schema:
        trees.setdefault(node[0], []).append(node[1:])
    present: set[str] = set()
    for path in paths:
        top = _top_level(trees.get(sqltext.scanned_name(path), []))
        for name in columns:
            spec = SPEC[name]
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
