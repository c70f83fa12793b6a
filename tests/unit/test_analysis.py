"""kvlens analyze: the article's golden numbers, bad and mixed input, groups, diagnosis in the
troubleshooting order, calibration (compare: tests/unit/test_compare_engines.py)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
import yaml

from kvlens.analysis import calibration, html_report, render
from kvlens.analysis.analyze import analyze
from kvlens.analysis.report import Derived
from kvlens.cli import main
from kvlens.config import load_settings
from kvlens.records import batch_from_objects
from tests.article import article_records
from tests.unit.test_formats import SGLANG_LINE


def write(path: Path, records: list[Any], extra: bytes = b"") -> Path:
    path.write_bytes(b"\n".join(orjson.dumps(r) for r in records) + b"\n" + extra)
    return path


def run_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["analyze", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


def test_article_golden_numbers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = run_json(capsys, str(write(tmp_path / "article.jsonl", article_records())))
    overall = report["overall"]
    assert report["schema"] == "kvlens.analyze/v1"
    assert (overall["requests"], overall["prompt_tokens"], overall["cached_tokens"]) == (100, 93_440, 1_440)
    assert f"{100 * overall['request_hit_ratio']:.2f}" == "90.00"
    assert f"{100 * overall['token_reuse_ratio']:.2f}" == "1.54"
    assert f"{100 * overall['compute_saved_ratio']:.3f}" == "0.344"
    markdown = render.markdown(report)
    assert "90.00 %" in markdown and "1.54 %" in markdown and "0.344 %" in markdown


def test_groups_shares_and_exact_percentiles(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = run_json(capsys, str(write(tmp_path / "a.jsonl", article_records())))
    (short, long) = report["groups"]
    assert (short["prompt_len"], short["cache"], short["requests"]) == ("0-511", "hit", 90)
    assert short["share_of_requests"] == pytest.approx(0.9)
    assert short["share_of_tokens"] == pytest.approx(11_520 / 93_440)
    assert long["share_of_work"] == pytest.approx(409_640 / 421_885.625)
    assert long["ttft_seconds"] == {"count": 10, "p50": 1.31, "p95": 1.31, "p99": 1.31}
    assert report["slowest"]["groups"] == [
        {"prompt_len": "8192-32767", "cache": "miss", "requests": 10, "share": 1.0}
    ]
    decomposition = report["ttft_decomposition"]
    assert decomposition["queue_share"] + decomposition["prefill_share"] + decomposition[
        "other_share"
    ] == pytest.approx(1)


def test_percentiles_per_group_are_never_averaged(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    records = [{"prompt_tokens": 100, "cached_tokens": 0, "ttft_seconds": t / 100} for t in range(1, 101)]
    report = run_json(capsys, str(write(tmp_path / "p.jsonl", records)))
    (group,) = report["groups"]
    assert group["ttft_seconds"]["p50"] == pytest.approx(np.percentile(np.arange(1, 101) / 100, 50))
    assert group["ttft_seconds"]["p99"] == pytest.approx(np.percentile(np.arange(1, 101) / 100, 99))


def test_bad_lines_are_named_by_file_and_line_and_skipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(
        tmp_path / "bad.jsonl",
        [*article_records()[:3], {"prompt_tokens": 5, "cached_tokens": 9}],
        extra=b"{broken\n" + orjson.dumps(SGLANG_LINE) + b"\n",
    )
    report = run_json(capsys, str(path))
    assert report["overall"]["requests"] == 3
    assert report["input"]["skipped"] == {"cached_exceeds_prompt": 1, "malformed_json": 1, "other_format": 1}
    examples = {(e["line"], e["reason"]): e for e in report["input"]["skipped_examples"]}
    assert examples[(4, "cached_exceeds_prompt")]["field"] == "cached_tokens"
    assert examples[(5, "malformed_json")]["file"] == str(path)
    assert examples[(6, "other_format")]["message"] == "looks like sglang in a kvlens file"


def test_gzip_stdin_and_other_formats(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    gz = tmp_path / "a.jsonl.gz"
    gz.write_bytes(gzip.compress(b"\n".join(orjson.dumps(r) for r in article_records())))
    assert run_json(capsys, str(gz))["overall"]["requests"] == 100
    sglang = write(tmp_path / "sglang-request-metrics-20261129_10.log", [SGLANG_LINE] * 4)
    report = run_json(capsys, str(sglang), "--model", "qwen")
    assert report["input"]["formats"] == {str(sglang): "sglang"}
    assert report["models"]["qwen"]["cached_tokens"] == 4 * 512
    usage = write(
        tmp_path / "gateway.jsonl",
        [{"model": "m", "usage": {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 4}}}],
    )
    assert run_json(capsys, str(usage))["overall"]["token_reuse_ratio"] == pytest.approx(0.4)

    class Stdin:
        buffer = open(write(tmp_path / "s.jsonl", article_records()), "rb")  # noqa: SIM115

    monkeypatch.setattr("sys.stdin", Stdin)
    assert run_json(capsys, "-")["overall"]["requests"] == 100
    Stdin.buffer.close()


def derived_of(records: list[dict[str, Any]]) -> Derived:
    settings = load_settings()
    batch = batch_from_objects(records).batch
    return Derived.of(batch, settings.prompt_length_edges, settings.cost_model_for, settings.default_model)


def test_diagnosis_follows_the_troubleshooting_order(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    records = []
    for i in range(200):  # long prompts that all share 2 blocks, then diverge; hits not faster; queue-bound
        hashes = ["system", "tools", *(f"user-{i}-{k}" for k in range(60))]
        hit = i % 2 == 0
        records.append(
            {
                "prompt_tokens": 992,
                "cached_tokens": 512 if hit else 0,
                "prefix_hashes": hashes,
                "block_size": 16,
                "arrival_time": 1_800_000_000 + i,
                "queue_seconds": 0.5,
                "prefill_seconds": 0.1,
                "ttft_seconds": 0.61,
            }
        )
    report = run_json(capsys, str(write(tmp_path / "d.jsonl", records)))
    kinds = [finding["id"] for finding in report["diagnosis"]]
    assert kinds == ["prefill_not_faster", "queue_bound"]
    not_faster = report["diagnosis"][0]["numbers"]["groups"][0]
    assert not_faster["hit_median_s"] == not_faster["miss_median_s"] == pytest.approx(0.1)

    little = [{**r, "cached_tokens": 0 if i % 4 else 16} for i, r in enumerate(records)]
    report = run_json(capsys, str(write(tmp_path / "e.jsonl", little)))
    finding = report["diagnosis"][0]
    assert finding["id"] == "little_reuse"
    histogram = finding["numbers"]["first_divergent_block_histogram"]
    assert histogram == {"0": 1, "2": 199}  # the first request shares nothing; the rest diverge at block 2
    assert finding["numbers"]["unbounded_cache_token_reuse"] == pytest.approx(199 * 32 / (200 * 992))


def test_hit_ratio_flatters_is_reported_last(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = run_json(capsys, str(write(tmp_path / "a.jsonl", article_records())))
    assert [f["id"] for f in report["diagnosis"]] == ["little_reuse", "hit_ratio_flatters"]
    assert report["diagnosis"][-1]["severity"] == "info"


def synthetic_prefill(a: float, b: float, c: float, noise: float, count: int = 2000) -> tuple[Any, Any, Any]:
    rng = np.random.default_rng(7)
    n = rng.integers(100, 16_000, count)
    h = (rng.random(count) * n * rng.integers(0, 2, count)).astype(np.int64) // 16 * 16
    m = n - h
    exact = a * m + b * (m * h + m * (m + 1) / 2) + c
    return n, h, exact * (1 + noise * rng.standard_normal(count))


def test_calibration_recovers_known_coefficients_within_5_percent() -> None:
    a, b, c = 2.0e-5, 3.0e-9, 0.005
    n, h, prefill = synthetic_prefill(a, b, c, noise=0.02)
    fit = calibration.fit("m", n, h, prefill)
    assert fit.usable and fit.r2 is not None and fit.r2 > 0.95
    assert fit.a == pytest.approx(a, rel=0.05)
    assert fit.b == pytest.approx(b, rel=0.05)
    assert fit.c == pytest.approx(c, rel=0.05)


def test_poor_fit_is_reported_and_not_used(tmp_path: Path) -> None:
    n, h, _ = synthetic_prefill(1e-5, 1e-9, 0.0, noise=0.0)
    noise = np.random.default_rng(1).random(n.size)  # prefill unrelated to the work
    fit = calibration.fit("m", n, h, noise)
    assert not fit.usable and "not used" in fit.reason
    assert calibration.cost_model_file([fit]) == {"cost_models": {}}
    assert not calibration.fit("m", n[:5], h[:5], noise[:5]).usable


def test_calibrate_writes_a_file_the_sidecar_accepts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    n, h, prefill = synthetic_prefill(2.0e-5, 3.0e-9, 0.005, noise=0.01, count=300)
    records = [
        {"model": "llama", "prompt_tokens": int(x), "cached_tokens": int(y), "prefill_seconds": float(p)}
        for x, y, p in zip(n, h, prefill, strict=True)
    ]
    out = tmp_path / "cost.yaml"
    assert (
        main(["analyze", str(write(tmp_path / "c.jsonl", records)), "--calibrate", str(out), "--json"]) == 0
    )
    capsys.readouterr()
    settings = load_settings(out)
    assert settings.cost_model_for("llama").unit == "seconds"
    assert settings.cost_model_for("llama").b / settings.cost_model_for("llama").a == pytest.approx(
        3e-9 / 2e-5, rel=0.1
    )
    assert yaml.safe_load(out.read_text())["cost_models"]["llama"]["a"] > 0


def test_html_report_is_self_contained(tmp_path: Path) -> None:
    report, _ = analyze([str(write(tmp_path / "a.jsonl", article_records()))], load_settings())
    page = html_report.page(report, load_settings().cost_model_for)
    assert page.startswith("<!doctype html>") and "<svg" in page
    assert "<script" not in page and "http://" not in page and "https://" not in page
    assert "90.00 %" in page and "measured prefill (100 of 100 records) and the fitted curve" in page


def test_missing_analyze_extra_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(__import__("sys").modules, "rich.console", None)
    assert main(["analyze", str(write(tmp_path / "a.jsonl", article_records()))]) == 2
    assert "kvlens[analyze]" in capsys.readouterr().err
