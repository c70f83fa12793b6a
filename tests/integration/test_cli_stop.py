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


@pytest.mark.parametrize("inherited", ["default", "ignored"])
def test_ctrl_c_stops_the_demo_without_a_traceback(inherited: str) -> None:
    # "ignored": started as a job in the background of a script, which POSIX shells start with
    # SIGINT ignored; uvicorn still stops on it, but its re-raise of the signal went nowhere and
    # the demo ended 0 (seen in a CI run started that way)
    demo = start_kvlens("demo", "--every", "60", sigint_ignored=inherited == "ignored")
    demo.process.send_signal(signal.SIGINT)  # its banner says: Ctrl-C to stop
    out, _ = demo.process.communicate(timeout=20)
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    assert demo.process.returncode == 130, out  # 128 + SIGINT, as a shell reports it


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


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs Linux's /dev/full")
@pytest.mark.parametrize(
    ("command", "size"),
    [
        (["import", "vllm-bench", "tests/fixtures/bench-tools/vllm-bench/on.json"], "large"),
        (["analyze", "--json", "RECORDS"], "small"),  # held in the buffer: fails at the last flush
    ],
)
def test_a_full_disk_under_stdout_is_one_line_and_exit_1(
    tmp_path: Path, command: list[str], size: str
) -> None:
    records = tmp_path / "records.jsonl"
    records.write_bytes(b'{"prompt_tokens": 100, "cached_tokens": 50}\n')
    argv = [sys.executable, "-m", "kvlens.cli", *(str(records) if a == "RECORDS" else a for a in command)]
    with open("/dev/full", "wb") as full:
        done = subprocess.run(argv, stdout=full, stderr=subprocess.PIPE, text=True, timeout=60)
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr
    assert "kvlens: cannot write the output: No space left on device" in done.stderr, done.stderr
    assert done.returncode == 1, (size, done.stderr)
