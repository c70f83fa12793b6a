"""What one start of the command line costs before any work: each check in a fresh interpreter,
as a user's ``kvlens`` starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def _fresh(code: str, **env: str) -> str:
    """``code``'s output in a new interpreter with ``env`` (an empty value: unset)."""
    environment = {k: v for k, v in os.environ.items() if k not in env}
    environment.update({k: v for k, v in env.items() if v})
    done = subprocess.run(
        [sys.executable, "-c", code], env=environment, capture_output=True, text=True, check=True, timeout=60
    )
    return done.stdout.strip()


# numpy imported after the command line, as a command imports it
THREADS = "import os, kvlens.cli, numpy; print(len(os.listdir('/proc/self/task')))"


@pytest.mark.skipif(
    not os.path.isdir("/proc/self/task") or (os.cpu_count() or 1) < 2, reason="Linux, 2+ cores"
)
def test_the_command_line_gives_numpys_openblas_one_thread_unless_told_otherwise() -> None:
    # its spinning threads cost 0.1 CPU s at every start; a user's setting wins
    assert _fresh(THREADS, OPENBLAS_NUM_THREADS="") == "1"
    assert _fresh(THREADS, OPENBLAS_NUM_THREADS="2") == "2"


HEAVY = {"pydantic", "pydantic_settings", "numpy", "duckdb", "yaml", "rich", "httpx", "uvicorn", "fastapi"}


@pytest.mark.parametrize("argv", [["--help"], ["analyze", "--help"], ["serve", "--help"], ["no-such"]])
def test_help_imports_no_heavy_module(argv: list[str]) -> None:
    # `kvlens --help` names the commands from their summaries, and a command's flags need none of
    # what it runs: no settings (pydantic), no numpy, no server
    code = (
        "import sys, contextlib, io\n"
        "from kvlens.console import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
        "    try:\n"
        f"        main({argv!r})\n"
        "    except SystemExit:\n"
        "        pass\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {HEAVY!r}))"
    )
    assert _fresh(code) == "[]"


def test_analyze_imports_no_module_its_report_does_not_need(tmp_path: Path) -> None:
    # YAML only for --calibrate's file, rich only for the terminal's table, the server never, DuckDB
    # not for the numpy engine (auto's choice for small JSON lines), pydantic-settings not without a
    # KVLENS_* variable or a settings file to read
    records = tmp_path / "records.jsonl"
    records.write_text('{"prompt_tokens": 100, "cached_tokens": 50, "model": "m"}\n')
    code = (
        "import sys, contextlib, io\n"
        "from kvlens.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    assert main(['analyze', {str(records)!r}, '--json']) == 0\n"
        "print(sorted({m.split('.')[0] for m in sys.modules}\n"
        "             & {'yaml', 'rich', 'uvicorn', 'httpx', 'duckdb', 'pydantic_settings'}))"
    )
    assert _fresh(code) == "[]"


def test_analyze_builds_no_pydantic_validator_when_no_setting_is_given(tmp_path: Path) -> None:
    # the process's first validator looks pydantic's plugins up among every installed package
    # (~20 ms); the defaults need none
    records = tmp_path / "records.jsonl"
    records.write_text('{"prompt_tokens": 100, "cached_tokens": 50, "model": "m"}\n')
    code = (
        "import sys, contextlib, io\n"
        "from kvlens.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    assert main(['analyze', {str(records)!r}]) == 0\n"
        "print('pydantic.plugin._loader' in sys.modules)"
    )
    assert _fresh(code) == "False"


def test_the_end_of_a_command_freezes_the_heap_after_its_output_and_cleanup(tmp_path: Path) -> None:
    # the interpreter's last collections would walk every object (0.1-0.15 s of each run's end);
    # frozen at exit, after the report is flushed and DuckDB's spill directory removed
    records = tmp_path / "records.jsonl"
    records.write_text('{"prompt_tokens": 100, "cached_tokens": 50, "model": "m"}\n')
    spill = tmp_path / "tmp"
    spill.mkdir()
    code = (
        "import atexit, gc, sys\n"
        "from kvlens.console import main\n"
        f"code = main(['analyze', {str(records)!r}, '--engine', 'duckdb', '--json'])\n"
        "print(gc.get_freeze_count(), file=sys.stderr)\n"
        "atexit._run_exitfuncs()\n"
        "print(gc.get_freeze_count() > 0, file=sys.stderr)\n"
        "sys.exit(code)"
    )
    environment = {**os.environ, "TMPDIR": str(spill)}
    done = subprocess.run(
        [sys.executable, "-c", code], env=environment, capture_output=True, text=True, check=True, timeout=60
    )
    assert json.loads(done.stdout)["overall"]["requests"] == 1
    assert done.stderr.split() == ["0", "True"]
    assert list(spill.iterdir()) == []
