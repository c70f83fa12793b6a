"""What one start of the command line costs before any work: each check in a fresh interpreter,
as a user's ``kvlens`` starts."""

from __future__ import annotations

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


THREADS = "import os, kvlens.cli; print(len(os.listdir('/proc/self/task')))"


@pytest.mark.skipif(
    not os.path.isdir("/proc/self/task") or (os.cpu_count() or 1) < 2, reason="Linux, 2+ cores"
)
def test_the_command_line_gives_numpys_openblas_one_thread_unless_told_otherwise() -> None:
    # its spinning threads cost 0.1 CPU s at every start; a user's setting wins
    assert _fresh(THREADS, OPENBLAS_NUM_THREADS="") == "1"
    assert _fresh(THREADS, OPENBLAS_NUM_THREADS="2") == "2"


def test_analyze_imports_no_module_its_report_does_not_need(tmp_path: Path) -> None:
    # YAML only for --calibrate's file, rich only for the terminal's table, the server never
    records = tmp_path / "records.jsonl"
    records.write_text('{"prompt_tokens": 100, "cached_tokens": 50, "model": "m"}\n')
    code = (
        "import sys, contextlib, io\n"
        "from kvlens.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    assert main(['analyze', {str(records)!r}, '--json']) == 0\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'yaml', 'rich', 'uvicorn', 'httpx'}))"
    )
    assert _fresh(code) == "[]"
