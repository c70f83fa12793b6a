"""A real ``kvlens serve`` logs kvlens's lines and uvicorn's in one format: with
``--log-format json`` every line on its output is one JSON object."""

from __future__ import annotations

import json

import pytest

from tests.live import start_kvlens

pytestmark = pytest.mark.integration


def test_json_logs_of_a_real_server_are_one_object_per_line() -> None:
    # 0.0.0.0 without a token: kvlens's own warning, beside uvicorn's start-up lines
    running = start_kvlens(
        "serve", "--host", "0.0.0.0", "--log-format", "json", env={"KVLENS_LOG_LEVEL": "INFO"}
    )
    lines = running.output().splitlines()
    objects = [json.loads(line) for line in lines]
    assert all(set(o) == {"ts", "level", "logger", "message"} for o in objects), lines
    loggers = {(o["logger"], o["level"]) for o in objects}
    assert ("kvlens", "WARNING") in loggers and ("uvicorn.error", "INFO") in loggers, loggers
    assert any(o["message"].startswith("Uvicorn running on http://0.0.0.0:") for o in objects)
