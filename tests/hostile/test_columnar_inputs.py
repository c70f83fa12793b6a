"""Crafted inputs for the DuckDB engine (``analyze --engine duckdb``, ``compare --engine duckdb``):
Parquet files whose columns only look like the record's, file names DuckDB would read as globs,
a directory loop, a full spill directory. Each is refused by name or read exactly, never as
other numbers."""

from __future__ import annotations

import json
import os
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from kvlens.analysis import compare, reader
from kvlens.analysis.analyze import analyze
from kvlens.analysis.duckdb import compare as duckdb_compare
from kvlens.analysis.duckdb import inputs, parquet
from kvlens.analysis.duckdb.engine import Engine, engine_errors
from kvlens.config import load_settings
from kvlens.errors import InputError

pytest.importorskip("duckdb")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def _write(path: Path, columns: dict[str, Any]) -> Path:
    """A Parquet file of ``columns`` (name: pyarrow array), names kept as given (twins too);
    decimals stored as integers, as DuckDB and Spark store small ones."""
    table = pa.Table.from_arrays(list(columns.values()), names=list(columns))
    pq.write_table(table, path, store_decimal_as_integer=True)
    return path


def _tokens(*values: int) -> Any:
    return pa.array(values, pa.int64())


def _refusal(paths: list[Path]) -> str:
    with pytest.raises(InputError) as caught:
        analyze([str(path) for path in paths], load_settings(), engine="duckdb")
    return str(caught.value)


def test_a_decimal_count_is_refused_not_truncated(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "decimal.parquet",
        {"prompt_tokens": pa.array([Decimal("1.5")], pa.decimal128(10, 2)), "cached_tokens": _tokens(1)},
    )
    assert _refusal([path]) == (
        f"{path}: column 'prompt_tokens' is INT64 (DECIMAL) in the Parquet file; "
        "a record's prompt_tokens is an integer (INT32 or INT64)"
    )


def test_a_nested_column_with_a_record_field_inside_is_not_taken_for_it(tmp_path: Path) -> None:
    # the top-level prompt_tokens is DOUBLE; a struct's child of the same name is INT64
    nested = pa.array([{"prompt_tokens": 5}], pa.struct([("prompt_tokens", pa.int64())]))
    path = _write(
        tmp_path / "nested.parquet",
        {"prompt_tokens": pa.array([100.7]), "cached_tokens": _tokens(1), "s": nested},
    )
    assert _refusal([path]) == (
        f"{path}: column 'prompt_tokens' is DOUBLE in the Parquet file; "
        "a record's prompt_tokens is an integer (INT32 or INT64)"
    )
    listed = _write(
        tmp_path / "list.parquet",
        {"prompt_tokens": pa.array([[100]], pa.list_(pa.int64())), "cached_tokens": _tokens(1)},
    )
    assert _refusal([listed]) == (
        f"{listed}: column 'prompt_tokens' is a nested column (LIST) in the Parquet file; "
        "a record's prompt_tokens is an integer (INT32 or INT64)"
    )


def test_columns_named_alike_but_for_case_are_refused(tmp_path: Path) -> None:
    # DuckDB binds names without case: it read Prompt_Tokens (100.9) for prompt_tokens (5)
    twins = _write(
        tmp_path / "twins.parquet",
        {"Prompt_Tokens": pa.array([100.9]), "cached_tokens": _tokens(1), "prompt_tokens": _tokens(5)},
    )
    assert _refusal([twins]) == (
        f"{twins}: columns 'Prompt_Tokens' and 'prompt_tokens' both name the record's prompt_tokens "
        "(names are read without case)"
    )
    same = _write(
        tmp_path / "same.parquet",
        {"prompt_tokens": _tokens(100), "cached_tokens": _tokens(1), "prompt_tokens ": _tokens(5)},
    )
    # a name that differs by a space is another column: read as it is
    report, _ = analyze([str(same)], load_settings(), engine="duckdb")
    assert report["overall"]["prompt_tokens"] == 100


def test_a_column_in_another_case_is_checked_as_the_field_it_is_read_as(tmp_path: Path) -> None:
    # alone, TTFT_SECONDS looked absent; beside a file with ttft_seconds, DuckDB read its
    # integers as seconds (p50 4.25 of 1.5 and 7)
    good = _write(
        tmp_path / "a.parquet",
        {"prompt_tokens": _tokens(100), "cached_tokens": _tokens(1), "ttft_seconds": pa.array([1.5])},
    )
    shouting = _write(
        tmp_path / "b.parquet",
        {
            "prompt_tokens": _tokens(100),
            "cached_tokens": _tokens(1),
            "TTFT_SECONDS": pa.array([7], pa.int32()),
        },
    )
    assert _refusal([good, shouting]) == (
        f"{shouting}: column 'TTFT_SECONDS' is INT32 in the Parquet file; "
        "a record's ttft_seconds is a number (FLOAT or DOUBLE)"
    )


def test_bytes_and_timestamps_are_refused_by_name(tmp_path: Path) -> None:
    blob = _write(
        tmp_path / "blob.parquet",
        {"prompt_tokens": _tokens(100), "cached_tokens": _tokens(1), "model": pa.array([b"m"], pa.binary())},
    )
    assert _refusal([blob]) == (
        f"{blob}: column 'model' is BYTE_ARRAY in the Parquet file; "
        "a record's model is text (UTF-8 BYTE_ARRAY)"
    )
    stamped = _write(
        tmp_path / "ts.parquet",
        {"prompt_tokens": _tokens(100), "cached_tokens": pa.array([0], pa.timestamp("us"))},
    )
    assert _refusal([stamped]) == (
        f"{stamped}: column 'cached_tokens' is INT64 (TIMESTAMP_MICROS) in the Parquet file; "
        "a record's cached_tokens is an integer (INT32 or INT64)"
    )


def test_a_label_with_control_characters_is_rejected_like_a_json_line(tmp_path: Path) -> None:
    models = ["a\x1b[2Jb", "line\nbreak", "zero\u200bwidth", "café", "ok"]
    path = _write(
        tmp_path / "labels.parquet",
        {
            "prompt_tokens": _tokens(*[100] * len(models)),
            "cached_tokens": _tokens(*[1] * len(models)),
            "model": pa.array(models),
        },
    )
    lines = tmp_path / "labels.jsonl"
    lines.write_text(
        "".join(json.dumps({"prompt_tokens": 100, "cached_tokens": 1, "model": m}) + "\n" for m in models)
    )
    from_parquet, _ = analyze([str(path)], load_settings(), engine="duckdb")
    from_lines, _ = analyze([str(lines)], load_settings(), engine="numpy")
    assert from_parquet["input"]["skipped"] == from_lines["input"]["skipped"] == {"invalid_label": 3}
    assert sorted(from_parquet["models"]) == ["café", "ok"]


@pytest.mark.parametrize("checked_in_python", [0, 300_000], ids=["pattern", "python"])
def test_every_character_python_calls_printable_and_no_other_is_a_label(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, checked_in_python: int
) -> None:
    # the Parquet rule and records.valid_label agree on each code point (the engines' Unicode
    # tables differ in version: DuckDB's regular expressions know characters Python does not),
    # whether the distinct labels are few enough to check in Python or matched row by row
    monkeypatch.setattr(parquet, "MAX_LABELS_CHECKED", checked_in_python)
    points = [p for p in range(0x30000) if not 0xD800 <= p <= 0xDFFF]
    path = _write(
        tmp_path / "chars.parquet",
        {
            "prompt_tokens": _tokens(*range(len(points))),
            "cached_tokens": _tokens(*[0] * len(points)),
            "model": pa.array(["x" + chr(p) for p in points]),
        },
    )
    engine = Engine()
    try:
        inputs.load(engine, [str(path)])
        kept = {int(n) for (n,) in engine.connection.execute("SELECT prompt_tokens FROM records").fetchall()}
    finally:
        engine.close()
    assert kept == {i for i, p in enumerate(points) if chr(p).isprintable()}


def test_a_parquet_file_named_like_a_glob_is_read_alone(tmp_path: Path) -> None:
    # DuckDB read `x*.parquet` as a pattern: x1.parquet came in twice
    for name in ("x*.parquet", "x1.parquet", "y[1].parquet", "y1.parquet", "z?.parquet", "zz.parquet"):
        _write(tmp_path / name, {"prompt_tokens": _tokens(100), "cached_tokens": _tokens(1)})
    report, _ = analyze([str(tmp_path)], load_settings(), engine="duckdb")
    assert report["overall"]["requests"] == 6
    assert report["input"]["lines"] == 6
    # named, each is itself (tests/hostile/test_input_names.py: alike in every engine)
    for name in ("x*.parquet", "y[1].parquet", "z?.parquet"):
        alone, _ = analyze([str(tmp_path / name)], load_settings(), engine="duckdb")
        assert alone["overall"]["requests"] == 1


def test_a_symlink_loop_in_a_directory_reads_each_file_once(tmp_path: Path) -> None:
    # a pattern's `**` followed loop/up -> .. about 40 times deep: one record counted 81 times
    folder = tmp_path / "loop" / "sub"
    folder.mkdir(parents=True)
    (folder / "r.jsonl").write_text('{"prompt_tokens": 100, "cached_tokens": 50}\n')
    (folder / "up").symlink_to("..")
    (folder / "also").symlink_to("..")  # two loops: 2^40 paths if each were followed
    (folder / "alias.jsonl").symlink_to("r.jsonl")
    given = str(tmp_path / "loop")
    (found,) = reader.resolve([given])  # the first name in order: alias.jsonl
    assert os.path.realpath(found) == str(folder / "r.jsonl")
    for engine in ("numpy", "duckdb"):
        report, _ = analyze([given], load_settings(), engine=engine)
        assert report["overall"]["requests"] == 1


def test_a_file_named_twice_is_read_once(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    path.write_text('{"prompt_tokens": 100, "cached_tokens": 50}\n')
    (tmp_path / "link.jsonl").symlink_to(path)
    assert reader.resolve([str(path), str(tmp_path / "link.jsonl"), str(tmp_path)]) == [str(path)]
    for engine in ("numpy", "duckdb"):  # the numpy engine reads named files only: the same rule
        report, _ = analyze(
            [str(path), str(tmp_path / "link.jsonl"), str(path)], load_settings(), engine=engine
        )
        assert report["overall"]["requests"] == 1


def test_a_full_spill_directory_is_named_not_taken_for_too_little_memory(tmp_path: Path) -> None:
    # DuckDB's cap on its temporary files is the free space of their disk: a cap reached is a
    # full disk, which raising the memory limit is not the first cure of
    engine = Engine(memory_limit="20MB", temp_directory=str(tmp_path))
    try:
        engine.connection.execute("SET max_temp_directory_size = '256KiB'")
        with pytest.raises(InputError) as caught, engine_errors(engine.memory_limit, tmp_path):
            engine.connection.execute(
                "CREATE TABLE spilled AS SELECT range AS i, random() AS v FROM range(3000000) ORDER BY v"
            )
    finally:
        engine.close()
    assert str(caught.value) == (
        f"DuckDB's temporary directory {tmp_path} is full (it spills there past the memory limit "
        "20MB): free space there, set TMPDIR to a larger disk, or raise --memory-limit"
    )


def test_a_url_glob_of_parquet_files_is_read_file_by_file(tmp_path: Path) -> None:
    # DuckDB names the objects of a URL glob (file:// here, s3:// alike) by their own names:
    # the schema check looked the URL up among them, found nothing, and refused every URL
    first = _write(tmp_path / "u1.parquet", {"prompt_tokens": _tokens(10, 5), "cached_tokens": _tokens(4, 9)})
    _write(tmp_path / "u2.parquet", {"prompt_tokens": _tokens(10), "cached_tokens": _tokens(4)})
    report, _ = analyze([f"file://{tmp_path}/u*.parquet"], load_settings(), engine="duckdb")
    read = report["input"]
    assert (read["records"], read["lines"], read["skipped"]) == (2, 3, {"cached_exceeds_prompt": 1})
    example = read["skipped_examples"][0]
    assert (example["file"], example["row"], example["field"]) == (str(first), 1, "cached_tokens")
    single, _ = analyze([f"file://{first}"], load_settings(), engine="duckdb")
    assert single["input"]["records"] == 1
    with pytest.raises(InputError) as caught:
        analyze([f"file://{tmp_path}/none*.parquet"], load_settings(), engine="duckdb")
    assert str(caught.value) == f"file://{tmp_path}/none*.parquet: the URL names no Parquet object"


def test_arm_names_that_look_like_sql_select_their_own_records(tmp_path: Path) -> None:
    # an arm's name goes to DuckDB as a bound parameter: quotes, $name, ? and comments are text
    names = ["base", "x' OR 'a'<>'b", 'q"; DROP TABLE records; --', "$name", "?"]
    path = tmp_path / "arms.jsonl"
    with path.open("w") as out:
        for i in range(40):
            for k, name in enumerate(names):
                record = {"request_id": f"r{i}", "prompt_tokens": 100 + i, "cached_tokens": (i * k) % 100}
                out.write(json.dumps({**record, "ttft_seconds": 0.1 * (k + 1) + i / 100, "arm": name}) + "\n")
        other = {"request_id": "other", "prompt_tokens": 5, "cached_tokens": 0, "arm": "z"}
        out.write(json.dumps(other) + "\n")
    specs = [(name, str(path)) for name in names]
    settings = load_settings()
    in_duckdb = duckdb_compare.compare_files(specs, settings)
    in_numpy = compare.compare([compare.load_arm(name, str(path), settings) for name, _ in specs])
    assert in_duckdb == in_numpy
    assert (in_duckdb["arms"], in_duckdb["requests"]) == (names, 40)


# (label, valid): printable UTF-8 of at most 128 bytes, as a JSON line's
LABELS = [
    ("ok", True),
    ("café", True),
    ("日本語", True),
    ("\U0001f600", True),
    ("x" * 128, True),
    ("é" * 64, True),
    ("", True),  # no label
    ("x" * 129, False),
    ("é" * 65, False),
    ("tab\there", False),
    ("nul\x00", False),
    ("del\x7f", False),
    ("zero\u200bwidth", False),
    ("a\x1b[2Jb", False),
]


@pytest.mark.parametrize("checked_in_python", [0, 1000], ids=["pattern", "python"])
def test_each_label_column_is_checked_as_a_json_line_is_in_each_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, checked_in_python: int
) -> None:
    """model, replica and tenant each take every label once; a row is kept when its three are
    valid, else counted under the first invalid field. A second load of the engine checks its
    rows as the first did (the invalid labels of both in one table)."""
    monkeypatch.setattr(parquet, "MAX_LABELS_CHECKED", checked_in_python)
    count = len(LABELS)
    rows = [[LABELS[(i + shift) % count] for shift in (0, 3, 5)] for i in range(count)]
    path = _write(
        tmp_path / "labels.parquet",
        {
            "prompt_tokens": _tokens(*range(count)),
            "cached_tokens": _tokens(*[0] * count),
            **{
                name: pa.array([row[column][0] for row in rows])
                for column, name in enumerate(("model", "replica", "tenant"))
            },
        },
    )
    kept = {i for i, row in enumerate(rows) if all(valid for _, valid in row)}
    first_invalid = [
        ("model", "replica", "tenant")[[valid for _, valid in row].index(False)]
        for i, row in enumerate(rows)
        if i not in kept
    ]
    assert (len(kept), set(first_invalid)) == (2, {"model", "replica", "tenant"})  # rows of each kind
    engine = Engine()
    try:
        for _ in range(2):
            loaded = inputs.load(engine, [str(path)], columns=inputs.SCALAR_COLUMNS)
            prompts = engine.connection.execute("SELECT prompt_tokens FROM records").fetchall()
            assert {int(n) for (n,) in prompts} == kept
            assert loaded.read.skipped == {"invalid_label": 12}
            assert [example["field"] for example in loaded.read.examples] == first_invalid[
                : len(loaded.read.examples)
            ]
    finally:
        engine.close()
