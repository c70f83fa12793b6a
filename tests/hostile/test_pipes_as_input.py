"""Records from a pipe named as a file: a FIFO (``mkfifo``) or a shell's process substitution
(``kvlens analyze <(zcat a.gz)``, a ``/dev/fd/N`` pipe). A pipe is read once, from its first
byte: the numpy engine's gzip probe opened it, took a buffer's worth and closed it (a FIFO then
hung waiting for a second writer; a /dev/fd pipe read as empty), and the DuckDB engine called
it missing. A pipe found by a directory walk is left out (nothing may ever write to
it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

RECORDS = b'{"prompt_tokens": 100, "cached_tokens": 50}\n{"prompt_tokens": 10, "cached_tokens": 5}\n'


def _analyze(argument: str, engine: str, **options: Any) -> tuple[int, dict[str, Any], str]:
    done = subprocess.run(
        [sys.executable, "-m", "kvlens.cli", "analyze", "--json", "--engine", engine, argument],
        capture_output=True,
        text=True,
        timeout=60,
        **options,
    )
    report = json.loads(done.stdout) if done.returncode == 0 else {}
    return done.returncode, report, done.stderr


def _totals(report: dict[str, Any]) -> tuple[int, int, int]:
    overall = report["overall"]
    return overall["requests"], overall["prompt_tokens"], overall["cached_tokens"]


def _engines() -> list[str]:
    try:
        import duckdb  # noqa: F401
    except ModuleNotFoundError:
        return ["numpy"]
    return ["numpy", "duckdb"]


@pytest.mark.parametrize("engine", _engines())
def test_a_fifo_named_as_input_is_read_once(engine: str, tmp_path: Path) -> None:
    fifo = tmp_path / "records"
    os.mkfifo(fifo)

    def write() -> None:
        with open(fifo, "wb") as stream:  # blocks until kvlens opens it
            stream.write(RECORDS)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    code, report, err = _analyze(str(fifo), engine)
    writer.join(timeout=10)
    assert code == 0, err
    assert report["overall"] == {
        **report["overall"],
        "requests": 2,
        "prompt_tokens": 110,
        "cached_tokens": 55,
    }


@pytest.mark.parametrize("engine", _engines())
def test_a_process_substitution_pipe_is_read_from_its_first_byte(engine: str) -> None:
    read, write = os.pipe()
    os.write(write, RECORDS)
    os.close(write)
    try:
        code, report, err = _analyze(f"/dev/fd/{read}", engine, pass_fds=(read,))
    finally:
        os.close(read)
    assert code == 0, err
    assert report["overall"] == {
        **report["overall"],
        "requests": 2,
        "prompt_tokens": 110,
        "cached_tokens": 55,
    }


def test_a_fifo_in_a_directory_is_left_out(tmp_path: Path) -> None:
    from kvlens.analysis import reader

    (tmp_path / "r.jsonl").write_bytes(RECORDS)
    os.mkfifo(tmp_path / "nobody-writes.jsonl")
    assert reader.resolve([str(tmp_path)]) == [str(tmp_path / "r.jsonl")]
