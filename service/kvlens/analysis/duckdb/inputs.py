"""The records view of the ``duckdb`` engine: JSON lines loaded into a table
(:mod:`kvlens.analysis.duckdb.jsonl`), Parquet checked and scanned where it lies or copied into
memory (:mod:`kvlens.analysis.duckdb.parquet`), one view ``records`` over both; and ``kvlens
convert``, the records written back as one Parquet file."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvlens import records, sqltext
from kvlens.analysis import reader
from kvlens.analysis.duckdb import jsonl, parquet
from kvlens.analysis.duckdb.engine import Engine, engine_errors
from kvlens.analysis.duckdb.parquet import Unchecked
from kvlens.analysis.duckdb.sql import sql_type
from kvlens.errors import InputError
from kvlens.limits import DEFAULT_MEMORY_LIMIT

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
    hashes: bool = False,
) -> Loaded:
    """Create the view ``records`` (``columns`` plus ``src`` and ``row``) of the valid records
    of ``paths``, counting skipped lines and rows in the result as the numpy path does.

    ``check_later``: Parquet scanned in place gets no scan of its own to check it; the view
    checks each row as it reads until :func:`kvlens.analysis.duckdb.summary.summarize`, given
    :attr:`Loaded.unchecked`, checks every row in its sums scan (one scan fewer). The rejected
    rows of :attr:`Loaded.read` are counted only then.

    ``hashes``: the JSON lines' records that hold ``prefix_hashes`` are also put in the table
    ``jsonl_hashes`` (``src``, ``row``, ``block_size``, ``prefix_hashes``), which the
    diagnosis's prefix potential reads (:mod:`kvlens.analysis.duckdb.potential`); Parquet
    holds none (a list of mixed ints and strings has no Parquet type)."""
    files = _objects(engine, reader.resolve(paths))
    result = reader.ReadResult(batch=records.batch_from_objects([]).batch)
    con = engine.connection
    typed = ", ".join(f"{name} {sql_type(name)}" for name in columns)
    con.execute(f"CREATE OR REPLACE TEMP TABLE jsonl_records ({typed}, src INTEGER, row BIGINT)")
    if hashes:
        kept = ", ".join(f"{name} {sql}" for name, sql in jsonl.HASHES_COLUMNS.items())
        con.execute(f"CREATE OR REPLACE TEMP TABLE jsonl_hashes (src INTEGER, row BIGINT, {kept})")
    scanned = [(index, path) for index, path in enumerate(files) if reader.is_parquet(path)]
    in_parquet = {index for index, _ in scanned}
    for index, path in enumerate(files):
        if index not in in_parquet:
            jsonl.load_file(
                con,
                "jsonl_records",
                {name: sql_type(name) for name in columns},
                index,
                path,
                result,
                format_name=format_name,
                model=model,
                progress=progress,
                hashes="jsonl_hashes" if hashes else None,
            )
    lines = "SELECT * FROM jsonl_records"
    view, in_memory, unchecked = lines, True, None
    if scanned:
        rows = parquet.rows(engine, [path for _, path in scanned])
        in_memory = parquet.fits_in_memory(engine, rows, columns)
        checks = parquet.checks(engine, scanned, columns)
        result.lines += rows
        for _, path in scanned:
            result.formats[path] = "parquet"
        if in_memory or not check_later:
            view += f" UNION ALL {parquet.view(engine, checks, result, in_memory)}"
        else:
            unchecked = Unchecked(checks, lines, result)
            view += (
                f" UNION ALL SELECT {checks.names}, src, row FROM ({checks.checked}) WHERE rejection IS NULL"
            )
    con.execute(f"CREATE OR REPLACE TEMP VIEW records AS {view}")
    return Loaded(read=result, files=files, parquet=bool(scanned), in_memory=in_memory, unchecked=unchecked)


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
