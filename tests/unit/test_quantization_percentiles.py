"""The quantization report's latency at each --percentiles: TTFT, TPOT (a request's mean
inter-token latency) and e2e over the finished requests, and its table within 80 columns."""

from __future__ import annotations

import numpy as np

from kvlens.experiment import quantization_report
from kvlens.experiment.quantization_text import percentile_lines
from kvlens.terminal import NARROWEST


def records() -> list[dict[str, object]]:
    rows: list[dict[str, object]] = [
        {"ttft_seconds": t / 1000, "client_tpot_seconds": t / 10_000, "e2e_seconds": t / 100}
        for t in range(1, 11)
    ]
    rows.append({"error": "http_500"})  # a failed request enters no percentile
    return rows


def test_each_percentile_of_each_metric_over_the_finished_requests() -> None:
    row = quantization_report.latency(records(), (50.0, 90.0, 99.9))
    ttft = np.arange(1, 11) / 1000
    assert row["requests"] == 11 and row["errors"] == 1
    assert row["latency_percentiles"]["ttft_seconds"] == {
        "p50": float(np.percentile(ttft, 50)),
        "p90": float(np.percentile(ttft, 90)),
        "p99.9": float(np.percentile(ttft, 99.9)),
    }
    tpot, e2e = np.arange(1, 11) / 10_000, np.arange(1, 11) / 100
    assert row["latency_percentiles"]["tpot_seconds"]["p50"] == float(np.percentile(tpot, 50))
    assert row["latency_percentiles"]["e2e_seconds"]["p90"] == float(np.percentile(e2e, 90))


def test_no_finished_request_gives_none_not_a_number() -> None:
    row = quantization_report.latency([{"error": "timeout"}], (50.0, 99.0))
    assert row["latency_percentiles"]["ttft_seconds"] == {"p50": None, "p99": None}


def test_the_table_has_a_row_per_metric_and_a_column_per_percentile_within_80_columns() -> None:
    percentiles = (50.0, 90.0, 95.0, 99.0)
    row = quantization_report.latency(records(), percentiles)
    lines = percentile_lines("T", [("bf16        short  ", row)], {"percentiles": list(percentiles)})
    assert lines[:3] == ["T", "", " " * 24 + "     p50     p90     p95     p99"]
    ttft_ms = [f"{np.percentile(np.arange(1, 11) / 1000, q) * 1000:.1f}" for q in percentiles]
    assert lines[3].split() == ["bf16", "short", "TTFT", *ttft_ms]
    assert [line.split()[2] for line in lines[3:6]] == ["TTFT", "TPOT", "e2e"]
    assert max(len(line) for line in lines) <= NARROWEST


def test_ten_percentiles_go_on_in_a_second_block_within_80_columns() -> None:
    percentiles = (1.0, 5.0, 10.0, 25.0, 50.0, 75.0, 90.0, 95.0, 99.0, 99.9)
    row = quantization_report.latency(records(), percentiles)
    lines = percentile_lines("T", [("bf16        short  ", row)], {"percentiles": list(percentiles)})
    headers = [line.split() for line in lines if line.lstrip().startswith("p")]
    assert [name for header in headers for name in header] == [f"p{q:g}" for q in percentiles]
    assert len(headers) == 2
    assert max(len(line) for line in lines) <= NARROWEST
