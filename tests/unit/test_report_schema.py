"""`kvlens analyze --json` keeps the schema docs/analyze.md documents (kvlens.analyze/v1: fields are
only ever added), with its empty values, its group labels and the slowest groups in order."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest

from kvlens.cli import main

TOP = {"schema", "overall", "models", "groups", "ttft_decomposition", "slowest", "input", "diagnosis",
       "calibration", "sessions", "misses"}  # fmt: skip
RATIOS = {"requests", "hit_requests", "prompt_tokens", "cached_tokens", "prompt_work_units",
          "reused_work_units", "work_unit", "work", "request_hit_ratio", "token_reuse_ratio",
          "compute_saved_ratio"}  # fmt: skip
WORK = {"prompt", "reused", "compute_saved_ratio"}
GROUP = {"prompt_len", "cache", "requests", "share_of_requests", "share_of_tokens", "share_of_work",
         "token_reuse_ratio", "ttft_seconds", "queue_seconds", "prefill_seconds"}  # fmt: skip
PERCENTILES = {"count", "p50", "p95", "p99"}
DECOMPOSITION = {"requests", "overlapped_requests", "queue_share", "prefill_share", "other_share"}
SLOWEST = {"share", "threshold_seconds", "requests", "groups"}
SLOWEST_GROUP = {"prompt_len", "cache", "requests", "share"}
INPUT = {"files", "formats", "lines", "ignored", "records", "skipped_total", "skipped", "skipped_examples",
         "time_range"}  # fmt: skip


def report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], records: list[dict[str, Any]]
) -> dict[str, Any]:
    path = tmp_path / "records.jsonl"
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    assert main(["analyze", str(path), "--json"]) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


def traffic() -> list[dict[str, Any]]:
    quick = {"model": "m", "prompt_tokens": 300, "cached_tokens": 0, "ttft_seconds": 0.1,
             "queue_seconds": 0.02, "prefill_seconds": 0.05}  # fmt: skip
    slow_long = {"model": "m", "prompt_tokens": 4096, "cached_tokens": 0, "ttft_seconds": 1.0}
    slow_hit = {"prompt_tokens": 100, "cached_tokens": 16, "ttft_seconds": 1.0}  # no model: the default
    return [quick] * 37 + [slow_long] * 2 + [slow_hit]


def test_every_documented_field_at_every_level(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = report(tmp_path, capsys, traffic())
    assert set(result) == TOP
    assert result["schema"] == "kvlens.analyze/v1"
    assert set(result["overall"]) == RATIOS
    assert set(result["overall"]["work"]) == {"work_units"}
    assert set(result["overall"]["work"]["work_units"]) == WORK
    assert set(result["models"]) == {"m", "unknown"}
    assert all(set(model) == RATIOS for model in result["models"].values())
    assert [(g["prompt_len"], g["cache"], g["requests"]) for g in result["groups"]] == [
        ("0-511", "hit", 1),
        ("0-511", "miss", 37),
        ("2048-8191", "miss", 2),
    ]
    for group in result["groups"]:
        assert set(group) == GROUP
        assert all(set(group[f]) == PERCENTILES for f in ("ttft_seconds", "queue_seconds", "prefill_seconds"))
    assert result["groups"][0]["token_reuse_ratio"] == pytest.approx(0.16)
    assert result["groups"][0]["queue_seconds"] == {"count": 0, "p50": None, "p95": None, "p99": None}
    assert set(result["ttft_decomposition"]) == DECOMPOSITION
    assert result["ttft_decomposition"]["overlapped_requests"] == 0
    assert set(result["input"]) == INPUT
    # no record of traffic() carries an arrival_time
    assert result["input"]["time_range"] == {"first_arrival": None, "last_arrival": None, "records": 0}
    slowest = result["slowest"]
    assert set(slowest) == SLOWEST and slowest["share"] == 0.05
    assert slowest["threshold_seconds"] == 1.0 and slowest["requests"] == 3
    assert [(g["prompt_len"], g["cache"], g["requests"]) for g in slowest["groups"]] == [
        ("2048-8191", "miss", 2),  # most of the slowest first
        ("0-511", "hit", 1),
    ]
    assert all(set(g) == SLOWEST_GROUP for g in slowest["groups"])


def test_the_empty_values(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = report(tmp_path, capsys, [{"prompt_tokens": 10, "cached_tokens": 0}])
    assert result["slowest"] == {"share": 0.05, "threshold_seconds": None, "requests": 0, "groups": []}
    assert result["groups"][0]["ttft_seconds"] == {"count": 0, "p50": None, "p95": None, "p99": None}
    assert result["ttft_decomposition"] == {
        "requests": 0,
        "overlapped_requests": 0,
        "queue_share": None,
        "prefill_share": None,
        "other_share": None,
    }
