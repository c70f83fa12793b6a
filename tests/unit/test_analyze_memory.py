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


def test_hashes_are_kept_apart_and_only_for_the_records_that_hold_them(tmp_path: Path) -> None:
    """In the records' table, empty, they held 130 MB of 10M records (past the 1 GiB goal)."""
    lines = [{"prompt_tokens": 10, "cached_tokens": 0}] * 3 + [
        {"prompt_tokens": 10, "cached_tokens": 0, "prefix_hashes": [1, "a"], "block_size": 4}
    ]
    whole = write_jsonl(tmp_path / "whole.jsonl", lines)
    broken = write_jsonl(tmp_path / "broken.jsonl", lines, extra=b"{broken\n")  # read a batch at a time
    for path in (whole, broken):
        engine = Engine()
        try:
            inputs.load(engine, [str(path)], hashes=True)
            stored = {
                name
                for (name,) in engine.connection.execute(
                    "SELECT column_name FROM duckdb_columns() WHERE table_name = 'jsonl_records'"
                ).fetchall()
            }
            assert "prefix_hashes" not in stored
            assert engine.connection.execute(
                "SELECT src, row, block_size, CAST(prefix_hashes AS VARCHAR) FROM jsonl_hashes"
            ).fetchall() == [(0, 3, 4, '[1,"a"]')]
        finally:
            engine.close()
