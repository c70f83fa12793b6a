"""Defect 8: a tail that finds a large backlog reads it in bounded batches, and never checkpoints
past what it has counted.

Requirement (reliability.md 5.9, 5.11): memory independent of the backlog's size; the checkpoint
never ahead of the lines counted (a crash re-reads at most one batch, it never loses one).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from kvlens.sources.tail import checkpoint_path
from tests.hostile.conftest import Serve

pytestmark = pytest.mark.integration
LINE_BYTES = 512
LINES = 71 * 1024 * 1024 // LINE_BYTES  # a 71 MiB backlog


def line(i: int) -> bytes:
    head = f'{{"prompt_tokens": 128, "cached_tokens": 16, "request_id": "r{i:09d}", "pad": "'.encode()
    return head + b"x" * (LINE_BYTES - len(head) - 3) + b'"}\n'


def test_a_large_backlog_is_read_in_bounded_batches_behind_the_count(serve: Serve, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    pattern = str(logs / "*.jsonl")
    state = tmp_path / "state"
    staged = tmp_path / "backlog.jsonl"
    with staged.open("wb") as out:
        for start in range(0, LINES, 10_000):
            out.write(b"".join(line(i) for i in range(start, min(start + 10_000, LINES))))
    sidecar = serve("--tail", pattern, KVLENS_STATE_DIR=str(state), KVLENS_TAIL_POLL_SECONDS="0.05")
    memory = sidecar.memory()
    memory.reset()
    os.rename(staged, logs / "app.jsonl")  # the whole backlog appears at once

    checkpoint = checkpoint_path(state, pattern)
    observations = 0
    deadline = time.monotonic() + 120
    while (counted := sidecar.value("kvlens_requests_total")) < LINES and time.monotonic() < deadline:
        try:
            files = json.loads(checkpoint.read_text())["files"]
        except (FileNotFoundError, json.JSONDecodeError):
            continue
        checkpointed = sum(entry["offset"] for entry in files.values()) // LINE_BYTES
        recounted = sidecar.value("kvlens_requests_total")
        assert checkpointed <= recounted, "the checkpoint ran ahead of the count"
        observations += 1
    assert counted == LINES
    assert observations >= 3
    assert memory.peak_growth_mib() < 64
