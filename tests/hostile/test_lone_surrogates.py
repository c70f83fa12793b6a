"""A text field holding a lone surrogate (the JSON escape ``\\ud800``, which the standard JSON
decoder gives back as is): the validator took it, and DuckDB then refused the whole batch, so
``kvlens convert`` wrote nothing ("cannot encode str as UTF-8", naming no line). Such a line is
now one bad line (``not_a_string``), and the lines beside it are converted."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvlens.cli import main

pytest.importorskip("duckdb")


@pytest.mark.parametrize("field", ["request_id", "finish_reason", "arm"])
def test_a_lone_surrogate_is_one_bad_line_and_the_others_are_converted(
    field: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import duckdb

    source = tmp_path / "records.jsonl"
    source.write_text(
        f'{{"prompt_tokens": 5, "cached_tokens": 1, "{field}": "\\ud800"}}\n'
        + f'{{"prompt_tokens": 6, "cached_tokens": 2, "{field}": "ok"}}\n'
    )
    out = tmp_path / "records.parquet"
    assert main(["convert", str(source), "--to", "parquet", str(out)]) == 0
    assert "1 records" in capsys.readouterr().err
    rows = duckdb.sql(f"SELECT prompt_tokens, {field} FROM '{out}'").fetchall()
    assert rows == [(6, "ok")]
