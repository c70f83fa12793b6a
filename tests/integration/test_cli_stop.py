"""How the command line ends when its user ends it: Ctrl-C, or a reader that leaves the pipe."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from tests.live import start_kvlens

pytestmark = pytest.mark.integration


def test_ctrl_c_stops_the_demo_without_a_traceback() -> None:
    demo = start_kvlens("demo", "--every", "60")  # its banner says: Ctrl-C to stop
    demo.process.send_signal(signal.SIGINT)
    out, _ = demo.process.communicate(timeout=20)
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    # 128 + SIGINT, as a shell reports it (the output names the cause if it is not: once in CI
    # the demo ended 0, not reproduced in 12 runs here, at load 0-4)
    assert demo.process.returncode == 130, out


def test_a_reader_that_leaves_the_pipe_ends_the_output_quietly(tmp_path: Path) -> None:
    records = tmp_path / "records.jsonl"
    records.write_bytes(
        b"".join(orjson.dumps({"prompt_tokens": 100 + i, "cached_tokens": i}) + b"\n" for i in range(50))
    )
    analyze = [sys.executable, "-m", "kvlens.cli", "analyze", "--json", str(records)]
    # `true` has left before kvlens writes: every write meets a closed pipe, whatever its size
    command = " ".join(analyze) + " | true"
    done = subprocess.run(
        ["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True, timeout=60
    )
    assert done.stderr == ""  # no BrokenPipeError traceback
    assert done.returncode == 141  # 128 + SIGPIPE, as a program killed by the broken pipe
