"""The paired answer of ``kvlens compare`` (requests matched by request_id; who waited less, by
how much, who did not benefit and why), its statistics (noise floor, the distribution-free
interval of the median) and ``--percentiles``, on hand-made records whose answer is known."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from kvlens import stats
from kvlens.analysis import per_request
from kvlens.cli import main
from tests.json_outputs import validate

ENGINES = ["numpy", pytest.param("duckdb", marks=pytest.mark.skipif(
    __import__("importlib").util.find_spec("duckdb") is None, reason="duckdb"))]  # fmt: skip


def test_interval_ranks_are_the_binomial_tables() -> None:
    # the classic table of the median's interval at 95 % (1-based ranks 2-9 of 10, 6-15 of 20, 40-61 of 100)
    assert stats.interval_ranks(10) == (1, 8)
    assert stats.interval_ranks(20) == (5, 14)
    assert stats.interval_ranks(100) == (39, 60)
    assert stats.interval_ranks(6) == (0, 5)  # the extremes cover with 1 - 2/64 = 96.9 %
    assert [stats.interval_ranks(n) for n in range(6)] == [None] * 6  # no pair of ranks reaches 95 %
    # the normal approximation past EXACT_RANKS_UP_TO takes over within one rank of the exact
    exact = stats.interval_ranks(stats.EXACT_RANKS_UP_TO)
    approximate = stats.interval_ranks(stats.EXACT_RANKS_UP_TO + 1)
    assert exact is not None and approximate is not None and abs(exact[0] - approximate[0]) <= 1


def test_median_interval_of_values() -> None:
    median, interval = stats.median_interval(np.arange(10, dtype=np.float64)[::-1].copy())
    assert (median, interval) == (4.5, [1.0, 8.0])
    assert stats.median_interval(np.array([1.0, 2.0])) == (1.5, None)
    assert stats.median_interval(np.array([], dtype=np.float64)) == (None, None)


def test_the_noise_floor_is_one_ms_or_five_percent_of_the_baseline() -> None:
    before = np.array([0.010, 0.010, 0.010, 0.100, 0.100, 0.100, 0.100])
    after = np.array([0.0089, 0.0091, 0.0111, 0.094, 0.096, 0.106, 0.104])
    # 10 ms: the floor is 1 ms (5 % is 0.5 ms); 100 ms: the floor is 5 ms
    assert stats.classify(before, after).tolist() == [-1, 0, 1, -1, 0, 1, 0]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "comma-separated numbers"),
        ("50,,90", "comma-separated numbers"),
        ("fifty", "'fifty' is not a number"),
        ("0,50", "above 0 and below 100, not 0"),
        ("50,100", "above 0 and below 100, not 100"),
        ("nan", "above 0 and below 100, not nan"),
        ("90,50", "ascending order: 50,90"),
        ("50,90,50", "percentile 50 is given twice"),
        (",".join(str(q) for q in range(1, 12)), "at most 10 percentiles, not 11"),
    ],
)
def test_percentiles_refused_with_the_rule(
    text: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ValueError, match=message):
        stats.parse_percentiles(text)
    with pytest.raises(SystemExit) as exit_:
        main(["compare", "--arm", "a=x.jsonl", "--arm", "b=x.jsonl", "--percentiles", text])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "kvlens compare: error: argument --percentiles: " in err and message in err


def test_percentiles_parsed() -> None:
    assert stats.parse_percentiles(" 50, 90,99.9") == (50.0, 90.0, 99.9)
    assert [stats.percentile_name(q) for q in (50.0, 99.9)] == ["50", "99.9"]


def arms_of_known_answer() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """10 requests of 600 tokens (group 512-2047), then 2 of 3,000 (2048-8191): in warm, r0-r4
    hit and waited 40 ms less, r5-r6 missed and waited the same, r7 hit (256 tokens) and was
    not faster, r8 failed in warm (no TTFT), r9 is in off only; r10 hit and waited less, r11
    missed and waited 20 ms more."""
    off, warm = [], []
    for i in range(12):
        n = 600 if i < 10 else 3000
        off.append({"request_id": f"trace-{i}", "prompt_tokens": n, "cached_tokens": 0, "ttft_seconds": 0.1})
        cached, ttft = {
            0: (512, 0.06), 1: (512, 0.06), 2: (512, 0.06), 3: (512, 0.06), 4: (512, 0.06),
            5: (0, 0.1), 6: (0, 0.1003), 7: (256, 0.1), 8: (512, None), 10: (2048, 0.05), 11: (0, 0.12),
        }.get(i, (0, 0.1))  # fmt: skip
        if i == 9:
            continue  # lost in warm: only in off
        record: dict[str, Any] = {"request_id": f"trace-{i}", "prompt_tokens": n, "cached_tokens": cached}
        if ttft is not None:
            record["ttft_seconds"] = ttft
        warm.append(record)
    return off, warm


def timed(rows: list[dict[str, Any]]) -> per_request.Timed:
    return per_request.Timed(
        [r["request_id"] for r in rows],
        np.array([1 if r["prompt_tokens"] < 2048 else 2 for r in rows], dtype=np.intp),
        np.array([r["prompt_tokens"] for r in rows], dtype=np.int64),
        np.array([r["cached_tokens"] for r in rows], dtype=np.int64),
        np.array([r.get("ttft_seconds", np.nan) for r in rows], dtype=np.float64),
    )


def test_pairs_by_request_id_never_by_position() -> None:
    off, warm = arms_of_known_answer()
    labels = ["0-511", "512-2047", "2048-8191"]
    in_order = per_request.compare(["off", "warm"], [timed(off), timed(warm)], labels, (50.0, 90.0))
    shuffled = [warm[i] for i in np.random.default_rng(3).permutation(len(warm))]
    assert (
        per_request.compare(["off", "warm"], [timed(off), timed(shuffled)], labels, (50.0, 90.0)) == in_order
    )
    duplicated = [*warm, {**warm[0], "ttft_seconds": 0.2}]  # which copy pairs is unknown: neither
    section = per_request.compare(["off", "warm"], [timed(off), timed(duplicated)], labels, (50.0,))
    assert section["matching"]["warm"]["duplicate_request_id"] == 1
    assert section["groups"][0]["requests"] == 5  # r1-r4 and r7: r0 left out, r8 failed
    assert in_order["matching"]["warm"]["baseline_only"] == 1  # r9, lost in warm


def expected_groups() -> list[dict[str, Any]]:
    base = {"arm": "warm"}
    return [
        {**base, "length_group": "512-2047", "outcome": "hit", "requests": 6, "waited_less": 5,
         "no_change": 1, "waited_more": 0},
        {**base, "length_group": "512-2047", "outcome": "miss", "requests": 2, "waited_less": 0,
         "no_change": 2, "waited_more": 0},
        {**base, "length_group": "2048-8191", "outcome": "hit", "requests": 1, "waited_less": 1,
         "no_change": 0, "waited_more": 0},
        {**base, "length_group": "2048-8191", "outcome": "miss", "requests": 1, "waited_less": 0,
         "no_change": 0, "waited_more": 1},
    ]  # fmt: skip


@pytest.mark.parametrize("engine", ENGINES)
def test_the_paired_table_of_known_records(
    engine: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    off, warm = arms_of_known_answer()
    warm_padded = [*warm[:9], {"request_id": "trace-9", "prompt_tokens": 600, "cached_tokens": 0}, *warm[9:]]
    files = []
    for name, rows in (("off", off), ("warm", warm_padded)):
        path = tmp_path / f"{name}.jsonl"
        path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
        files += ["--arm", f"{name}={path}"]
    assert main(["compare", *files, "--json", "--engine", engine, "--percentiles", "50,90"]) == 0
    result = json.loads(capsys.readouterr().out)
    validate(result)
    paired = result["paired"]
    assert paired["percentiles"] == [50, 90] and result["percentiles"] == [50, 90]
    counted = ("arm", "length_group", "outcome", "requests", "waited_less", "no_change", "waited_more")
    assert [{key: g[key] for key in counted} for g in paired["groups"]] == expected_groups()
    # r9 has no TTFT in warm here (the record kept, its TTFT absent), r8 failed: both left out
    assert paired["matching"]["warm"] == {
        "pairs": 10, "baseline_only": 0, "arm_only": 0, "without_request_id": 0,
        "duplicate_request_id": 0, "no_ttft": 2,
    }  # fmt: skip
    hit = paired["groups"][0]
    assert hit["median_delta_seconds"] == pytest.approx(-0.04)
    assert hit["ci95"] == [pytest.approx(-0.04), pytest.approx(0.0)]  # ranks 0 and 5 of 6
    assert (hit["baseline_median_seconds"], hit["arm_median_seconds"]) == (0.1, pytest.approx(0.06))
    assert hit["relative_change"] == pytest.approx(-0.4)
    assert set(hit["ttft"]) == {"p50", "p90"}
    assert paired["groups"][1]["ci95"] is None  # two requests: too few for an interval
    assert paired["not_benefiting"]["warm"]["missed"] == 3
    assert paired["not_benefiting"]["warm"]["hit_not_faster"] == 1
    listed = [
        (r["request_id"], r["reason"], r["cached_tokens"]) for r in paired["not_benefiting"]["warm"]["listed"]
    ]
    assert listed == [
        ("trace-5", "missed", 0), ("trace-6", "missed", 0), ("trace-7", "hit_not_faster", 256),
        ("trace-11", "missed", 0),
    ]  # fmt: skip
    # every rendering shows the baseline -> arm values, not the deltas alone
    assert main(["compare", *files, "--markdown", "--engine", engine, "--percentiles", "50,90"]) == 0
    text = capsys.readouterr().out
    assert text.index("## Which requests waited less (paired by request)") < text.index("## By prompt length")
    row = "| warm | 512-2047 | hit | 6 | 5 | 1 | 0 | -40.0 [-40.0, +0.0] | 100.0 -> 60.0 (-40%) |"
    assert row + " 100.0 -> 80.0 (-20%) |" in text
    assert "| warm | trace-7 | 512-2047 | hit but not faster | 256 | 100.0 -> 100.0 |" in text
    assert "warm vs off: 10 requests paired (2 without TTFT in one arm (failed) left out)" in text
    assert "| 512-2047 | miss | 10 | warm | ttft | 100.0 -> 60.0, -40.0 [" in text


def test_html_shows_the_paired_table_first(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.unit.test_html_report import parse

    off, warm = arms_of_known_answer()
    files = []
    for name, rows in (("off", off), ("warm", [r for r in warm if r["request_id"] != "trace-9"])):
        path = tmp_path / f"{name}.jsonl"
        path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
        files += ["--arm", f"{name}={path}"]
    off_only = [r for r in off if r["request_id"] != "trace-9"]
    (tmp_path / "off.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in off_only))
    page_path = tmp_path / "page.html"
    assert main(["compare", *files, "--html", str(page_path), "--json"]) == 0
    capsys.readouterr()
    page = page_path.read_text()
    assert page.index('id="paired"') < page.index("By prompt length and cache status in the baseline")
    (tables,) = parse(page).find(id="tables")
    first = tables.find("table")[0]
    heads = [" ".join(n.all_text().split()) for n in first.find("th")]
    assert heads[:8] == [
        "arm", "prompt_len", "outcome (arm)", "requests", "waited less", "no clear change", "waited more",
        "median change ms [95 % CI]",
    ]  # fmt: skip
    assert heads[8:] == ["p50 ms off -> arm", "p90 ms off -> arm", "p95 ms off -> arm", "p99 ms off -> arm"]
    cells = [" ".join(n.all_text().split()) for n in first.find("tbody")[0].find("tr")[0].find("td")]
    assert cells[:7] == ["warm", "512-2047", "hit", "6", "5", "1", "0"] and cells[8] == "100.0 -> 60.0 (-40%)"


def test_the_built_in_traffic_spans_three_prompt_length_groups_by_default() -> None:
    from kvlens.config import Settings
    from kvlens.definitions import prompt_length_bucket
    from kvlens.experiment.run import SharedPrefixTraffic

    trace = SharedPrefixTraffic().trace()
    lengths = [r.prompt_tokens for r in trace]
    assert sorted(set(lengths)) == [384, 1152, 4224]  # 256, 1,024, 4,096 shared + 128 own
    assert set(prompt_length_bucket(lengths, Settings().prompt_length_edges).tolist()) == {0, 1, 2}
    assert SharedPrefixTraffic().trace() == trace  # the seed decides
    assert {r.prompt_tokens for r in SharedPrefixTraffic(prefix_tokens=(512,)).trace()} == {640}
