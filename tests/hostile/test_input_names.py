"""Names of inputs to ``kvlens analyze``, ``compare`` and ``convert``, and Parquet without the
``scale`` extra.

One rule for names, whichever engine reads them: a name is the path it spells (the shell has
globbed already; kvlens never does), a directory is walked. The numpy engine read ``[ab].jsonl``
as that file and DuckDB as the pattern's ``a.jsonl`` and ``b.jsonl``, so with ``--engine auto``
(chosen by size) which files were read depended on their size. And a Parquet file given to the
numpy engine (the default without DuckDB) was read as JSON lines: "no record accepted
(skipped, by reason: malformed_json: N)"."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from kvlens.analysis import analyze as analyze_module
from kvlens.cli import main
from kvlens.errors import MissingExtra

pytest.importorskip("duckdb")
pq = pytest.importorskip("pyarrow.parquet")
pa = pytest.importorskip("pyarrow")

# Each name holds one record whose prompt_tokens says which file it came from; the plain names
# beside them are what each, read as a pattern, would match.
HOSTILE = [
    "[ab].jsonl",
    "*.jsonl",
    "?.jsonl",
    "{a,b}.jsonl",
    "with space.jsonl",
    "it's.jsonl",
    'say "x".jsonl',
    "back\\*.jsonl",  # DuckDB's pattern matcher never finds a name with a backslash
    "back\\slash.jsonl",
]
PLAIN = ["a.jsonl", "b.jsonl"]


def _record(tokens: int) -> bytes:
    return json.dumps({"prompt_tokens": tokens, "cached_tokens": 0}).encode() + b"\n"


def _files(folder: Path) -> dict[str, int]:
    tokens = {}
    for index, name in enumerate([*PLAIN, *HOSTILE]):
        tokens[name] = 1000 + index
        (folder / name).write_bytes(_record(tokens[name]))
    return tokens


def _analyze(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any], str]:
    code = main(["analyze", "--json", *argv])
    captured = capsys.readouterr()
    return code, json.loads(captured.out) if code == 0 else {}, captured.err


def _engines(monkeypatch: pytest.MonkeyPatch, engine: str) -> str:
    """``auto`` twice: chosen numpy (the files are small) and chosen duckdb (as if large)."""
    if engine == "auto-large":
        monkeypatch.setattr(analyze_module, "AUTO_DUCKDB_BYTES", 0)
        return "auto"
    return engine


@pytest.mark.parametrize("engine", ["numpy", "duckdb", "auto", "auto-large"])
def test_every_engine_reads_the_file_a_name_spells(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, engine: str
) -> None:
    tokens = _files(tmp_path)
    chosen = _engines(monkeypatch, engine)
    for name in HOSTILE:
        path = str(tmp_path / name)
        code, report, err = _analyze(capsys, path, "--engine", chosen)
        assert (code, err) == (0, ""), name
        assert report["input"]["formats"] == {path: "kvlens"}, name
        assert (report["overall"]["requests"], report["overall"]["prompt_tokens"]) == (1, tokens[name]), name


@pytest.mark.parametrize("engine", ["numpy", "duckdb", "auto", "auto-large"])
def test_every_engine_walks_a_directory_alike(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, engine: str
) -> None:
    tokens = _files(tmp_path)
    code, report, err = _analyze(capsys, str(tmp_path), "--engine", _engines(monkeypatch, engine))
    assert (code, err) == (0, "")
    assert report["input"]["formats"] == {str(tmp_path / name): "kvlens" for name in sorted(tokens)}
    assert report["overall"]["prompt_tokens"] == sum(tokens.values())


@pytest.mark.parametrize("engine", ["numpy", "duckdb"])
def test_a_pattern_that_names_no_file_is_refused_alike(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], engine: str
) -> None:
    _files(tmp_path)
    pattern = str(tmp_path / "*.json")  # would match nothing; as a name, names nothing
    code, _, err = _analyze(capsys, pattern, "--engine", engine)
    assert code == 2
    assert err == (
        f"kvlens: {pattern}: no such file or directory (a name is read as the path it spells, "
        "never as a pattern: let the shell expand patterns, or name a directory)\n"
    )


@pytest.mark.parametrize("engine", ["numpy", "duckdb"])
def test_compare_reads_the_file_an_arm_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], engine: str
) -> None:
    # an arm named `[ab].jsonl` read a.jsonl and b.jsonl with DuckDB: two arms of different
    # lengths, refused as not one sequence, where numpy compared the two files named
    lines = b"".join(
        json.dumps(
            {"request_id": f"r{i}", "prompt_tokens": 100 + i, "cached_tokens": 0, "ttft_seconds": 0.1}
        ).encode()
        + b"\n"
        for i in range(3)
    )
    for name in ("[ab].jsonl", "[cd].jsonl"):
        (tmp_path / name).write_bytes(lines)
    for name in ("a.jsonl", "c.jsonl"):
        (tmp_path / name).write_bytes(_record(7))
    arms = ["--arm", f"off={tmp_path / '[ab].jsonl'}", "--arm", f"on={tmp_path / '[cd].jsonl'}"]
    code = main(["compare", *arms, "--engine", engine, "--json"])
    captured = capsys.readouterr()
    assert (code, captured.err) == (0, "")
    assert json.loads(captured.out)["requests"] == 3


def test_parquet_duckdb_cannot_name_is_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _parquet(tmp_path / "back\\*.parquet")
    _parquet(tmp_path / "back\\x.parquet")  # what DuckDB's pattern read: neither file
    code, _, err = _analyze(capsys, str(path))
    assert (code, err) == (
        2,
        f"kvlens: {path}: DuckDB cannot read a file whose path holds both a backslash and one of *?[ "
        "(it reads such a name as a pattern and never matches a backslash): rename it\n",
    )


def _parquet(path: Path) -> Path:
    table = pa.Table.from_pydict({"prompt_tokens": [100, 200], "cached_tokens": [10, 0]})
    pq.write_table(table, path)
    return path


def scale_missing(what: str) -> str:
    return str(MissingExtra(what, "scale"))


@pytest.mark.parametrize("name", ["records.parquet", "records.jsonl", "records"])
def test_parquet_without_duckdb_names_the_extra(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    # Parquet by its suffix or by its magic bytes (PAR1), whatever it is called
    path = _parquet(tmp_path / name)
    monkeypatch.setitem(sys.modules, "duckdb", None)  # `import duckdb` fails as when not installed
    code, _, err = _analyze(capsys, str(path))
    assert (code, err) == (2, f"kvlens: {scale_missing(f'{path} is Parquet: reading it (DuckDB)')}\n")
    arms = ["--arm", f"off={path}", "--arm", f"on={path}"]
    assert main(["compare", *arms]) == 2
    assert capsys.readouterr().err == f"kvlens: {scale_missing(f'{path} is Parquet: reading it (DuckDB)')}\n"
    assert main(["convert", str(path), "--to", "parquet", str(tmp_path / "out.parquet")]) == 2
    assert capsys.readouterr().err == f"kvlens: {scale_missing('the duckdb engine')}\n"


def test_parquet_given_to_the_numpy_engine_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _parquet(tmp_path / "records.jsonl")  # Parquet by its magic bytes, named as lines
    code, _, err = _analyze(capsys, str(path), "--engine", "numpy")
    assert (code, err) == (
        2,
        f"kvlens: {path} is Parquet: the numpy engine reads JSON lines only; use --engine duckdb (or auto)\n",
    )
    code, report, err = _analyze(capsys, str(path))  # auto: duckdb, by the magic bytes
    assert (code, err, report["overall"]["prompt_tokens"]) == (0, "", 300)
