"""Every terminal output fits 80 columns without cutting a number: each is rendered at
COLUMNS=80 and every number of the same run's ``--json`` that the text shows must appear in it
whole (a token not glued to other digits), no line may pass 80 columns (a path longer than the
width keeps its own line), and nothing is cut with an ellipsis.

How the text rounds what the JSON holds (the rules each check formats the JSON numbers with):
counts with thousands separators (``1,107``); ratios as percentages, request hit and token reuse
of ``analyze`` with 2 decimals, compute saved with 3, shares and ``simulate``'s ratios with 1
(``27.7 %``); latencies of ``analyze`` and ``compare`` in ms with 1 decimal (``compare``'s
signed: ``-367.1``, ``[+0.0, +2.0]``); ``simulate``'s TTFT in s with 2 decimals; ``bandwidth``'s
step times in ms with 2 decimals, speedups ``2.67x``, tokens per second with 1 decimal.
"""

from __future__ import annotations

import gzip
import json
import re
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from kvlens.cli import main
from kvlens.cli.demo import banner, print_summary
from kvlens.config import load_settings
from kvlens.exporter.aggregator import Aggregator
from kvlens.records import batch_from_objects
from kvlens.simulate import demo
from kvlens.simulate.trace import BUNDLED

ANSI = re.compile(r"\x1b\[[0-9;]*m")
H200 = Path(__file__).resolve().parent.parent / "fixtures" / "h200"


def fits(text: str, columns: int = 80) -> None:
    assert "…" not in text and "..." not in text, text
    for line in text.splitlines():
        assert len(line) <= columns or len(line.split()) == 1, f"{len(line)} columns: {line!r}"


def missing(tokens: list[str], text: str) -> list[str]:
    """The tokens that do not appear whole in ``text``."""
    return [t for t in tokens if not re.search(rf"(?<![\w.,]){re.escape(t)}(?![\w.]|,\d)", text)]


def pct(value: float | None, digits: int) -> str:
    return "n/a" if value is None else f"{100 * value:.{digits}f}"


def ms(value: float | None) -> str:
    return "n/a" if value is None else f"{1000 * value:.1f}"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(list(argv)) == 0
    out = capsys.readouterr().out
    return ANSI.sub("", out)


@pytest.fixture
def narrow(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")


# -- analyze -------------------------------------------------------------------------------------


@pytest.fixture
def records(tmp_path: Path) -> Path:
    """Long waits (TTFT p99 of minutes: 7-digit milliseconds), every prompt-length group, a model
    name longer than its column."""
    rows = []
    for i in range(60):
        rows.append(
            {
                "model": "meta-llama/Llama-3.1-70B-Instruct-FP8" if i % 3 else "m",
                "prompt_tokens": 300 * 2 ** (i % 8),
                "cached_tokens": 256 * (i % 2),
                "ttft_seconds": 0.1 + 61.2345 * i,
                "queue_seconds": 0.05 + 40.5 * i,
                "prefill_seconds": 0.01 + 0.77 * i,
            }
        )
    path = tmp_path / "records.jsonl"
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return path


def analyze_numbers(report: dict[str, Any]) -> list[str]:
    tokens = []
    for group in report["groups"]:
        tokens.append(f"{group['requests']:,}")
        tokens += [pct(group[f"share_of_{k}"], 1) for k in ("requests", "tokens", "work")]
        tokens += [ms(group[s][p]) for s in ("ttft_seconds", "queue_seconds", "prefill_seconds")
                   for p in ("p50", "p95", "p99")]  # fmt: skip
    for model in [report["overall"], *report["models"].values()]:
        tokens += [
            f"{model['requests']:,}",
            pct(model["request_hit_ratio"], 2),
            pct(model["token_reuse_ratio"], 2),
        ]
        tokens.append(pct(model["compute_saved_ratio"], 3))
    return tokens


def test_analyze_at_80_columns(narrow: None, records: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = json.loads(run(capsys, "analyze", str(records), "--json"))
    text = run(capsys, "analyze", str(records))
    fits(text)
    assert missing(analyze_numbers(report), text) == []
    assert "prompt_len" in text and "meta-llama/Llama-3.1-70B-Instruct-FP8" in text.replace("│\n│", "")


def test_analyze_on_a_wide_terminal_shows_one_row_per_group(
    monkeypatch: pytest.MonkeyPatch, records: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    report = json.loads(run(capsys, "analyze", str(records), "--json"))
    text = run(capsys, "analyze", str(records))
    fits(text, 200)
    assert missing(analyze_numbers(report), text) == []
    first = report["groups"][0]
    row = next(line for line in text.splitlines() if f" {first['prompt_len']} " in line)
    assert missing([ms(first["ttft_seconds"]["p99"]), ms(first["prefill_seconds"]["p99"])], row) == []


# -- simulate ------------------------------------------------------------------------------------


def test_simulate_at_80_columns(narrow: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "trace.jsonl"
    with gzip.open(BUNDLED, "rt") as bundled:
        trace.write_text("".join(line for _, line in zip(range(300), bundled, strict=False)))
    argv = ["simulate", str(trace), "--capacity-blocks", "50,unbounded", "--policy", "round_robin",
            "--policy", "prefix_affinity"]  # fmt: skip
    result = json.loads(run(capsys, *argv, "--json"))
    text = run(capsys, *argv)
    fits(text)
    tokens = [f"{result['trace']['requests']:,}", f"{result['trace']['prompt_tokens']:,}"]
    tokens += [pct(result["reachable"][k], 1) for k in ("token_reuse_ratio", "request_hit_ratio")]
    for block in result["capacities"]:
        tokens.append(pct(block["pooled"]["token_reuse_ratio"], 1))
        for policy in block["policies"]:
            tokens += [
                pct(policy[k], 1) for k in ("request_hit_ratio", "token_reuse_ratio", "compute_saved_ratio")
            ]
            tokens += [f"{policy['ttft_seconds'][p]:.2f}" for p in ("p50", "p95", "p99")]
            tokens += [pct(policy["queue_share_of_ttft"], 0), f"{policy['load_imbalance']:.2f}"]
            tokens += [pct(policy["token_reuse_gap"][k], 1) for k in ("capacity", "routing")]
    assert missing(tokens, text) == []


# -- bandwidth -----------------------------------------------------------------------------------


def test_bandwidth_model_at_80_columns(narrow: None, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bandwidth", "--params", "70B", "--layers", "80", "--kv-heads", "8", "--head-dim", "128",
            "--bandwidth", "4.8TB/s", "--batch", "1,64,1024", "--context", "8192,131072"]  # fmt: skip
    result = json.loads(run(capsys, *argv, "--json"))
    text = run(capsys, *argv)
    fits(text)
    tokens = [f"{result['break_even_extra_seconds'] * 1000:.2f}"]
    for step in result["steps"]:
        tokens += [str(step["batch"]), str(step["context_tokens"]), f"{step['speedup']:.2f}x"]
        tokens += [f"{step[k] * 1000:.2f}" for k in ("step_seconds_16", "step_seconds_quantized")]
        tokens += [f"{step[k]:.1f}" for k in ("tokens_per_second_16", "tokens_per_second_quantized")]
        tokens.append(f"{100 * step['weight_share_16']:.1f}%")
    assert missing(tokens, text) == []


def test_bandwidth_measured_at_80_columns(narrow: None, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bandwidth", "--measured", str(H200 / "decode_h200.csv"), "--batch", "1,8,32"]
    result = json.loads(run(capsys, *argv, "--json"))
    text = run(capsys, *argv)
    fits(text)
    tokens = []
    for path in result["paths"]:
        tokens += [f"{path['t0_seconds'] * 1000:.3f}", f"{path['bandwidth_bytes_per_second'] / 1e12:.2f}"]
        tokens.append(str(path["measured_steps"]))
    for comparison in result["comparisons"]:
        tokens.append(f"{comparison['break_even_extra_seconds'] * 1000:.3f}")
        for row in comparison["rows"]:
            tokens += [str(row["batch"]), str(row["context_tokens"]), f"{row['extra_seconds'] * 1000:.3f}"]
            tokens += [f"{row[k]:.2f}x" for k in ("fitted_speedup", "bytes_upper_bound")]
            if row["measured_speedup"] is not None:
                tokens.append(f"{row['measured_speedup']:.2f}x")
    assert missing(tokens, text) == []


# -- compare -------------------------------------------------------------------------------------


@pytest.fixture
def arms(tmp_path: Path) -> list[str]:
    """Two arms of one sequence: ``warm`` reuses and waits less, by up to minutes."""
    rows = []
    for arm, cached, wait in (("cold", 0, 61.7), ("a-rather-long-arm-name", 256, 0.3)):
        rows += [
            {
                "arm": arm,
                "prompt_tokens": 300 * 2 ** (i % 7),
                "cached_tokens": cached * (i % 3 > 0),
                "ttft_seconds": 0.2 + wait * (i % 5),
                "prefill_seconds": 0.01 * (i % 4 + 1),
            }
            for i in range(80)
        ]
    path = tmp_path / "arms.jsonl"
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return ["compare", "--arm", f"cold={path}", "--arm", f"a-rather-long-arm-name={path}", "--warmup", "10"]


def test_compare_at_a_terminal_is_a_table_of_80_columns(
    narrow: None, arms: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    result = json.loads(run(capsys, *arms, "--json"))
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    text = run(capsys, *arms)
    assert not text.startswith("# kvlens compare") and "|---|" not in text  # a table, not Markdown
    fits(text)
    tokens = [f"{summary['requests']:,}" for summary in result["warmup"].values()]
    for group in result["groups"]:
        tokens.append(f"{group['requests']:,}")
        for metrics in group["arms"].values():
            for stats in metrics.values():
                if not stats.get("count"):  # not measured in both arms: no row
                    continue
                for q in (f"p{q:g}" for q in result["percentiles"]):
                    tokens.append(f"{stats[q]['delta'] * 1000:+.1f}")
                    tokens += [f"[{stats[q]['ci95'][0] * 1000:+.1f},", f"{stats[q]['ci95'][1] * 1000:+.1f}]"]
    for info in result["not_benefiting"].values():
        tokens += [
            f"{info['requests']:,}",
            f"{100 * info['share']:.1f}%",
            str(info["of_which_reused_nothing"]),
        ]
    assert missing(tokens, text) == []


def test_compare_into_a_pipe_or_with_markdown_is_markdown(
    arms: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(capsys, *arms).startswith("# kvlens compare (baseline: cold)\n")  # stdout: not a terminal
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    assert run(capsys, *arms, "--markdown").startswith("# kvlens compare (baseline: cold)\n")


# -- demo ----------------------------------------------------------------------------------------


def test_demo_summary_line_and_banner_fit_80_columns(capsys: pytest.CaptureFixture[str]) -> None:
    aggregator = Aggregator(load_settings(None))
    aggregator.add(batch_from_objects([{"prompt_tokens": 1000, "cached_tokens": 1000}] * 3), demo.SOURCE)
    print_summary(aggregator, sys.stdout)
    line = capsys.readouterr().out
    fits(line)
    assert missing(["3", "100.0", "100.00", "100.000"], line) == []
    what = (
        "the Mooncake trace (kvcache-ai/Mooncake, Apache-2.0) replayed 40x faster by the simulator on 4 "
        "replicas of 1,000 cache blocks, routed by prefix_affinity"
    )
    text = banner(what, "http://[2001:db8::1]:9433", 80)
    fits(text)
    assert missing(["40x", "1,000", "128", "16"], text) == [] and "http://[2001:db8::1]:9433/metrics" in text
