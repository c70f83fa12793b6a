"""``kvlens analyze --print-sql`` run as printed on two engines (DuckDB, and DataFusion where it
is installed) over the golden records and a random set: the cells, the decomposition and the
order statistics it returns give the numpy path's summary exactly."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvlens import definitions
from kvlens.analysis import columnar, reader, report
from kvlens.analysis.report import Cell, Derived
from kvlens.cli import main
from kvlens.config import load_settings
from tests.article import article_records
from tests.unit.test_columnar import write_jsonl

pytest.importorskip("duckdb")


def statements(script: str) -> list[str]:
    body = "\n".join(line for line in script.splitlines() if not line.startswith("--"))
    return [part.strip() for part in body.split(";") if part.strip()]


def run_duckdb(parquet: Path, script: str) -> list[list[tuple[Any, ...]]]:
    engine = columnar.Engine()
    engine.connection.execute(f"CREATE VIEW records AS SELECT * FROM '{parquet}'")
    out = [engine.connection.execute(statement).fetchall() for statement in statements(script)]
    engine.close()
    return out


def run_datafusion(parquet: Path, script: str) -> list[list[tuple[Any, ...]]]:
    datafusion = pytest.importorskip("datafusion")
    context = datafusion.SessionContext()
    context.register_parquet("records", str(parquet))
    out = []
    for statement in statements(script):
        table = context.sql(statement).to_pylist()
        out.append([tuple(row.values()) for row in table])
    return out


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


@pytest.mark.parametrize("run", [run_duckdb, run_datafusion], ids=["duckdb", "datafusion"])
@pytest.mark.parametrize("records", [article_records(), random_records(3000)], ids=["article", "random"])
def test_printed_sql_gives_the_numpy_summary(
    run: Any, records: list[dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "settings.yaml"
    config.write_text("cost_models: {flops: {a: 1.6e10, b: 524288.0, unit: flops}}\n")
    assert main(["analyze", "--print-sql", "--config", str(config)]) == 0
    script = capsys.readouterr().out
    assert (
        "(VALUES ('flops', 16000000000.0, 524288.0, 'flops'), ('*', 1.0, 0.0009765625, 'work_units'))"
        in script
    )
    jsonl = write_jsonl(tmp_path / "r.jsonl", records)
    parquet = tmp_path / "r.parquet"
    columnar.convert([str(jsonl)], parquet)
    _, cells, work, decomposition, ranked = run(parquet, script)

    settings = load_settings(config)
    derived = Derived.of(
        reader.read([str(jsonl)]).batch,
        settings.prompt_length_edges,
        settings.cost_model_for,
        settings.default_model,
    )
    expected = report.summarize(derived)
    got_cells = {
        (str(model), int(g), bool(hit)): Cell(
            int(requests), int(n), int(h), (int(n2) + int(n)) // 2, (int(h2) + int(h)) // 2
        )
        for model, g, hit, requests, n, h, n2, h2 in cells
    }
    assert got_cells == expected.cells
    assert [int(v) for v in decomposition[0]] == [
        expected.decomposition.requests,
        expected.decomposition.overlapped,
        expected.decomposition.queue,
        expected.decomposition.prefill,
        expected.decomposition.other,
    ]
    totals = report.totals_of(expected.cells, settings.cost_model_for)
    by_unit = {unit: (prompt, reused) for unit, prompt, reused in work}
    for index, unit in enumerate(definitions.UNITS):
        if unit in totals.units:
            assert by_unit[unit] == pytest.approx(
                (totals.prompt_work[index], totals.reused_work[index]), rel=1e-12
            )
    values: dict[tuple[str, int, bool], dict[int, float]] = {}
    counts: dict[tuple[str, int, bool], int] = {}
    for series, g, hit, c, r, v in ranked:
        values.setdefault((series, int(g), bool(hit)), {})[int(r)] = float(v)
        counts[(series, int(g), bool(hit))] = int(c)
    for group, latency in expected.latency.items():
        for name, want in latency.items():
            part = (name, *group)
            got = report.percentiles_of(
                counts.get(part, 0), lambda ranks, p=part: [values[p][r] for r in ranks]
            )
            assert got == want
    if expected.slowest_threshold is not None:
        part = ("all_ttft", -1, False)
        (threshold,) = definitions.quantiles(
            counts[part], (1 - report.SLOWEST_SHARE,), lambda ranks: [values[part][r] for r in ranks]
        )
        assert threshold == expected.slowest_threshold
    assert not re.search(r"\bduckdb\b|read_parquet|GROUP BY ALL", script)  # nothing engine-specific
