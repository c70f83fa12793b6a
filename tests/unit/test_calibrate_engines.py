"""``kvlens analyze --calibrate`` through the DuckDB engine: the points come from
:func:`kvlens.analysis.duckdb.summary.calibration_inputs` (one model at a time, in input order), so
the written cost models are the numpy engine's to the last digit, from JSON lines and from
Parquet; past ``CALIBRATION_MAX_POINTS`` records of a model an even sample of them is fitted."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvlens.analysis import analyze as analyze_module
from kvlens.analysis.duckdb import inputs
from kvlens.analysis.duckdb import summary as summarizer
from kvlens.analysis.duckdb.engine import Engine
from kvlens.cli import main
from kvlens.config import load_settings
from tests.unit.test_columnar import write_jsonl

pytest.importorskip("duckdb")


def timed(
    model: str, count: int, a: float, b: float, c: float, noise: float, seed: int
) -> list[dict[str, object]]:
    rng = np.random.default_rng(seed)
    n = rng.integers(64, 16_000, count)
    h = (n * rng.random(count) * (rng.random(count) < 0.5)).astype(np.int64)
    m = n - h
    seconds = (a * m + b * (m * h + m * (m + 1) / 2) + c) * (1 + noise * rng.standard_normal(count))
    return [
        {"model": model, "prompt_tokens": int(x), "cached_tokens": int(y), "prefill_seconds": float(p)}
        for x, y, p in zip(n, h, seconds, strict=True)
    ]


def test_calibrate_writes_the_same_cost_models_from_both_engines(tmp_path: Path) -> None:
    records = timed("llama", 300, 2.0e-5, 3.0e-9, 0.005, 0.01, 1) + timed(
        "qwen", 200, 4.0e-5, 1.0e-9, 0.0, 0.02, 2
    )
    records = [records[i] for i in np.random.default_rng(3).permutation(len(records))]  # models interleaved
    jsonl = write_jsonl(tmp_path / "r.jsonl", records)
    parquet = tmp_path / "r.parquet"
    inputs.convert([str(jsonl)], parquet)
    written = []
    for engine, path in (("numpy", jsonl), ("duckdb", jsonl), ("duckdb", parquet)):
        out = tmp_path / f"{engine}-{path.suffix}.yaml"
        assert main(["analyze", str(path), "--engine", engine, "--calibrate", str(out), "--json"]) == 0
        written.append(out.read_text())
    assert written[0] == written[1] == written[2]
    llama = load_settings(tmp_path / "numpy-.jsonl.yaml").cost_model_for("llama")
    assert llama.unit == "seconds" and llama.b / llama.a == pytest.approx(3.0e-9 / 2.0e-5, rel=0.1)


def test_past_the_bound_an_even_sample_of_a_models_records_is_fitted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b, c = 2.0e-5, 3.0e-9, 0.005
    path = write_jsonl(tmp_path / "r.jsonl", timed("llama", 1000, a, b, c, 0.0, 4))  # exact times
    monkeypatch.setattr(analyze_module, "CALIBRATION_MAX_POINTS", 100)
    settings = load_settings()
    _, (whole,) = analyze_module.analyze([str(path)], settings)
    _, (sampled,) = analyze_module.analyze([str(path)], settings, engine="duckdb")
    engine = Engine()
    inputs.load(engine, [str(path)])
    summarized = summarizer.summarize(engine, "records", settings.prompt_length_edges, settings.default_model)
    ((name, n, _, _),) = list(summarizer.calibration_inputs(engine, summarized.prefill_counts, 100))
    engine.close()
    assert (whole.requests, name, sampled.requests) == (1000, "llama", n.size)
    assert 50 <= sampled.requests <= 150  # about the bound: hash(src, row) % 1000 < 100
    for fit in (whole, sampled):
        assert (fit.a, fit.b, fit.c) == pytest.approx((a, b, c), rel=1e-6)
