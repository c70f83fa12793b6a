"""What one start of the command line costs before any work: each check in a fresh interpreter,
as a user's ``kvlens`` starts."""

from __future__ import annotations

import os
import subprocess
import sys

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
