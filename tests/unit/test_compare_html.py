"""``kvlens compare --html``: the page, written by the real command from records files and parsed
back, says what the same run's ``--json`` says: the verdict first, then the context, one delta
chart per metric with its interval, the table with reuse beside the deltas, and that reuse is
not speedup."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import orjson
import pytest

from kvlens.cli import main
from tests.unit.test_html_report import Node, parse

MISS, HIT = "#D55E00", "#0072B2"


def arm_records(prefill_ms: list[float], cached: list[int], queue: float) -> list[dict[str, Any]]:
    """40 requests alternating 1,024 and 4,096 tokens, the first 8 the warm-up."""
    rows = []
    for i in range(40):
        n = 1024 if i % 2 else 4096
        p = prefill_ms[i % 2] * (1 + 0.02 * (i % 5)) / 1000
        rows.append(
            {
                "request_id": f"r{i}",
                "model": "m",
                "prompt_tokens": n,
                "cached_tokens": min(cached[i % 2], n - 1),
                "prefill_seconds": p,
                "queue_seconds": queue * (1 + 0.1 * (i % 3)),
                "ttft_seconds": queue * (1 + 0.1 * (i % 3)) + p,
                "arrival_time": 1_800_000_000 + i,
            }
        )
    return rows


def write(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("compare")


@pytest.fixture(scope="module", params=["numpy", "duckdb"])
def run(folder: Path, request: pytest.FixtureRequest) -> tuple[dict[str, Any], str, Node]:
    """One run of the command by each engine for every test here (the bootstrap takes a while)."""
    if request.param == "duckdb":
        pytest.importorskip("duckdb")
    tmp_path = folder  # the same files for both (the page names them)
    off = arm_records([40.0, 160.0], [0, 0], 0.010)
    warm = arm_records([15.0, 30.0], [768, 3584], 0.010)
    warm[21] = {**warm[21], "ttft_seconds": 0.5, "cached_tokens": 0}  # one that did not benefit
    files = [f"off={write(tmp_path / 'off.jsonl', off)}", f"warm={write(tmp_path / 'warm.jsonl', warm)}"]
    out = tmp_path / "compare.html"
    args = ["compare", "--arm", files[0], "--arm", files[1], "--warmup", "8", "--html", str(out), "--json"]
    args += ["--engine", request.param]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(args) == 0
    result = json.loads(printed.getvalue())
    page = out.read_text()
    return result, page, parse(page)


OFF_TTFT_21 = 0.010 * (1 + 0.1 * (21 % 3)) + 0.160 * (1 + 0.02 * (21 % 5))


def values(stats: dict[str, Any]) -> str:
    """A cell of the groups' table: baseline -> arm in ms, the change and its interval."""
    return f"{stats['baseline'] * 1000:.1f} -> {stats['arm'] * 1000:.1f}, {ms(stats)}"


def ms(stats: dict[str, Any]) -> str:
    low, high = stats["ci95"]
    return f"{stats['delta'] * 1000:+.1f} [{low * 1000:+.1f}, {high * 1000:+.1f}]"


def texts(node: Node, tag: str) -> list[str]:
    return [" ".join(n.all_text().split()) for n in node.find(tag)]


def test_verdict_context_charts_table_and_caveat_in_that_order(
    run: tuple[dict[str, Any], str, Node],
) -> None:
    result, page, tree = run
    order = [page.index(f'id="{anchor}"') for anchor in ("verdict", "context", "deltas", "tables", "caveat")]
    assert order == sorted(order)
    assert page.index('id="context"') < page.index("<svg") and page.index("</svg>") < page.index("<table")
    (caveat,) = tree.find(id="caveat")
    assert caveat.all_text() == (
        "Reuse is not speedup: cached tokens save prefill work, and TTFT falls only where prefill, "
        "not queueing, was the wait."
    )
    assert "<script" not in page and "http" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    (data,) = tree.find("pre", id="report-data")
    assert json.loads(data.all_text()) == result


def test_the_verdict_says_per_group_which_arm_is_faster_by_how_much(
    run: tuple[dict[str, Any], str, Node],
) -> None:
    result, _, tree = run
    (verdict,) = tree.find(id="verdict")
    short, long = result["groups"]  # in the default edges' order
    assert [g["prompt_len"] for g in (short, long)] == ["512-2047", "2048-8191"]
    assert (short["requests"], long["requests"]) == (16, 16)
    expected = []
    for group in (short, long):
        ttft, reuse = group["arms"]["warm"]["ttft_seconds"]["p50"], group["reuse"]["warm"]
        assert ttft["ci95"][1] < 0  # faster, and the sentence must say so
        expected.append(
            f"warm vs off, {group['prompt_len']} tokens, miss in off (16 requests): faster, "
            f"median TTFT {ms(ttft)} ms; warm reused {100 * reuse['token_reuse_ratio']:.1f} % of the "
            f"prompt tokens, compute saved {100 * reuse['compute_saved_ratio']:.2f} %"
        )
    lines = texts(verdict, "li")
    assert lines[:2] == expected
    assert result["not_benefiting"]["warm"]["requests"] == 1
    assert lines[2] == "warm: 1 timed requests (3.1%) were not faster than off; 1 of them reused nothing"
    # the request itself, in the table of those that did not benefit
    assert texts(tree.find(id="tables")[0].find("tbody")[-1], "td")[:5] == ["warm", "22", "r21", "1,024", "0"]
    # and in the paired table's list, with its reason
    listed = texts(tree.find(id="tables")[0].find("tbody")[1], "td")
    assert listed == [
        "warm",
        "r21",
        "512-2047",
        "missed in this arm",
        "0",
        f"{1000 * OFF_TTFT_21:.1f} -> 500.0",
    ]


def test_context_names_arms_files_records_and_warmup(
    run: tuple[dict[str, Any], str, Node], folder: Path
) -> None:
    tmp_path = folder
    _, _, tree = run
    (context,) = tree.find(id="context")
    terms = texts(context, "dt")
    values = texts(context, "dd")
    assert terms == ["Arms", "Files", "Records per arm", "Warm-up excluded"]
    assert values[0] == "off, warm (baseline: off)"
    assert values[2] == "40 (the same requests in the same order in every arm)"
    assert texts(context, "li") == [
        f"off: {tmp_path / 'off.jsonl'}",
        f"warm: {tmp_path / 'warm.jsonl'}",
        "off: 8 requests kept out of the timed window",
        "warm: 8 requests kept out of the timed window",
    ]


def test_one_chart_per_metric_with_each_groups_delta_and_interval(
    run: tuple[dict[str, Any], str, Node],
) -> None:
    result, _, tree = run
    (deltas,) = tree.find(id="deltas")
    charts = deltas.find("svg")
    assert [c.attrs["role"] for c in charts] == ["img"] * 3
    assert [c.attrs["aria-label"].split(":")[0] for c in charts] == [
        "Time to first token",
        "Queue time",
        "Prefill time",
    ]
    for chart, metric in zip(charts, ("ttft_seconds", "queue_seconds", "prefill_seconds"), strict=True):
        rows = chart.find("g", **{"class": "delta"})
        assert [(r.attrs["data-length"], r.attrs["data-arm"]) for r in rows] == [
            (g["prompt_len"], "warm") for g in result["groups"]
        ]
        zero = next(float(line.attrs["x1"]) for line in chart.find("line") if line.attrs.get("y1") == "26")
        for row, group in zip(rows, result["groups"], strict=True):
            p50 = group["arms"]["warm"][metric]["p50"]
            assert row.attrs["data-fill"] == MISS  # every group missed in the off arm
            assert texts(row, "text")[-1] == f"{ms(p50)} ms"
            (dot,) = row.find("circle")
            (whisker,) = row.find("line")
            low, high = float(whisker.attrs["x1"]), float(whisker.attrs["x2"])
            assert low <= float(dot.attrs["cx"]) <= high
            if p50["ci95"][1] < 0:
                assert high < zero  # the whole interval left of zero: faster
    queue = result["groups"][0]["arms"]["warm"]["queue_seconds"]["p50"]
    assert queue["delta"] == 0.0  # the same queueing in both arms: no speedup to show there


def test_the_table_has_reuse_and_compute_saved_beside_each_delta(
    run: tuple[dict[str, Any], str, Node],
) -> None:
    result, _, tree = run
    (tables,) = tree.find(id="tables")
    table = tables.find("table")[2]  # after the paired table and its list of who did not benefit
    assert texts(table, "th") == [
        "prompt_len",
        "cache (baseline)",
        "requests",
        "arm",
        "metric",
        *(f"p{q} ms off -> arm, change [95 % CI]" for q in (50, 90, 95, 99)),
        "token reuse (arm)",
        "compute saved (arm)",
    ]
    expected = []
    for group in result["groups"]:
        reuse = group["reuse"]["warm"]
        for metric in ("ttft", "queue", "prefill"):
            stats = group["arms"]["warm"][f"{metric}_seconds"]
            expected.append(
                [
                    group["prompt_len"],
                    "miss",
                    "16",
                    "warm",
                    metric,
                    *(values(stats[f"p{q}"]) for q in (50, 90, 95, 99)),
                    f"{100 * reuse['token_reuse_ratio']:.1f} %",
                    f"{100 * reuse['compute_saved_ratio']:.2f} %",
                ]
            )
    assert [texts(row, "td") for row in table.find("tbody")[0].find("tr")] == expected
    assert result["groups"][0]["reuse"]["off"] == {"token_reuse_ratio": 0.0, "compute_saved_ratio": 0.0}


def test_an_unwritable_html_path_is_refused_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    off = write(tmp_path / "off.jsonl", arm_records([40.0, 160.0], [0, 0], 0.01))
    missing = tmp_path / "no" / "such" / "page.html"
    assert main(["compare", "--arm", f"a={off}", "--arm", f"b={off}", "--html", str(missing)]) == 2
    assert "its folder does not exist" in capsys.readouterr().err


def test_metrics_a_client_cannot_see_are_said_missing_not_dropped(tmp_path: Path) -> None:
    """Replay records (client side) have TTFT but no queue or prefill time."""

    def client_side(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{k: v for k, v in r.items() if k not in ("queue_seconds", "prefill_seconds")} for r in rows]

    off = write(tmp_path / "off.jsonl", client_side(arm_records([40.0, 160.0], [0, 0], 0.01)))
    warm = write(tmp_path / "warm.jsonl", client_side(arm_records([15.0, 30.0], [768, 3584], 0.01)))
    out = tmp_path / "compare.html"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["compare", "--arm", f"off={off}", "--arm", f"warm={warm}", "--html", str(out)]) == 0
    missing = "not in these records (a client sees only TTFT; the sidecar's or the engine's records carry it)"
    assert f"- queue: {missing}\n- prefill: {missing}\n" in printed.getvalue()
    (deltas,) = parse(out.read_text()).find(id="deltas")
    assert [svg.attrs["aria-label"].split(":")[0] for svg in deltas.find("svg")] == ["Time to first token"]
    assert texts(deltas, "p") == [f"Queue time: {missing}.", f"Prefill time: {missing}."]
