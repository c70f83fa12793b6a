"""The DuckDB engine of ``kvlens analyze`` against the numpy one: the same report, field by
field, for random record sets (edges, nulls, long model names, per-model cost models in all
three units) read from JSON lines and from Parquet; the goldens through every input form; bad
input; and a memory limit far below the data (it spills, the answer does not change)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlens.analysis import reader
from kvlens.analysis.analyze import analyze
from kvlens.analysis.duckdb import inputs, order_statistics, parquet
from kvlens.analysis.duckdb import summary as summarizer
from kvlens.analysis.duckdb.engine import Engine
from kvlens.analysis.report import Derived, summarize
from kvlens.cli import main
from kvlens.config import Settings, load_settings
from kvlens.errors import InputError
from kvlens.records import MAX_LABEL_BYTES, MAX_SECONDS, MAX_TOKENS
from tests.article import article_records

pytest.importorskip("duckdb")

EDGES = [512, 2048, 8192, 32768]
COSTED = {
    "work": {"a": 1.0, "b": 1.0 / 1024.0, "unit": "work_units"},
    "flops": {"a": 1.6e10, "b": 524288.0, "unit": "flops"},
    "secs": {"a": 3.1e-5, "b": 1.7e-9, "unit": "seconds"},
}


def write_jsonl(path: Path, records: list[dict[str, Any]], extra: bytes = b"") -> Path:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records) + extra)
    return path


def config_file(path: Path, **values: Any) -> Settings:
    path.write_text(yaml.safe_dump({"prompt_length_edges": EDGES, "cost_models": COSTED, **values}))
    return load_settings(path)


def without_paths(report: dict[str, Any]) -> dict[str, Any]:
    """The report less what names the input files (the forms differ in nothing else)."""
    out = dict(report)
    out["input"] = {k: v for k, v in report["input"].items() if k not in ("files", "formats")}
    return out


tokens = st.one_of(
    st.sampled_from([0, 1, 511, 512, 513, 2047, 2048, 8191, 8192, 32767, 32768, MAX_TOKENS]),
    st.integers(0, 40_000),
)
seconds = st.one_of(
    st.none(),
    st.sampled_from([0.0, 1e-9, 0.1, 0.3, MAX_SECONDS]),
    st.floats(0, 30, allow_nan=False, allow_infinity=False),
)
models = st.one_of(
    st.none(),
    st.sampled_from(sorted(COSTED)),
    st.sampled_from(["m" * MAX_LABEL_BYTES, "é" * (MAX_LABEL_BYTES // 2)]),  # the longest labels
    st.text(alphabet="abcxyz-", min_size=1, max_size=12),  # many names: the label cap overflows
)


@st.composite
def record(draw: st.DrawFn) -> dict[str, Any]:
    n = draw(tokens)
    h = draw(st.one_of(st.just(0), st.just(n), st.integers(0, n)))
    out: dict[str, Any] = {"prompt_tokens": n, "cached_tokens": h}
    for name, value in (
        ("model", draw(models)),
        ("ttft_seconds", draw(seconds)),
        ("queue_seconds", draw(seconds)),
        ("prefill_seconds", draw(seconds)),
        ("arrival_time", draw(st.one_of(st.none(), st.floats(1.7e9, 1.8e9)))),  # the report's time range
    ):
        if value is not None:
            out[name] = value
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(record(), max_size=120))
def test_duckdb_and_numpy_reports_are_identical(
    tmp_path_factory: pytest.TempPathFactory, records: list[Any]
) -> None:
    folder = tmp_path_factory.mktemp("parity")
    chosen = config_file(folder / "settings.yaml")
    path = write_jsonl(folder / "r.jsonl", records, extra=b"{not json\n")
    expected, _ = analyze([str(path)], chosen)
    got, _ = analyze([str(path)], chosen, engine="duckdb")
    assert got == expected
    parquet = folder / "r.parquet"
    inputs.convert([str(path)], parquet)
    from_parquet, _ = analyze([str(parquet)], chosen, engine="duckdb")
    expected["input"]["skipped"], expected["input"]["skipped_total"] = {}, 0
    expected["input"]["skipped_examples"], expected["input"]["lines"] = [], len(records)
    assert without_paths(from_parquet) == without_paths(expected)


def test_goldens_through_every_input_form(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    records = article_records()
    plain = write_jsonl(tmp_path / "a.jsonl", records)
    gz = tmp_path / "a.jsonl.gz"
    gz.write_bytes(gzip.compress(plain.read_bytes()))
    parquet = tmp_path / "a.parquet"
    assert main(["convert", str(plain), "--to", "parquet", str(parquet)]) == 0
    hive = tmp_path / "hive"
    for day, part in (("2026-11-30", records[:40]), ("2026-12-01", records[40:])):
        (hive / f"day={day}" / "model=m").mkdir(parents=True)
        inputs.convert(
            [str(write_jsonl(tmp_path / f"{day}.jsonl", part))], hive / f"day={day}" / "model=m" / "0.parquet"
        )
    forms = [
        [str(plain)],
        [str(gz)],
        [str(parquet)],
        [str(hive)],
        sorted(str(path) for path in hive.glob("**/*.parquet")),  # as a shell expands a pattern
    ]
    forms.append([str(tmp_path / "2026-11-30.jsonl"), str(hive / "day=2026-12-01" / "model=m" / "0.parquet")])
    reference: dict[str, Any] | None = None
    for form in forms:
        for engine in ("numpy", "duckdb"):
            if engine == "numpy" and any("parquet" in path or "hive" in path for path in form):
                continue
            assert main(["analyze", *form, "--engine", engine, "--json"]) == 0
            report = json.loads(capsys.readouterr().out)
            # every form and engine gives the whole report of the plain file (groups,
            # percentiles, findings), not only the headline numbers
            reference = reference or report
            assert without_paths(report) == without_paths(reference), (form, engine)
            overall = report["overall"]
            # the article's work: C(128) = 136.0625, C(16) = 16.1328125, C(8192) = 40964 (a = 1, b = 1/1024)
            assert (overall["prompt_work_units"], overall["reused_work_units"]) == (
                90 * 136.0625 + 10 * 40964,
                90 * 16.1328125,
            )
            assert (overall["requests"], overall["prompt_tokens"], overall["cached_tokens"]) == (
                100,
                93_440,
                1_440,
            )
            assert f"{100 * overall['request_hit_ratio']:.2f}" == "90.00"
            assert f"{100 * overall['token_reuse_ratio']:.2f}" == "1.54"
            assert f"{100 * overall['compute_saved_ratio']:.3f}" == "0.344"


@pytest.mark.parametrize("in_place", [False, True])
def test_parquet_rows_out_of_bounds_are_counted_like_bad_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, in_place: bool
) -> None:
    """Copied into memory, or scanned in place (the rejected rows' numbers kept in a table and
    left out of every later scan by an anti-join): the same counts, examples and report."""
    if in_place:
        monkeypatch.setattr(parquet, "MATERIALIZE_SHARE", 0.0)
    engine = Engine()
    bad = tmp_path / "bad.parquet"
    engine.connection.execute(
        "COPY (SELECT * FROM (VALUES (10, 4, 0.5), (5, 9, 0.5), (-1, 0, 0.5), (10, 0, 'nan'::DOUBLE), "
        "(20, 2, 1e9), (NULL, 0, 0.1)) t(prompt_tokens, cached_tokens, ttft_seconds)) "
        f"TO '{bad}' (FORMAT parquet)"
    )
    engine.close()
    report, _ = analyze([str(bad)], load_settings(), engine="duckdb")
    assert report["overall"]["requests"] == 1
    (group,) = report["groups"]
    assert group["ttft_seconds"]["p50"] == 0.5  # the one valid row's
    assert report["input"]["lines"] == 6
    assert report["input"]["skipped"] == {
        "cached_exceeds_prompt": 1,
        "missing": 1,
        "not_finite": 1,
        "out_of_range": 2,
    }
    first = report["input"]["skipped_examples"][0]
    assert (first["file"], first["row"], first["field"], first["reason"]) == (
        str(bad),
        1,
        "cached_tokens",
        "cached_exceeds_prompt",
    )


class _Statements:
    """The connection of an engine, recording the statements it runs."""

    def __init__(self, connection: Any) -> None:
        self.connection, self.run = connection, []

    def execute(self, sql: str, *args: Any) -> Any:
        self.run.append(sql)
        return self.connection.execute(sql, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.connection, name)


@pytest.mark.parametrize("bad_rows", [0, 2])
def test_parquet_in_place_is_checked_by_the_sums_scan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bad_rows: int
) -> None:
    """``check_later``: the sums scan checks the rows as it sums, so with every row valid the
    files get no scan of their own to check them (one scan fewer than checking at load); with
    rejected rows, one scan after the sums keeps their numbers (to leave them out and name the
    first). The same summary, counts and examples either way."""
    monkeypatch.setattr(parquet, "MATERIALIZE_SHARE", 0.0)  # in place
    rng = np.random.default_rng(5)
    records = [
        {
            "model": f"m{i % 3}",
            "prompt_tokens": int(n),
            "cached_tokens": int(n) // 4 * (i % 2),
            "ttft_seconds": float(rng.lognormal(-2, 1)),
            "queue_seconds": 0.01,
            "prefill_seconds": 0.05,
        }
        for i, n in enumerate(rng.integers(1, 40_000, 500))
    ]
    source = write_jsonl(tmp_path / "r.jsonl", records)
    path = tmp_path / "r.parquet"
    inputs.convert([str(source)], path)
    if bad_rows:
        engine = Engine()
        scanned = f"read_parquet('{path}', file_row_number = true)"
        engine.connection.execute(  # the file's rows, then copies of its first with -1 tokens
            f"COPY (SELECT * EXCLUDE (k, file_row_number) FROM (SELECT *, 0 AS k FROM {scanned} UNION ALL "
            f"SELECT * REPLACE (-1 AS prompt_tokens), 1 AS k FROM {scanned} "
            f"WHERE file_row_number < {bad_rows}) ORDER BY k, file_row_number) "
            f"TO '{tmp_path / 'with_bad.parquet'}' (FORMAT parquet)"
        )
        engine.close()
        path = tmp_path / "with_bad.parquet"
    chosen = load_settings()
    summaries, scans, reads = [], [], []
    for check_later in (False, True):
        engine = Engine()
        spy = _Statements(engine.connection)
        engine.connection = spy
        loaded = inputs.load(engine, [str(path)], check_later=check_later)
        summaries.append(
            summarizer.summarize(
                engine, "records", chosen.prompt_length_edges, chosen.default_model, loaded.unchecked
            ).summary
        )
        engine.close()
        reads.append((loaded.read.lines, dict(loaded.read.skipped), [e["row"] for e in loaded.read.examples]))
        scans.append(
            [
                "checks" if sql.startswith("CREATE OR REPLACE TEMP TABLE parquet_rejected") else "sums"
                for sql in spy.run
                if sql.startswith("CREATE OR REPLACE TEMP TABLE parquet_rejected")
                or "COUNT(arrival_time)" in sql
            ]
        )
    derived = Derived.of(
        reader.read([str(source)]).batch,
        chosen.prompt_length_edges,
        chosen.cost_model_for,
        chosen.default_model,
    )
    expected = summarize(derived)
    assert summaries[0] == summaries[1]
    assert (summaries[1].cells, summaries[1].latency) == (expected.cells, expected.latency)
    expected_read = (
        500 + bad_rows,
        {"out_of_range": bad_rows} if bad_rows else {},
        list(range(500, 500 + bad_rows)),
    )
    assert reads == [expected_read, expected_read]
    assert scans == [["checks", "sums"], ["sums", "checks"] if bad_rows else ["sums"]]


def test_rows_the_sums_would_overflow_on_are_checked_in_the_sums_scan_and_left_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Parquet in place, checked by the sums scan: a rejected row's values never reach the
    sums (the square of 2^62 tokens, 1e300 seconds in fixed point would overflow 64 bits, a
    NaN or a refused name would make groups): the report is the one of the checked copy."""
    engine = Engine()
    bad = tmp_path / "bad.parquet"
    engine.connection.execute(
        "COPY (SELECT * FROM (VALUES ('a', 10, 4, 0.5, 0.1, 0.2), "
        "('a', 4611686018427387904, 0, 0.5, 0.1, 0.2), ('b', 10, 0, 0.5, 1e300, 0.2), "
        "('c', 10, 0, 'inf'::DOUBLE, 0.1, 0.2), ('x' || chr(7), 10, 0, 0.5, 0.1, 0.2), "
        "('a', 12, 0, 0.7, 0.2, 'nan'::DOUBLE)) "
        "t(model, prompt_tokens, cached_tokens, ttft_seconds, queue_seconds, prefill_seconds)) "
        f"TO '{bad}' (FORMAT parquet)"
    )
    engine.close()
    copied, _ = analyze([str(bad)], load_settings(), engine="duckdb")
    monkeypatch.setattr(parquet, "MATERIALIZE_SHARE", 0.0)  # in place
    in_place, _ = analyze([str(bad)], load_settings(), engine="duckdb")
    assert in_place == copied
    assert in_place["overall"]["requests"] == 1
    assert in_place["input"]["skipped"] == {"out_of_range": 2, "not_finite": 2, "invalid_label": 1}
    assert [e["row"] for e in in_place["input"]["skipped_examples"]] == [1, 2, 3, 4, 5]


def test_a_parquet_schema_mismatch_names_the_file_and_the_column(tmp_path: Path) -> None:
    engine = Engine()
    good, wrong, lacking = tmp_path / "good.parquet", tmp_path / "wrong.parquet", tmp_path / "lacking.parquet"
    engine.connection.execute(
        f"COPY (SELECT 10 AS prompt_tokens, 2 AS cached_tokens) TO '{good}' (FORMAT parquet)"
    )
    engine.connection.execute(
        "COPY (SELECT 10 AS prompt_tokens, 2 AS cached_tokens, '0.5' AS ttft_seconds) "
        f"TO '{wrong}' (FORMAT parquet)"
    )
    engine.connection.execute(f"COPY (SELECT 10 AS prompt_tokens) TO '{lacking}' (FORMAT parquet)")
    engine.close()
    with pytest.raises(InputError) as caught:
        analyze([str(good), str(wrong)], load_settings(), engine="duckdb")
    assert str(caught.value) == (
        f"{wrong}: column 'ttft_seconds' is BYTE_ARRAY (UTF8) in the Parquet file; "
        "a record's ttft_seconds is a number (FLOAT or DOUBLE)"
    )
    with pytest.raises(InputError) as caught:
        analyze([str(lacking)], load_settings(), engine="duckdb")
    assert str(caught.value) == f"{lacking}: the Parquet file has no column 'cached_tokens' (required)"


def test_a_path_that_names_nothing_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no such file"):
        reader.resolve([str(tmp_path / "*.parquet")])
    with pytest.raises(InputError, match="no such file"):
        reader.resolve([str(tmp_path / "absent.jsonl")])
    with pytest.raises(InputError, match="only Parquet is read from a URL"):
        reader.resolve(["s3://bucket/records.jsonl"])
    assert reader.resolve(["s3://bucket/day=*/*.parquet"]) == ["s3://bucket/day=*/*.parquet"]


def test_a_flattering_hit_ratio_over_several_work_units_is_diagnosed(tmp_path: Path) -> None:
    """Found by the parity property: with the models' work in two units the compute-saved ratio
    is None, and the hit-ratio finding formatted it as a percentage (TypeError)."""
    records = [{"prompt_tokens": 0, "cached_tokens": 0}] * 3 + [
        {"prompt_tokens": 511, "cached_tokens": 511}
    ] * 2
    records += [
        {"prompt_tokens": 10_000_000, "cached_tokens": 56283},
        {"prompt_tokens": 10_000_000, "cached_tokens": 301, "model": "flops"},
    ]
    path = write_jsonl(tmp_path / "r.jsonl", records)
    for engine in ("numpy", "duckdb"):
        report, _ = analyze([str(path)], config_file(tmp_path / "s.yaml"), engine=engine)
        (finding,) = [f for f in report["diagnosis"] if f["id"] == "hit_ratio_flatters"]
        assert finding["numbers"]["compute_saved_ratio"] is None
        assert "Modelled compute saved is not one number" in finding["detail"]


def hundred_thousand(path: Path) -> Path:
    rng = np.random.default_rng(20)
    count = 100_000
    n = rng.integers(1, 40_000, count)
    h = (n * rng.random(count)).astype(np.int64) * (rng.random(count) < 0.5)
    seconds = rng.random((count, 3))
    path.write_bytes(
        b"".join(
            orjson.dumps(
                {
                    "model": f"m{i % 5}",
                    "prompt_tokens": int(n[i]),
                    "cached_tokens": int(h[i]),
                    "ttft_seconds": float(seconds[i, 0]),
                    "queue_seconds": float(seconds[i, 1] / 3),
                    "prefill_seconds": float(seconds[i, 2] / 3),
                },
                option=orjson.OPT_APPEND_NEWLINE,
            )
            for i in range(count)
        )
    )
    return path


def test_records_read_as_one_chunk_count_the_slowest_requests_from_that_read(tmp_path: Path) -> None:
    """Under :data:`order_statistics.CHUNK_ROWS` records the order statistics read every value once and
    keep it: the slowest requests per group are counted from those values, not by a scan."""
    path = hundred_thousand(tmp_path / "100k.jsonl")
    chosen = load_settings()
    read = reader.read([str(path)])
    derived = Derived.of(read.batch, chosen.prompt_length_edges, chosen.cost_model_for, chosen.default_model)
    engine = Engine()
    spy = _Statements(engine.connection)
    engine.connection = spy
    inputs.load(engine, [str(path)])
    summary = summarizer.summarize(
        engine, "records", chosen.prompt_length_edges, chosen.default_model
    ).summary
    engine.close()
    assert sum("ttft_seconds >= ?" in sql for sql in spy.run) == 0
    assert sum(summary.slowest.values()) == 5_000  # 5 % of 100k distinct values
    assert summary == summarize(derived)


@pytest.mark.parametrize(
    ("setting", "value", "expected_reads", "slowest_scans"),
    [
        (None, None, [1, 15], 0),  # every rank's bin was kept in the first pass: no second read
        ("STORE_MAX", 10, [1, 15, 15], 1),  # too many values to keep: the second pass reads again
        ("SAMPLE_SIGMAS", 0.0, [1, 15, 15], 1),  # predicted bins too narrow: some ranks fall outside
    ],
)
def test_a_tiny_memory_limit_spills_and_the_answer_does_not_change(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    setting: str | None,
    value: Any,
    expected_reads: list[int],
    slowest_scans: int,
) -> None:
    """The records spill past the limit, and the order statistics read them in 15 chunks of
    row numbers (the chunks cover every record once: the same percentiles), after a sample
    that predicts the bins whose values the first pass keeps. The slowest requests are counted
    from that read when the threshold's bin was kept (:class:`order_statistics.Tail`), else by a scan."""
    if setting is not None:
        monkeypatch.setattr(order_statistics, setting, value)
    path = hundred_thousand(tmp_path / "100k.jsonl")
    chosen = load_settings()
    read = reader.read([str(path)])
    derived = Derived.of(read.batch, chosen.prompt_length_edges, chosen.cost_model_for, chosen.default_model)
    monkeypatch.setattr(order_statistics, "CHUNK_ROWS", 7_000)
    chunks: list[tuple[str, ...]] = []
    split = order_statistics.row_chunks

    def counted(records: int, last_row: int) -> tuple[str, ...]:
        chunks.append(split(records, last_row))
        return chunks[-1]

    monkeypatch.setattr(order_statistics, "row_chunks", counted)
    reads: list[int] = []
    read = order_statistics._read

    def read_counted(*args: Any) -> Any:
        reads.append(len(args[3]) if len(args) > 3 else len(args[1].chunks))
        return read(*args)

    monkeypatch.setattr(order_statistics, "_read", read_counted)
    engine = Engine(memory_limit="8MiB", threads=1)
    spy = _Statements(engine.connection)
    engine.connection = spy
    inputs.load(engine, [str(path)])
    summary = summarizer.summarize(
        engine, "records", chosen.prompt_length_edges, chosen.default_model
    ).summary
    assert engine.spilled() > 0  # the 100k records (about 7.7 MB) did not fit
    engine.close()
    assert sum("ttft_seconds >= ?" in sql for sql in spy.run) == slowest_scans
    assert sum(summary.slowest.values()) == 5_000  # 5 % of 100k distinct values
    assert [len(chunk) for chunk in chunks] == [15]
    assert chunks[0][0] == "row >= 0 AND row < 6667" and chunks[0][-1] == "row >= 93338 AND row < 100005"
    assert reads == expected_reads  # the sample's read, then the passes over the 15 chunks
    assert summary == summarize(derived)


def test_a_memory_limit_too_small_to_work_in_is_a_clear_error(tmp_path: Path) -> None:
    path = hundred_thousand(tmp_path / "100k.jsonl")
    with pytest.raises(InputError) as caught:
        analyze([str(path)], load_settings(), engine="duckdb", memory_limit="2MiB")
    assert str(caught.value).startswith("DuckDB needed more than the memory limit 2MiB")


def test_sglang_openai_usage_and_gzip_mixed_read_the_same_in_both_engines(tmp_path: Path) -> None:
    from tests.unit.test_formats import SGLANG_LINE

    sglang = write_jsonl(tmp_path / "sglang-request-metrics.log", [SGLANG_LINE] * 4)
    usage = write_jsonl(
        tmp_path / "gateway.jsonl",
        [{"model": "m", "usage": {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 4}}}] * 3,
        extra=b"{broken\n",
    )
    gz = tmp_path / "a.jsonl.gz"
    gz.write_bytes(gzip.compress(b"".join(orjson.dumps(r) + b"\n" for r in article_records())))
    paths = [str(sglang), str(usage), str(gz)]
    expected, _ = analyze(paths, load_settings(), model="qwen")
    got, _ = analyze(paths, load_settings(), model="qwen", engine="duckdb")
    assert got == expected
    assert got["input"]["formats"] == {str(sglang): "sglang", str(usage): "openai-usage", str(gz): "kvlens"}
    assert (got["overall"]["requests"], got["input"]["skipped"]) == (107, {"malformed_json": 1})
    assert got["models"]["qwen"]["cached_tokens"] == 4 * 512


def test_auto_engine_is_duckdb_for_parquet_and_large_input(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvlens.analysis import analyze as module

    small = write_jsonl(tmp_path / "small.jsonl", article_records())
    parquet = tmp_path / "a.parquet"
    inputs.convert([str(small)], parquet)
    assert module.choose_engine("auto", [str(small)]) == "numpy"
    assert module.choose_engine("auto", [str(small), str(parquet)]) == "duckdb"
    assert module.choose_engine("auto", reader.resolve([str(tmp_path)])) == "duckdb"  # a.parquet
    assert module.choose_engine("numpy", [str(parquet)]) == "numpy"
    monkeypatch.setattr(module, "AUTO_DUCKDB_BYTES", small.stat().st_size)
    assert module.choose_engine("auto", [str(small)]) == "duckdb"


def test_convert_refuses_other_targets(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    small = write_jsonl(tmp_path / "small.jsonl", article_records())
    assert main(["convert", str(small), "--to", "csv", str(tmp_path / "out.csv")]) == 2
    assert "--to takes parquet, not 'csv'" in capsys.readouterr().err
    assert not (tmp_path / "out.csv").exists()


def test_a_corrupt_parquet_file_is_a_clear_error_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corrupt = tmp_path / "part-0.parquet"
    corrupt.write_bytes(b"PAR1 this is not a Parquet file")
    assert main(["analyze", str(corrupt), "--json"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("kvlens: DuckDB: ") and str(corrupt) in error


def test_order_statistics_narrowed_over_many_passes_are_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bins sized for 2 values and at most 3 kept: the ranks go through the first pass, then
    passes that keep small windows whole and count larger ones in finer bins, first within
    their first bin (its bounds unknown), then between a finer bin's min and max (skewed
    values, ties, several ranks in one window)."""
    rng = np.random.default_rng(11)
    count = 3000
    skewed = np.round(rng.lognormal(-3, 2, size=(count, 3)), 4)  # ties from the rounding
    records = [
        {
            "model": f"m{i % 3}",
            "prompt_tokens": int(n),
            "cached_tokens": int(n) // 2 * (i % 2),
            "ttft_seconds": float(skewed[i, 0] + skewed[i, 1] + skewed[i, 2]),
            "queue_seconds": float(skewed[i, 1]),
            "prefill_seconds": float(skewed[i, 2]),
        }
        for i, n in enumerate(rng.integers(0, 40_000, count))
    ]
    path = write_jsonl(tmp_path / "skewed.jsonl", records)
    monkeypatch.setattr(order_statistics, "BIN_VALUES", 2)
    monkeypatch.setattr(order_statistics, "FETCH_MAX", 3)
    monkeypatch.setattr(order_statistics, "CHUNK_ROWS", 1000)  # one chunk would be ranked whole, in memory
    passes: list[str] = []
    original = order_statistics._next_pass

    def counted(*args: Any) -> None:
        targets = args[1]
        kept = sum(t.count <= 3 for t in targets)
        bounded = sum(t.count > 3 and np.isfinite(t.low) for t in targets)
        passes.append(f"{len(targets)} open: {kept} kept, {bounded} counted between bounds")
        original(*args)

    monkeypatch.setattr(order_statistics, "_next_pass", counted)
    chosen = load_settings()
    engine = Engine()
    inputs.load(engine, [str(path)])
    summary = summarizer.summarize(
        engine, "records", chosen.prompt_length_edges, chosen.default_model
    ).summary
    engine.close()
    batch = reader.read([str(path)]).batch
    derived = Derived.of(batch, chosen.prompt_length_edges, chosen.cost_model_for, chosen.default_model)
    assert summary == summarize(derived)
    assert passes == [
        "190 open: 130 kept, 0 counted between bounds",  # 60 counted within their first bin
        "45 open: 35 kept, 10 counted between bounds",  # 15 were a single value (ties)
        "9 open: 9 kept, 0 counted between bounds",
    ]


def test_parquet_files_of_different_lengths_read_in_chunks_of_row_numbers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A directory of three Parquet files (3,000, 500 and 1,200 rows) scanned in place, the
    order statistics read in chunks of row numbers that span every file at once: the same
    summary as the numpy engine's of the same records."""
    rng = np.random.default_rng(3)
    folder = tmp_path / "parts"
    folder.mkdir()
    lines = []
    for index, count in enumerate((3000, 500, 1200)):
        records = [
            {
                "model": f"m{i % 4}",
                "prompt_tokens": int(n),
                "cached_tokens": int(n) // 3 * (i % 2),
                "ttft_seconds": float(rng.lognormal(-2, 1)),
                "queue_seconds": float(rng.random() / 10),
                "prefill_seconds": float(rng.random() / 5),
            }
            for i, n in enumerate(rng.integers(1, 40_000, count))
        ]
        source = write_jsonl(tmp_path / f"part-{index}.jsonl", records)
        inputs.convert([str(source)], folder / f"part-{index}.parquet")
        lines.append(source.read_bytes())
    together = tmp_path / "all.jsonl"
    together.write_bytes(b"".join(lines))
    monkeypatch.setattr(parquet, "MATERIALIZE_SHARE", 0.0)  # in place
    monkeypatch.setattr(order_statistics, "CHUNK_ROWS", 400)
    chosen = load_settings()
    engine = Engine()
    inputs.load(engine, [str(folder)])
    summary = summarizer.summarize(
        engine, "records", chosen.prompt_length_edges, chosen.default_model
    ).summary
    engine.close()
    batch = reader.read([str(together)]).batch
    derived = Derived.of(batch, chosen.prompt_length_edges, chosen.cost_model_for, chosen.default_model)
    assert order_statistics.row_chunks(4700, 2999)[:2] == (
        "row >= 0 AND row < 250",
        "row >= 250 AND row < 500",
    )
    assert summary == summarize(derived)


def test_lines_split_across_reads_keep_their_numbers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reads of 37 bytes cut lines (and span a 160-byte one) anywhere: the same records, and the
    skipped lines named by the same numbers, as one read of the whole file."""
    good = [
        orjson.dumps({"prompt_tokens": 100 + i, "cached_tokens": i, "model": "m" * (i * 12)})
        for i in range(11)
    ]
    lines = [good[0], b"", good[1] + b"\r", b"{broken", good[2], b"   ", good[10], good[3], b"[1]", good[4]]
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b"\n".join(lines))  # no newline after the last line
    whole = reader.read([str(path)])
    monkeypatch.setattr(reader, "CHUNK_BYTES", 37)
    cut = reader.read([str(path)])
    assert [e["line"] for e in whole.examples] == [4, 9]
    assert cut.examples == whole.examples
    assert cut.lines == whole.lines == 8
    assert dict(cut.skipped) == dict(whole.skipped) == {"malformed_json": 1, "not_an_object": 1}
    expected = [100, 101, 102, 110, 103, 104]
    assert cut.batch.prompt_tokens.tolist() == whole.batch.prompt_tokens.tolist() == expected


@pytest.mark.parametrize(("batch", "fetches"), [(10**9, 1), (1, 3)])
def test_calibration_points_in_one_fetch_or_in_batches_fit_as_numpy_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, batch: int, fetches: int
) -> None:
    """Every model's points fetched at once, or one model a batch from a table of them: the same
    points in the same order, so the same fits as the numpy engine's to the last bit."""
    rng = np.random.default_rng(5)
    records = []
    for i, n in enumerate(rng.integers(1, 30_000, 600)):
        h = int(n * rng.random()) * (i % 2)
        record = {"model": f"m{i % 3}", "prompt_tokens": int(n), "cached_tokens": h}
        if i % 7:  # some records have no prefill time
            record["prefill_seconds"] = float(1e-3 + 2e-5 * (n - h) + 1e-9 * (n - h) * (n + h) * rng.random())
        records.append(record)
    path = write_jsonl(tmp_path / "r.jsonl", records)
    monkeypatch.setattr(summarizer, "CALIBRATION_BATCH", batch)
    registered = Engine.registered
    calls: list[str] = []

    def counted(engine: Engine, tables: dict[str, Any]) -> Any:
        calls.extend(tables)
        return registered(engine, tables)

    monkeypatch.setattr(Engine, "registered", counted)
    expected, _ = analyze([str(path)], load_settings())
    got, _ = analyze([str(path)], load_settings(), engine="duckdb")
    assert [fit["model"] for fit in got["calibration"]] == ["m0", "m1", "m2"]
    assert got["calibration"] == expected["calibration"]
    # the fetches of the points (plus the table they are picked into, when in batches)
    assert calls.count("rates") == fetches + (fetches > 1)


def test_an_empty_label_in_parquet_is_absent_as_in_json_lines(tmp_path: Path) -> None:
    """docs/analyze.md: an empty string counts as absent. A Parquet file written elsewhere (a warehouse
    export) may hold '' where JSON lines hold "": the same records, the same report."""
    lines = [
        {"model": "", "prompt_tokens": 10, "cached_tokens": 1, "ttft_seconds": 0.5},
        {"model": "a", "prompt_tokens": 20, "cached_tokens": 0, "ttft_seconds": 0.25},
        {"prompt_tokens": 30, "cached_tokens": 3, "ttft_seconds": 0.125},
    ]
    source = write_jsonl(tmp_path / "r.jsonl", lines)
    path = tmp_path / "r.parquet"
    engine = Engine()
    engine.connection.execute(
        "COPY (SELECT model, prompt_tokens, cached_tokens, CAST(ttft AS DOUBLE) AS ttft_seconds FROM "
        "(VALUES ('', 10, 1, 0.5), ('a', 20, 0, 0.25), (NULL, 30, 3, 0.125)) "
        f"t(model, prompt_tokens, cached_tokens, ttft)) TO '{path}' (FORMAT parquet)"
    )
    engine.close()
    want, _ = analyze([str(source)], load_settings(), engine="numpy")
    got, _ = analyze([str(path)], load_settings(), engine="duckdb")
    assert sorted(got["models"]) == sorted(want["models"]) == ["a", "unknown"]
    assert without_paths(got) == without_paths(want)
