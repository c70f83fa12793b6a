"""``kvlens experiment prefix-cache`` against two real ``kvlens simulate serve`` (cache on, cache
off) on the built-in traffic, whose hits are known: the paired table's counts are recomputed
here from the arms' records, request by request, independently of kvlens's own code."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from kvlens.cli import main
from tests.json_outputs import validate
from tests.live import start_kvlens

pytestmark = pytest.mark.integration

EDGES = (512, 2048, 8192, 32768)  # the default prompt_length_edges
LABELS = ["0-511", "512-2047", "2048-8191", "8192-32767", "32768+"]


def records(path: Path) -> dict[str, dict[str, Any]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {row["request_id"]: row for row in rows}


def length_group(prompt_tokens: int) -> str:
    return LABELS[sum(prompt_tokens >= edge for edge in EDGES)]


def recount(
    off: dict[str, dict[str, Any]], arm: dict[str, dict[str, Any]], name: str
) -> list[dict[str, Any]]:
    """The paired rows as the records say: matched by request_id, failed requests out, grouped by
    the prompt length and the outcome in the arm, a change beyond max(1 ms, 5 % of the baseline)."""
    counts: Counter[tuple[str, str, str]] = Counter()
    for request_id, before in off.items():
        after = arm.get(request_id)
        if after is None or "ttft_seconds" not in before or "ttft_seconds" not in after:
            continue
        delta = after["ttft_seconds"] - before["ttft_seconds"]
        floor = max(0.001, 0.05 * before["ttft_seconds"])
        change = "waited_less" if delta < -floor else "waited_more" if delta > floor else "no_change"
        key = (length_group(before["prompt_tokens"]), "hit" if after["cached_tokens"] > 0 else "miss")
        counts[(*key, change)] += 1
        counts[(*key, "requests")] += 1
    rows = []
    for length in LABELS:
        for outcome in ("hit", "miss"):
            if counts[(length, outcome, "requests")]:
                rows.append(
                    {"arm": name, "length_group": length, "outcome": outcome}
                    | {
                        key: counts[(length, outcome, key)]
                        for key in ("requests", "waited_less", "no_change", "waited_more")
                    }
                )
    return rows


@pytest.mark.timeout(240)
def test_the_paired_counts_are_the_records_request_by_request(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    on = start_kvlens("simulate", "serve", "--speed", "4", "--block-size", "16", ready="/health")
    off = start_kvlens(
        "simulate", "serve", "--speed", "4", "--block-size", "16", "--no-prefix-caching", ready="/health"
    )
    try:
        code = main(
            [
                "experiment",
                "prefix-cache",
                "shared-prefix",  # the default system prompts: 256, 1,024 and 4,096 tokens
                "--endpoint",
                on.url,
                "--off-endpoint",
                off.url,
                "--model",
                "simulated",
                "--out-dir",
                str(tmp_path),
                "--requests",
                "48",
                "--traffic-rate",
                "16",
                "--percentiles",
                "50,90",
                "--json",
            ]
        )
    finally:
        on.output()
        off.output()
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    validate(report)
    paired = report["paired"]
    arms = {name: records(tmp_path / f"{name}.jsonl") for name in ("off", "cold", "warm")}
    assert all(row["cached_tokens"] == 0 for row in arms["off"].values())
    counted = ("arm", "length_group", "outcome", "requests", "waited_less", "no_change", "waited_more")
    got = [{key: group[key] for key in counted} for group in paired["groups"]]
    expected = recount(arms["off"], arms["cold"], "cold") + recount(arms["off"], arms["warm"], "warm")
    assert got == expected
    # the trace's known hits: after the warm-up every request reuses its group's system prompt,
    # so warm has only hit rows, one per prompt length (three by default); cold misses each
    # group's first request
    warm_rows = [g for g in got if g["arm"] == "warm"]
    assert [g["outcome"] for g in warm_rows] == ["hit"] * 3
    assert [g["length_group"] for g in warm_rows] == ["0-511", "512-2047", "2048-8191"]
    assert any(g["arm"] == "cold" and g["outcome"] == "miss" for g in got)
    assert sum(g["requests"] for g in warm_rows) == len(arms["warm"]) == 24
    # hits on 4,096 shared tokens at speed 4 are tens of ms faster: beyond any noise floor
    long_hit = next(g for g in paired["groups"] if g["arm"] == "warm" and g["length_group"] == "2048-8191")
    assert long_hit["waited_less"] == long_hit["requests"]
    assert long_hit["ci95"] is None or long_hit["ci95"][1] < 0
    # the requests that did not benefit: listed by id with the reason the records give
    for name in ("cold", "warm"):
        for item in paired["not_benefiting"][name]["listed"]:
            record = arms[name][item["request_id"]]
            assert item["cached_tokens"] == record["cached_tokens"]
            assert item["reason"] == ("hit_not_faster" if record["cached_tokens"] else "missed")
    assert paired["matching"]["warm"] == {
        "pairs": 24, "baseline_only": 0, "arm_only": 0, "without_request_id": 0,
        "duplicate_request_id": 0, "no_ttft": 0,
    }  # fmt: skip
