"""Defect 7: a restart in the middle of an over-long line must not count the rest of it.

Requirement (reliability.md 5.8, 5.9): over-long lines skipped and counted once; a restarted tail
neither re-reads nor misreads; the checkpoint remembers that it stopped inside an over-long line
(it points at the line's start, so the line is read again whole and judged once).
"""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from tests.hostile.conftest import Serve

pytestmark = pytest.mark.integration
GOOD = orjson.dumps({"prompt_tokens": 100, "cached_tokens": 50}) + b"\n"
HIDDEN = orjson.dumps({"prompt_tokens": 7, "cached_tokens": 7})  # the tail of the long line


def test_a_restart_inside_an_over_long_line_skips_the_rest_of_it(serve: Serve, tmp_path: Path) -> None:
    log = tmp_path / "app.jsonl"
    log.write_bytes(GOOD + b"x" * 3000)  # a line over the 1 KiB limit, still being written
    env = {
        "KVLENS_STATE_DIR": str(tmp_path / "state"),
        "KVLENS_TAIL_POLL_SECONDS": "0.05",
        "KVLENS_TAIL_MAX_LINE_BYTES": "1024",
    }
    first = serve("--tail", str(log), **env)
    assert first.wait_for("kvlens_requests_total", 1) == 1
    first.output()  # a clean stop writes the last checkpoint: the long line is not over yet

    with log.open("ab") as out:
        out.write(HIDDEN + b"\n" + GOOD)  # the over-long line ends (in valid JSON), then a good line
    second = serve("--tail", str(log), **env)
    # lines are handled in file order: once the good line is in, the hidden one was handled
    assert second.wait_for("kvlens_prompt_tokens_total", 100) == 100
    assert second.value("kvlens_requests_total") == 1  # the good line only
    rejected = {
        dict(labels)["reason"]: value
        for (name, labels), value in second.samples().items()
        if name == "kvlens_records_rejected_total" and value
    }
    assert rejected == {"too_long": 1}  # the long line (no JSON object) once; never malformed_json
