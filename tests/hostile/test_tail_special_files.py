"""Issue 15, defects 2 and 8 (first item): what a tail glob matches besides regular files.

Requirement: only regular files are followed; a FIFO, socket, device or directory is skipped,
counted (``kvlens_tail_files_skipped_total{reason}``) and logged once per path; nothing in a poll
blocks, so a FIFO neither stalls the other files nor the shutdown; a matched path that cannot be
read fails readiness with its reason, and readiness comes back once it is gone.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import orjson
import pytest

from tests.hostile.conftest import Serve
from tests.live import Running

pytestmark = pytest.mark.integration
LINES = 100
REASONS = ("directory", "fifo", "socket", "device", "other", "unreadable")


def lines(count: int, start: int = 0) -> bytes:
    return b"".join(
        orjson.dumps({"prompt_tokens": 10 + i, "cached_tokens": i % 3}) + b"\n"
        for i in range(start, start + count)
    )


def skipped(sidecar: Running, pattern: str) -> dict[str, float]:
    """The skip counter's non-zero reasons."""
    samples = sidecar.samples()
    found = {
        reason: samples.get(
            ("kvlens_tail_files_skipped_total", frozenset({("path", pattern), ("reason", reason)})), 0.0
        )
        for reason in REASONS
    }
    return {reason: value for reason, value in found.items() if value}


def wait_ready(sidecar: Running, expected: int, timeout: float = 20) -> httpx.Response:
    """Poll /readyz until it answers ``expected`` (the tail changes state on its own clock)."""
    deadline = time.monotonic() + timeout
    while (answer := httpx.get(f"{sidecar.url}/readyz", timeout=5)).status_code != expected:
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return answer


def stop_timed(sidecar: Running) -> tuple[float, str]:
    """SIGTERM, and the seconds until the process has exited, with what it printed."""
    began = time.monotonic()
    sidecar.process.terminate()
    try:
        out, _ = sidecar.process.communicate(timeout=30)
    except Exception:
        sidecar.process.kill()
        out, _ = sidecar.process.communicate()
    return time.monotonic() - began, out


def test_a_fifo_in_the_glob_is_skipped_and_the_regular_file_beside_it_is_read(
    serve: Serve, tmp_path: Path
) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "app.jsonl").write_bytes(lines(LINES))
    fifo = logs / "pipe.jsonl"
    os.mkfifo(fifo)  # nobody ever writes to it: an open() without O_NONBLOCK waits forever
    pattern = str(logs / "*.jsonl")
    sidecar = serve(
        "--tail",
        pattern,
        KVLENS_STATE_DIR=str(tmp_path / "state"),
        KVLENS_TAIL_POLL_SECONDS="0.05",
        KVLENS_LOG_LEVEL="INFO",  # "shutdown complete" is uvicorn's INFO line; the level is uvicorn's too
    )

    assert sidecar.wait_for("kvlens_requests_total", LINES, timeout=10) == LINES
    assert sidecar.value("kvlens_prompt_tokens_total") == sum(10 + i for i in range(LINES))
    assert skipped(sidecar, pattern) == {"fifo": 1}
    assert wait_ready(sidecar, 200).status_code == 200  # a FIFO is not a log file: nothing is lost

    seconds, output = stop_timed(sidecar)
    assert seconds < 5, f"SIGTERM took {seconds:.1f} s: a tail thread is blocked"
    assert "Application shutdown complete" in output, output
    assert sum(str(fifo) in line for line in output.splitlines()) == 1, output


def test_a_path_that_cannot_be_read_fails_readiness_with_its_reason(serve: Serve, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    loop = logs / "0-loop.jsonl"  # sorted first: once it stopped every poll before any file was read
    loop.symlink_to(loop)  # stat fails with ELOOP, even for root (a permission bit would not)
    app = logs / "app.jsonl"
    app.write_bytes(lines(LINES))
    pattern = str(logs / "*.jsonl")
    sidecar = serve(
        "--tail", pattern, KVLENS_STATE_DIR=str(tmp_path / "state"), KVLENS_TAIL_POLL_SECONDS="0.05"
    )

    assert sidecar.wait_for("kvlens_requests_total", LINES, timeout=10) == LINES
    not_ready = wait_ready(sidecar, 503, timeout=10)
    assert not_ready.status_code == 503
    (problem,) = not_ready.json()["problems"]
    assert pattern in problem and str(loop) in problem and "OSError" in problem, problem
    assert skipped(sidecar, pattern) == {"unreadable": 1}

    loop.unlink()
    with app.open("ab") as out:
        out.write(lines(1, start=LINES))
    assert sidecar.wait_for("kvlens_requests_total", LINES + 1) == LINES + 1
    assert wait_ready(sidecar, 200).json() == {"status": "ready"}
    output = sidecar.output()
    assert sum(str(loop) in line for line in output.splitlines()) == 1, output


def test_a_directory_in_the_glob_is_logged_once_over_many_polls(serve: Serve, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    directory = logs / "archive.jsonl"
    directory.mkdir()
    app = logs / "app.jsonl"
    app.write_bytes(b"")
    pattern = str(logs / "*.jsonl")
    sidecar = serve(
        "--tail", pattern, KVLENS_STATE_DIR=str(tmp_path / "state"), KVLENS_TAIL_POLL_SECONDS="0.02"
    )

    rounds = 10
    for round_ in range(rounds):  # each round is counted by a poll of its own
        with app.open("ab") as out:
            out.write(lines(1, start=round_))
        assert sidecar.wait_for("kvlens_requests_total", round_ + 1) == round_ + 1
    first = skipped(sidecar, pattern)
    ready = wait_ready(sidecar, 200).status_code

    directory.rmdir()  # the path changes into something else: said again, once
    os.mkfifo(directory)
    with app.open("ab") as out:
        out.write(lines(1, start=rounds))
    assert sidecar.wait_for("kvlens_requests_total", rounds + 1) == rounds + 1
    deadline = time.monotonic() + 10
    while (then := skipped(sidecar, pattern)) != {"directory": 1, "fifo": 1} and time.monotonic() < deadline:
        time.sleep(0.05)
    seconds, output = stop_timed(sidecar)
    mentions = [line for line in output.splitlines() if str(directory) in line]
    assert len(mentions) == 2, output
    assert "directory" in mentions[0] and "FIFO" in mentions[1], mentions
    assert first == {"directory": 1}
    assert then == {"directory": 1, "fifo": 1}
    assert ready == 200  # a directory is not a log file: nothing is lost
    assert seconds < 5, f"SIGTERM took {seconds:.1f} s"
