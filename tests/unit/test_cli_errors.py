"""An ordinary mistake on the command line gets one line naming the path or port and the reason,
and exit 2; never a traceback."""

from __future__ import annotations

import errno
import socket
import tempfile
from pathlib import Path

import pytest

from kvlens.cli import main


def one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture
def records(tmp_path: Path) -> Path:
    path = tmp_path / "records.jsonl"
    path.write_text('{"prompt_tokens": 128, "cached_tokens": 16}\n')
    return path


def test_a_missing_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.jsonl"
    assert main(["analyze", str(missing)]) == 2
    assert one_line(capsys) == f"kvlens: {missing}: no such file or directory"


def test_an_empty_directory_as_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A directory is an input (Parquet and JSON-lines files under it); an empty one holds nothing.
    assert main(["analyze", str(tmp_path)]) == 1
    assert one_line(capsys) == "kvlens analyze: no record accepted (skipped, by reason: no line in the input)"


@pytest.mark.parametrize("flag", ["--html", "--calibrate"])
def test_an_output_whose_folder_is_missing_is_refused_before_the_work(
    flag: str, records: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "no-such-folder" / "out"
    assert main(["analyze", str(records), flag, str(out)]) == 2
    assert one_line(capsys) == f"kvlens: {out}: its folder does not exist"


def test_an_output_that_is_a_directory(
    records: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["analyze", str(records), "--html", str(tmp_path)]) == 2
    assert one_line(capsys) == f"kvlens: {tmp_path}: is a directory, not a file to write"


def test_simulate_emit_records_into_a_missing_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "missing" / "records.jsonl"
    assert main(["simulate", "--emit-records", str(out), "--policy", "round_robin"]) == 2
    assert one_line(capsys) == f"kvlens: {out}: No such file or directory"


def test_compare_with_a_missing_arm(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "warm.jsonl"
    present = tmp_path / "off.jsonl"
    present.write_text('{"prompt_tokens": 10, "cached_tokens": 0, "ttft_seconds": 0.1}\n')
    # two arms: with one, compare says that it needs two (tests/hostile/test_experiment_errors.py)
    assert main(["compare", "--arm", f"off={present}", "--arm", f"warm={missing}"]) == 2
    assert one_line(capsys) == f"kvlens: {missing}: no such file or directory"  # as analyze says


@pytest.mark.parametrize("engine", ["numpy", "duckdb"])
def test_compare_with_an_arm_of_no_records(
    engine: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("duckdb")
    both = tmp_path / "sim.jsonl"  # a file of several arms (`kvlens simulate --emit-records`)
    both.write_text(
        '{"prompt_tokens": 10, "cached_tokens": 0, "ttft_seconds": 0.1, "arm": "off"}\n'
        '{"prompt_tokens": 10, "cached_tokens": 5, "ttft_seconds": 0.1, "arm": "warm"}\n'
    )
    assert main(["compare", "--arm", f"off={both}", "--arm", f"nope={both}", "--engine", engine]) == 2
    assert one_line(capsys) == f"kvlens compare: {both} has no records of arm 'nope'"


def test_the_refusals_of_compare_are_input_errors_of_the_one_tree() -> None:
    """A caller above (the CLI's top level, an experiment) catches InputError as one line and exit
    2: a refusal outside the tree was a traceback wherever nobody listed it by name."""
    from kvlens import errors

    for name in ("NoRecordsOfArm", "GroupTooLarge"):
        refusal = getattr(errors, name)
        assert issubclass(refusal, errors.InputError), name


def test_analyze_that_accepts_no_record_says_why_and_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "junk.jsonl"
    path.write_text('{"x": 1}\nnot json\n')
    assert main(["analyze", str(path)]) == 1
    assert one_line(capsys).startswith("kvlens analyze: no record accepted (skipped, by reason: ")


def test_a_port_in_use_names_it_and_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    assert one_line(capsys) == (
        f"kvlens: cannot listen on 127.0.0.1:{port} (Address already in use): "
        "pick another port with --port (or KVLENS_PORT)"
    )


def test_progress_goes_to_stderr_and_json_stays_clean(tmp_path: Path) -> None:
    """A terminal on stderr shows the bar; stdout, piped, holds only the JSON (a bar on stdout put
    a stray newline before it)."""
    import gzip
    import itertools
    import json
    import os
    import pty
    import subprocess
    import sys

    from kvlens.simulate.trace import BUNDLED

    trace = tmp_path / "trace.jsonl"
    with gzip.open(BUNDLED, "rb") as lines:
        trace.write_bytes(b"".join(itertools.islice(lines, 200)))
    terminal, attached = pty.openpty()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "kvlens.cli", "simulate", str(trace), "--policy", "round_robin", "--json"],
            stdout=subprocess.PIPE,
            stderr=attached,
            timeout=120,
            env={**os.environ, "TERM": "xterm", "COLUMNS": "80"},
        )
    finally:
        os.close(attached)
        os.close(terminal)
    assert done.returncode == 0
    assert done.stdout.startswith(b"{")
    assert json.loads(done.stdout)["schema"] == "kvlens.simulate/v1"


def test_no_usable_temporary_directory_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # what CPython raises when TMPDIR, /tmp, /var/tmp, /usr/tmp and the working directory are
    # all read-only (a container with a read-only root): an OSError without a file name
    pytest.importorskip("duckdb")
    records = tmp_path / "r.jsonl"
    records.write_text('{"prompt_tokens": 10, "cached_tokens": 2}\n')

    def no_directory() -> str:
        raise FileNotFoundError(errno.ENOENT, "No usable temporary directory found in ['/tmp', '/var/tmp']")

    monkeypatch.setattr(tempfile, "tempdir", None)
    monkeypatch.setattr(tempfile, "gettempdir", no_directory)
    assert main(["analyze", "--engine", "duckdb", str(records)]) == 2
    assert one_line(capsys) == (
        "kvlens: no temporary directory for DuckDB to spill to (No usable temporary directory found "
        "in ['/tmp', '/var/tmp']): set TMPDIR to a writable directory"
    )


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_a_warm_up_time_that_is_no_time_is_refused(
    value: str, records: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # NaN compared false with every arrival time: no request was warm-up, silently
    with pytest.raises(SystemExit) as exited:
        main(["compare", "--arm", f"a={records}", "--arm", f"b={records}", f"--warmup-until={value}"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"kvlens compare: error: argument --warmup-until: a time is a finite number of seconds, not {value!r}"
    )
