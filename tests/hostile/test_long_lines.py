"""A line with no end (a file of one endless line, a link to /dev/zero) was gathered whole in
memory by the JSON-lines reader of both engines, until the machine ran out of it: a line past
``jsonlines.MAX_LINE_BYTES`` is dropped as it is read and counted as a bad line where it stood."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from kvlens.analysis import reader
from kvlens.cli import main
from kvlens.sources import jsonlines

VALID = json.dumps({"prompt_tokens": 100, "cached_tokens": 10, "model": "m"}).encode()


def test_an_endless_line_is_never_held_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jsonlines, "MAX_LINE_BYTES", 256 * 1024)
    endless = io.BufferedReader(io.BytesIO(VALID + b"\n" + b"x" * (4 * 1024 * 1024)))  # type: ignore[arg-type]
    warnings: list[str] = []
    chunks = list(jsonlines.line_chunks(endless, 64 * 1024, None, "endless.jsonl", warnings.append))
    assert max(len(chunk) for _, chunk in chunks) <= 256 * 1024 + 64 * 1024
    assert [line for _, chunk in chunks for line in chunk.split(b"\n")] == [VALID, jsonlines.TOO_LONG_LINE]
    assert warnings == [
        f"endless.jsonl: line 2 is longer than {256 * 1024:,} bytes: not read (malformed_json)"
    ]


@pytest.mark.parametrize("engine", ["numpy", "duckdb"])
@pytest.mark.parametrize("ends", [True, False], ids=["ended", "endless"])
def test_a_line_past_the_limit_is_one_bad_line_and_the_lines_around_it_are_read(
    engine: str,
    ends: bool,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    if engine == "duckdb":
        pytest.importorskip("duckdb")
    monkeypatch.setattr(reader, "CHUNK_BYTES", 64 * 1024)
    monkeypatch.setattr(jsonlines, "MAX_LINE_BYTES", 256 * 1024)
    long_line = b'{"prompt_tokens": 5, "model": "' + b"y" * (1024 * 1024) + b'"}'
    lines = [VALID, VALID, long_line, VALID] if ends else [VALID, VALID, long_line]
    path = tmp_path / "records.jsonl"
    path.write_bytes(b"\n".join(lines) + (b"\n" if ends else b""))
    assert main(["analyze", "--json", "--log-format", "json", "--engine", engine, str(path)]) == 0
    out = capsys.readouterr()
    report = json.loads(out.out)["input"]
    assert (report["records"], report["lines"], report["skipped"]) == (
        len(lines) - 1,
        len(lines),
        {"malformed_json": 1},
    )
    examples = report["skipped_examples"]
    assert [(example["line"], example["reason"]) for example in examples] == [(3, "malformed_json")]
    assert [json.loads(line)["message"] for line in out.err.splitlines()] == [
        f"{path}: line 3 is longer than {256 * 1024:,} bytes: not read (malformed_json)"
    ]
