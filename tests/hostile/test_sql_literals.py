"""Names from the settings in the SQL ``kvlens analyze --print-sql`` prints, for engines kvlens
does not know. Quotes were doubled ANSI-style only: Spark SQL, Hive, BigQuery and MySQL read a
backslash as an escape, so a model named ``x\\' OR 1=1 --`` ended its literal early there and
the rest ran as SQL; Spark SQL and Hive replace ``${...}`` inside literals. Such a name is now
refused naming it; every other printable name is written so that each dialect reads it alike,
and the script run in DuckDB and DataFusion (the engines here; pyspark is not installed) gives
the direct report for records of those names."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from kvlens import sqltext
from kvlens.analysis.duckdb import inputs
from kvlens.cli import main
from tests.unit.test_columnar import write_jsonl
from tests.unit.test_warehouse import analyzed, comparable, export_datafusion, export_duckdb

pytest.importorskip("duckdb")

# name -> the first character no dialect-neutral literal can hold, and why
REFUSED = {
    "x\\' OR 1=1 --": "\\",
    "it's": "'",
    "C:\\models\\llama": "\\",
    "${system:user.name}": "$",
    "a;b": ";",
}
# printable names every dialect reads alike in a '...' literal
ODD = ['say "hi"', "a`b", "x--y", "/* c */", "?:name", "{fn now()}", "Llama-3.1-8B/instruct@v2+q", "通义千问"]


def literals(script: str, backslash_escapes: bool) -> list[str]:
    """The string literals of ``script`` as a dialect's lexer reads them: ANSI (a quote doubled)
    or, with ``backslash_escapes``, Spark SQL's, Hive's, BigQuery's and MySQL's (a backslash
    escapes the next character too). ``--`` comments are skipped outside literals."""
    out, i = [], 0
    while i < len(script):
        if script.startswith("--", i):
            i = script.find("\n", i) % (len(script) + 1) if "\n" in script[i:] else len(script)
            continue
        if script[i] != "'":
            i += 1
            continue
        i += 1
        text = []
        while True:
            char = script[i]
            if backslash_escapes and char == "\\":
                text.append(script[i + 1])
                i += 2
            elif char == "'" and script.startswith("''", i):
                text.append("'")
                i += 2
            elif char == "'":
                i += 1
                break
            else:
                text.append(char)
                i += 1
        out.append("".join(text))
    return out


@pytest.mark.parametrize("place", ["cost_models", "default_model"])
@pytest.mark.parametrize("name", list(REFUSED))
def test_a_name_no_dialect_reads_alike_is_refused(
    place: str, name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "settings.yaml"
    setting = {"cost_models": {name: {"a": 1.0, "b": 0.5}}} if place == "cost_models" else {place: name}
    config.write_text(json.dumps(setting))  # JSON is YAML
    assert main(["analyze", "--print-sql", "--config", str(config)]) == 2
    captured = capsys.readouterr()
    what = "default_model" if place == "default_model" else "model name (cost_models, model_shapes)"
    char = REFUSED[name]
    assert captured.out == ""
    assert captured.err == (
        f"kvlens: {what} {name!r} holds {char!r}, which the printed SQL cannot hold the same way in "
        f"every engine ({sqltext.UNPORTABLE[char]}): --print-sql takes names of {sqltext.PORTABLE}\n"
    )


@pytest.mark.parametrize("export", [export_duckdb, export_datafusion], ids=["duckdb", "datafusion"])
def test_odd_names_read_alike_in_every_dialect_and_give_the_direct_report(
    export: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "settings.yaml"
    costs = {name: {"a": 1.0 + index, "b": 0.25} for index, name in enumerate(ODD[1:])}
    config.write_text(json.dumps({"default_model": ODD[0], "cost_models": costs}))
    assert main(["analyze", "--print-sql", "--config", str(config)]) == 0
    script = capsys.readouterr().out
    assert literals(script, backslash_escapes=True) == literals(script, backslash_escapes=False)
    assert "${" not in script
    assert set(ODD) <= set(literals(script, backslash_escapes=False))
    records = [
        {
            "prompt_tokens": 100 + i,
            "cached_tokens": i % 3 * 10,
            "queue_seconds": 0.01,
            "prefill_seconds": 0.05,
            "ttft_seconds": 0.1 + i / 100,
        }
        | ({"model": ODD[i % len(ODD)]} if i % len(ODD) else {})  # the default model's rows: no model
        for i in range(64)
    ]
    jsonl = write_jsonl(tmp_path / "r.jsonl", records)
    parquet = tmp_path / "r.parquet"
    inputs.convert([str(jsonl)], parquet)
    files = export(parquet, script, tmp_path, "json")
    direct = analyzed(capsys, str(jsonl), "--engine", "numpy", "--config", str(config))
    via = analyzed(capsys, "--from-aggregates", *map(str, files), "--config", str(config))
    assert comparable(via) == comparable(direct)
    assert set(direct["models"]) == set(ODD)


def test_numbers_are_finite_literals() -> None:
    assert [sqltext.number(value) for value in (3, 1e-05, 0.5, 16000000000.0)] == [
        "3",
        "1e-05",
        "0.5",
        "16000000000.0",
    ]
    for value in (math.nan, math.inf, -math.inf):
        with pytest.raises(ValueError, match="a SQL number must be finite"):
            sqltext.number(value)


@pytest.mark.parametrize("name", list(REFUSED))
def test_the_sql_duckdb_runs_reads_any_name_as_itself(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # DuckDB's dialect is known: the engine writes any text exactly (a quote doubled), and a
    # record without a model is counted under the default model, named as numpy names it
    config = tmp_path / "settings.yaml"
    config.write_text(json.dumps({"default_model": name, "cost_models": {name: {"a": 2.0, "b": 0.0}}}))
    jsonl = write_jsonl(tmp_path / "r.jsonl", [{"prompt_tokens": 10, "cached_tokens": 5}])
    reports = [
        analyzed(capsys, str(jsonl), "--engine", engine, "--config", str(config))
        for engine in ("numpy", "duckdb")
    ]
    assert reports[0]["models"] == reports[1]["models"]
    assert list(reports[1]["models"]) == [name]
    assert reports[1]["models"][name]["work"]["work_units"]["prompt"] == 20.0
