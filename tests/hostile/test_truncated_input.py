"""A gzip file cut short (copied while it was written, a disk that filled, a rotation caught
mid-write): the lines before the cut are read, the cut line is counted as a bad line, a warning
names the file, and the exit is 0; it was a traceback (EOFError) with either engine."""

from __future__ import annotations

import gzip
import json
import zlib
from pathlib import Path

import pytest

from kvlens.cli import main


@pytest.mark.parametrize("engine", ["numpy", "duckdb"])
def test_a_gzip_file_cut_short_keeps_the_lines_before_the_cut(
    engine: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if engine == "duckdb":
        pytest.importorskip("duckdb")
    lines = [json.dumps({"prompt_tokens": 100 + i, "cached_tokens": i % 50}) for i in range(20_000)]
    whole = gzip.compress(("\n".join(lines) + "\n").encode(), compresslevel=1)
    cut = whole[: len(whole) // 2]
    path = tmp_path / "records.jsonl.gz"
    path.write_bytes(cut)
    text = zlib.decompressobj(wbits=31).decompress(cut)  # what the cut file still holds
    complete = text.count(b"\n")
    assert text[text.rfind(b"\n") + 1 :]  # the cut falls inside a line here
    assert main(["analyze", "--json", "--log-format", "json", "--engine", engine, str(path)]) == 0
    out = capsys.readouterr()
    report = json.loads(out.out)
    assert report["input"]["records"] == complete
    assert report["input"]["lines"] == complete + 1
    assert report["input"]["skipped"] == {"malformed_json": 1}
    assert report["overall"]["prompt_tokens"] == sum(100 + i for i in range(complete))
    assert [json.loads(line)["message"] for line in out.err.splitlines()] == [
        f"{path}: the gzip stream ends before its end (the file was cut short): "
        f"the {complete + 1:,} lines before it are read"
    ]


@pytest.mark.parametrize("engine", ["numpy", "duckdb"])
def test_a_gzip_file_corrupt_after_its_first_member_keeps_that_member(
    engine: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if engine == "duckdb":
        pytest.importorskip("duckdb")
    lines = "".join(json.dumps({"prompt_tokens": 100, "cached_tokens": i % 50}) + "\n" for i in range(1000))
    path = tmp_path / "records.jsonl.gz"
    path.write_bytes(gzip.compress(lines.encode()) + b"garbage appended by a broken copy")
    assert main(["analyze", "--json", "--log-format", "json", "--engine", engine, str(path)]) == 0
    out = capsys.readouterr()
    report = json.loads(out.out)
    assert (report["input"]["records"], report["input"]["lines"], report["input"]["skipped"]) == (
        1000,
        1000,
        {},
    )
    assert [json.loads(line)["message"] for line in out.err.splitlines()] == [
        f"{path}: the gzip stream is corrupt here: the 1,000 lines before it are read"
    ]
