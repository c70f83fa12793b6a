"""What bounds ``kvlens analyze``'s peak RSS (goal: 1 GiB at every size with the default memory
limit; bench/analyze.py measures it): what is copied into memory, what is read into numpy at
once, what the records table holds."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvlens.analysis.duckdb import inputs, order_statistics, parquet
from kvlens.analysis.duckdb.engine import Engine
from tests.unit.test_columnar import write_jsonl

pytest.importorskip("duckdb")


def test_ten_million_parquet_rows_are_scanned_in_place_at_the_default_limit() -> None:
    """Copied (1.0 GB) they peaked at 1.41 GiB; in place at 0.68 GiB."""
    engine = Engine()
    try:
        assert parquet.fits_in_memory(engine, 1_000_000, inputs.ANALYSIS_COLUMNS)
        assert not parquet.fits_in_memory(engine, 10_000_000, inputs.ANALYSIS_COLUMNS)
    finally:
        engine.close()


def _widths(predicates: tuple[str, ...]) -> list[int]:
    return [
        sum(int(high) - int(low) for low, high in re.findall(r"row >= (\d+) AND row < (\d+)", where))
        for where in predicates
    ]


def test_past_one_chunk_the_order_statistics_read_a_bounded_number_of_rows_at_once() -> None:
    """1M rows at a time held 0.5 GB in numpy beside DuckDB's memory at 10M records."""
    records = 10_000_000
    chunks = order_statistics.row_chunks(records, records - 1)
    assert max(_widths(chunks)) <= 131_072
    assert sum(_widths(chunks)) >= records
    sample = order_statistics.sample_rows(records, records - 1)
    assert sample is not None
    assert max(_widths(sample)) <= 131_072
    assert order_statistics.row_chunks(1_000_000, 999_999) == ("TRUE",)  # one read, ranked whole


def test_the_prefix_potential_columns_are_not_kept_when_no_record_has_hashes(tmp_path: Path) -> None:
    """Empty, they held 130 MB of the 10M records' table."""
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"prompt_tokens": 10, "cached_tokens": 0}] * 3)
    hashed = write_jsonl(
        tmp_path / "hashed.jsonl", [{"prompt_tokens": 10, "cached_tokens": 0, "prefix_hashes": [1]}]
    )
    columns = (*inputs.ANALYSIS_COLUMNS, *inputs.POTENTIAL_COLUMNS)
    for path, kept in ((plain, False), (hashed, True)):
        engine = Engine()
        try:
            inputs.load(engine, [str(path)], columns=columns)
            stored = {
                name
                for (name,) in engine.connection.execute(
                    "SELECT column_name FROM duckdb_columns() WHERE table_name = 'jsonl_records'"
                ).fetchall()
            }
            assert ("prefix_hashes" in stored, "block_size" in stored) == (kept, kept)
            ((count, hashes),) = engine.connection.execute(
                "SELECT count(*), count(prefix_hashes) FROM records"
            ).fetchall()
            assert (count, hashes) == ((3, 0) if not kept else (1, 1))
        finally:
            engine.close()
