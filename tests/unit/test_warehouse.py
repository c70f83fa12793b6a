"""``kvlens analyze --print-sql`` run as printed on two engines (DuckDB, and DataFusion where it
is installed) over the golden records and a random set, the results exported by the engine's
own CSV or JSON writer, then ``kvlens analyze --from-aggregates``: the same report as analyzing
the records directly."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvlens import definitions
from kvlens.analysis import report, warehouse
from kvlens.analysis.duckdb import inputs
from kvlens.analysis.duckdb.engine import Engine
from kvlens.cli import main
from kvlens.config import load_settings
from kvlens.errors import InputError
from tests.article import article_records
from tests.unit.test_columnar import write_jsonl

pytest.importorskip("duckdb")


def statements(script: str) -> list[str]:
    body = "\n".join(line for line in script.splitlines() if not line.startswith("--"))
    return [part.strip() for part in body.split(";") if part.strip()]


def export_duckdb(parquet: Path, script: str, out: Path, kind: str) -> list[Path]:
    """Each result written by DuckDB's COPY (CSV with a header, or JSON lines)."""
    engine = Engine()
    engine.connection.execute(f"CREATE VIEW records AS SELECT * FROM '{parquet}'")
    files = []
    for index, statement in enumerate(statements(script)):
        if statement.startswith("CREATE"):
            engine.connection.execute(statement)
            continue
        files.append(out / f"{index}.{kind}")
        options = "HEADER" if kind == "csv" else "FORMAT json"
        engine.connection.execute(f"COPY ({statement}) TO '{files[-1]}' ({options})")
    engine.close()
    return files


def export_datafusion(parquet: Path, script: str, out: Path, kind: str) -> list[Path]:
    datafusion = pytest.importorskip("datafusion")
    context = datafusion.SessionContext()
    context.register_parquet("records", str(parquet))
    files = []
    for index, statement in enumerate(statements(script)):
        frame = context.sql(statement)
        if statement.startswith("CREATE"):
            frame.collect()
            continue
        files.append(out / f"{index}.{kind}")
        if kind == "csv":
            frame.write_csv(files[-1], with_header=True)
        else:
            frame.write_json(files[-1])
    return files


def random_records(count: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(7)
    out = []
    for i in range(count):
        n = int(rng.integers(0, 40_000))
        record: dict[str, Any] = {"prompt_tokens": n, "cached_tokens": int(n * rng.random()) * (i % 2)}
        if i % 3:
            record["model"] = ["a", "b", "flops"][i % 3]
        for name in ("ttft_seconds", "queue_seconds", "prefill_seconds"):
            if i % 7:
                record[name] = float(rng.random() * 3)
        out.append(record)
    return out


def analyzed(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert main(["analyze", *argv, "--json"]) == 0
    result: dict[str, Any] = json.loads(capsys.readouterr().out)
    return result


def comparable(result: dict[str, Any]) -> dict[str, Any]:
    """The report less the input's files and the calibration from records (the warehouse route
    has no per-request points)."""
    out = {key: value for key, value in result.items() if key not in ("input", "calibration")}
    out["records"] = result["input"]["records"]
    return out


@pytest.mark.parametrize(
    ("export", "kind"),
    [
        (export_duckdb, "csv"),
        (export_duckdb, "json"),
        (export_datafusion, "csv"),
        (export_datafusion, "json"),
    ],
    ids=["duckdb-csv", "duckdb-jsonl", "datafusion-csv", "datafusion-jsonl"],
)
@pytest.mark.parametrize("records", [article_records(), random_records(3000)], ids=["article", "random"])
def test_printed_sql_run_elsewhere_gives_the_direct_report(
    export: Any, kind: str, records: list[dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "settings.yaml"
    config.write_text("cost_models: {flops: {a: 1.6e10, b: 524288.0, unit: flops}}\n")
    assert main(["analyze", "--print-sql", "--config", str(config)]) == 0
    script = capsys.readouterr().out
    assert (
        "(VALUES ('flops', 16000000000.0, 524288.0, 'flops'), ('*', 1.0, 0.0009765625, 'work_units'))"
        in script
    )
    assert not re.search(r"\bduckdb\b|read_parquet|GROUP BY ALL", script)  # nothing engine-specific
    jsonl = write_jsonl(tmp_path / "r.jsonl", records)
    parquet = tmp_path / "r.parquet"
    inputs.convert([str(jsonl)], parquet)
    files = export(parquet, script, tmp_path, kind)

    direct = analyzed(capsys, str(jsonl), "--engine", "numpy", "--config", str(config))
    via = analyzed(capsys, "--from-aggregates", *map(str, files), "--config", str(config))
    assert comparable(via) == comparable(direct)
    assert via["input"]["formats"] == dict.fromkeys(map(str, files), "aggregates")
    assert via["calibration"] == []

    settings = load_settings(config)
    rows = warehouse.read_aggregates(files)
    totals = report.totals_of(warehouse.summary_from(rows).cells, settings.cost_model_for)
    by_unit = {row["unit"]: (float(row["prompt_work"]), float(row["reused_work"])) for _, row in rows["work"]}
    assert set(by_unit) == set(totals.units)
    for index, unit in enumerate(definitions.UNITS):
        if unit in totals.units:
            assert by_unit[unit] == pytest.approx(
                (totals.prompt_work[index], totals.reused_work[index]), rel=1e-12
            )


def test_aggregates_left_out_or_broken_are_clear_errors(tmp_path: Path) -> None:
    jsonl = write_jsonl(tmp_path / "r.jsonl", random_records(50))
    parquet = tmp_path / "r.parquet"
    inputs.convert([str(jsonl)], parquet)
    out = tmp_path / "out"
    out.mkdir()
    cells, _, decomposition, order, slowest, prefill = export_duckdb(
        parquet, warehouse.script(load_settings()), out, "csv"
    )
    with pytest.raises(InputError) as caught:
        warehouse.summary_from(warehouse.read_aggregates([cells, decomposition, order, prefill]))
    assert str(caught.value).startswith("no result rows of the statement `slowest` in ")
    with pytest.raises(InputError) as caught:
        warehouse.read_aggregates([decomposition])
    assert str(caught.value).startswith("no result rows of the statement `cells` in ")
    broken = tmp_path / "broken.csv"
    text = cells.read_text()
    line = next(number for number, row in enumerate(text.splitlines(), start=1) if ",true," in row)
    broken.write_text(text.replace(",true,", ",maybe,", 1))
    with pytest.raises(InputError) as caught:
        warehouse.summary_from(warehouse.read_aggregates([broken, decomposition, order, slowest, prefill]))
    assert str(caught.value) == f"{broken} line {line}: column 'hit' is 'maybe', not true or false"
    other = tmp_path / "other.jsonl"
    other.write_text('{"query": "cels", "model": "a"}\n')
    with pytest.raises(InputError) as caught:
        warehouse.read_aggregates([other])
    assert str(caught.value).startswith(f"{other} line 1: the `query` column is 'cels', not one of cells, ")
