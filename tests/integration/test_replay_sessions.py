"""`kvlens replay --schedule sessions` of real kv-cache-tester conversations against a running
`kvlens simulate serve`, then `analyze` and `compare`: records carry their session, and the
delivered reuse of one unbounded replica equals the trace's theoretical reuse exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvlens.cli import main
from kvlens.simulate.cache import PrefixCache
from kvlens.simulate.run import served
from kvlens.simulate.trace import open_trace
from tests.live import start_kvlens

pytestmark = pytest.mark.integration
CONVERSATIONS = Path(__file__).resolve().parents[1] / "fixtures" / "kv-cache-tester"


def test_sessions_replayed_analyzed_and_compared(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    running = start_kvlens(
        "simulate",
        "serve",
        *("--speed", "1000", "--block-size", "16", "--max-model-len", "200000"),
        *("--capacity-blocks", "unbounded"),
        ready="/health",
    )
    base = ["--endpoint", running.url, "--model", "simulated", "--reset", "--think-scale", "0"]
    try:
        for arm in ("one", "two"):
            out = str(tmp_path / f"{arm}.jsonl")
            assert main(["replay", str(CONVERSATIONS), *base, "--arm", arm, "--out", out]) == 0
    finally:
        running.output()
    records = [json.loads(line) for line in (tmp_path / "one.jsonl").read_text().splitlines()]
    trace = open_trace(CONVERSATIONS)
    requests = list(trace.requests())
    assert [r["session_id"] for r in records] == [r.session for r in requests]
    theoretical = [tokens for _, tokens in served(requests, PrefixCache(None), trace.block_size)]
    assert [r["trace_reusable_tokens"] for r in records] == theoretical
    capsys.readouterr()
    assert main(["analyze", str(tmp_path / "one.jsonl"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["sessions"]
    run = report["run"]
    assert run["theoretical_token_reuse_ratio"] == sum(theoretical) / sum(r.prompt_tokens for r in requests)
    assert run["token_reuse_ratio"] == run["theoretical_token_reuse_ratio"]  # one unbounded replica
    assert report["sessions"] == len({r.session for r in requests}) == 5
    assert report["worst"][0]["session_id"] == "trace_0187"
    assert (
        main(["compare", "--arm", f"one={tmp_path / 'one.jsonl'}", "--arm", f"two={tmp_path / 'two.jsonl'}"])
        == 0
    )
    assert "- two: Token reuse delivered 88.9 % of a theoretical 88.9 %" in capsys.readouterr().out
