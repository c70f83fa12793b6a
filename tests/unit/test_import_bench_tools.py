"""`kvlens import vllm-bench|aiperf`: the real tools' files (tests/fixtures/bench-tools, made by
`vllm bench serve` and `aiperf profile` against `kvlens simulate serve --tokenizer`) become kvlens
records whose counts and values are the tools' own summary figures; `compare` and `analyze` read
them; an entry that cannot be read is named (which entry, which field) and the others are kept."""

from __future__ import annotations

import errno
import json
import os
import statistics
from pathlib import Path
from typing import Any

import pytest

from kvlens.cli import main
from kvlens.sources import bench_tools

FIXTURES = Path(__file__).parents[1] / "fixtures" / "bench-tools"
VLLM = FIXTURES / "vllm-bench"
AIPERF = FIXTURES / "aiperf"


def imported(
    capsys: pytest.CaptureFixture[str], *argv: str, code: int = 0
) -> tuple[list[dict[str, Any]], str]:
    assert main(["import", *argv]) == code
    out, err = capsys.readouterr()
    return [json.loads(line) for line in out.splitlines()], err


def summary(run: str) -> dict[str, Any]:
    return json.loads((AIPERF / run / "profile_export_aiperf.json").read_text())  # type: ignore[no-any-return]


def test_vllm_bench_records_are_the_runs_requests(capsys: pytest.CaptureFixture[str]) -> None:
    result = json.loads((VLLM / "on.json").read_text())
    records, err = imported(capsys, "vllm-bench", str(VLLM / "on.json"))
    assert len(records) == result["completed"] == 40
    assert [r["request_id"] for r in records] == [str(i) for i in range(40)]
    assert sum(r["prompt_tokens"] for r in records) == result["total_input_tokens"] == 30655
    assert sum(r["output_tokens"] for r in records) == result["total_output_tokens"] == 634
    ttfts = [r["ttft_seconds"] for r in records]
    assert statistics.mean(ttfts) * 1000 == pytest.approx(result["mean_ttft_ms"], rel=1e-12)
    assert statistics.median(ttfts) * 1000 == pytest.approx(result["median_ttft_ms"], rel=1e-12)
    tpots = [r["client_tpot_seconds"] for r in records if r["output_tokens"] > 1]
    assert statistics.mean(tpots) * 1000 == pytest.approx(result["mean_tpot_ms"], rel=1e-12)
    assert records[0]["e2e_seconds"] == result["latencies"][0]
    assert records[0]["decode_seconds"] == result["latencies"][0] - result["ttfts"][0]
    assert {r["model"] for r in records} == {"simulated"}
    assert not any("cached_tokens" in r or "arrival_time" in r for r in records)
    assert err == (
        "kvlens import: 40 records written (0 of failed requests, with their error and no timings), "
        "0 entries left out as unreadable\n"
        "kvlens import: 40 records carry no cached_tokens (vllm-bench does not record them): analyze "
        "and compare count them as skipped (cached_tokens missing), since a hit ratio cannot be told; "
        "--missing-cached-is-zero for a run with prefix caching off\n"
    )
    zeros, _ = imported(capsys, "vllm-bench", str(VLLM / "on.json"), "--missing-cached-is-zero")
    assert {r["cached_tokens"] for r in zeros} == {0}


def test_vllm_bench_failed_requests_are_records_with_their_error(capsys: pytest.CaptureFixture[str]) -> None:
    result = json.loads((VLLM / "errors.json").read_text())
    records, err = imported(capsys, "vllm-bench", str(VLLM / "errors.json"), "--missing-cached-is-zero")
    failed = [r for r in records if "error" in r]
    assert len(records) == 12 and len(failed) == result["failed"] == 5
    assert [r["request_id"] for r in failed] == [str(i) for i, e in enumerate(result["errors"]) if e]
    assert all(r == {**r, "error": "Bad Request", "finish_reason": "error"} for r in failed)
    assert not any("ttft_seconds" in r or "cached_tokens" in r for r in failed)  # in no latency figure
    assert "12 records written (5 of failed requests" in err


def test_aiperf_records_are_the_runs_profiling_requests(capsys: pytest.CaptureFixture[str]) -> None:
    figures = summary("on")
    records, err = imported(capsys, "aiperf", str(AIPERF / "on" / "profile_export.jsonl"), "--model", "sim")
    assert len(records) == figures["request_count"]["avg"] == 40
    assert [r["request_id"] for r in records] == [str(i) for i in range(40)]  # session order
    assert sum(r["prompt_tokens"] for r in records) == figures["usage_prompt_tokens"]["sum"] == 30144
    assert (
        sum(r["cached_tokens"] for r in records) == figures["usage_prompt_cache_read_tokens"]["sum"] == 21536
    )
    ttft_ms = [r["ttft_seconds"] * 1000 for r in records]
    assert statistics.mean(ttft_ms) == pytest.approx(figures["time_to_first_token"]["avg"], rel=1e-12)
    assert max(ttft_ms) == pytest.approx(figures["time_to_first_token"]["max"], rel=1e-12)
    latency_ms = [r["e2e_seconds"] * 1000 for r in records]
    assert sum(latency_ms) == pytest.approx(figures["request_latency"]["sum"], rel=1e-12)
    itl_ms = [r["client_tpot_seconds"] * 1000 for r in records]  # AIPerf's ITL is vLLM's TPOT
    assert statistics.mean(itl_ms) == pytest.approx(figures["inter_token_latency"]["avg"], rel=1e-9)
    assert all(r["arrival_time"] > 1.7e9 and r["model"] == "sim" for r in records)
    assert "0 entries left out as unreadable, 4 warm-up records left out\n" in err


def test_aiperf_failed_requests_carry_the_servers_message(capsys: pytest.CaptureFixture[str]) -> None:
    figures = summary("errors")
    records, _ = imported(capsys, "aiperf", str(AIPERF / "errors" / "profile_export.jsonl"))
    failed = [r for r in records if "error" in r]
    assert len(records) == figures["request_count"]["avg"] + figures["error_request_count"]["avg"] == 12
    assert len(failed) == sum(item["count"] for item in figures["error_summary"]) == 4
    assert failed[0]["error"].startswith('400: Bad Request: {"error":{"message":"This model\'s maximum')
    assert all(len(r["error"]) <= bench_tools.MAX_ERROR_CHARS for r in failed)


def test_unreadable_entries_are_named_and_the_others_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = json.loads((VLLM / "on.json").read_text())
    result["ttfts"][3] = "fast"
    result["itls"][5][2] = None
    result["input_lens"][7] = -1
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(result))
    records, err = imported(capsys, "vllm-bench", str(path), "--missing-cached-is-zero", code=1)
    assert [r["request_id"] for r in records] == [str(i) for i in range(40) if i not in (3, 5, 7)]
    assert err.splitlines()[:3] == [
        f"kvlens import: {path}: request 3: ttfts: must be a finite number: left out",
        f"kvlens import: {path}: request 5: itls[2]: must be a finite number: left out",
        f"kvlens import: {path}: request 7: input_lens: must be a whole number of tokens from 0 to "
        "10000000: left out",
    ]
    lines = (AIPERF / "on" / "profile_export.jsonl").read_text().splitlines()
    second = json.loads(lines[5])
    second["metrics"]["time_to_first_token"]["unit"] = "furlongs"
    lines[5] = json.dumps(second)
    lines[6] = "{not json"
    lines.append(lines[8])  # a session twice
    path = tmp_path / "profile_export.jsonl"
    path.write_text("\n".join(lines) + "\n")
    records, err = imported(capsys, "aiperf", str(path), code=1)
    assert len(records) == 38
    assert err.splitlines()[:3] == [
        f"kvlens import: {path}: line 6: metrics.time_to_first_token: has unit 'furlongs', not one of "
        "ns, us, ms, s, sec: left out",
        f"kvlens import: {path}: line 7: line: is not valid JSON: left out",
        f"kvlens import: {path}: line 45: metadata.session_num: "
        f"{json.loads(lines[8])['metadata']['session_num']} again (first on line 9): left out",
    ]


def test_a_file_that_is_not_the_tools_is_refused_whole(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = json.loads((VLLM / "on.json").read_text())
    del result["itls"], result["errors"]
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(result))
    assert main(["import", "vllm-bench", str(path)]) == 2
    assert capsys.readouterr().err == (
        f"kvlens import: {path}: not a vllm bench serve result saved with --save-detailed: no itls, "
        "errors (per-request arrays)\n"
    )
    path.write_text(json.dumps(result) + "\n" + json.dumps(result) + "\n")
    assert main(["import", "vllm-bench", str(path)]) == 2
    assert (
        "holds 2 results (vllm bench serve --append-result): import one at a time" in capsys.readouterr().err
    )
    assert main(["import", "aiperf", str(VLLM / "on.json")]) == 1  # one line, not a record
    assert (
        "line 1: metadata: is missing: not an AIPerf profile_export.jsonl record" in capsys.readouterr().err
    )


def test_compare_and_analyze_read_the_imported_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for arm in ("off", "on"):
        argv = [
            "import",
            "aiperf",
            str(AIPERF / arm / "profile_export.jsonl"),
            "-o",
            str(tmp_path / f"{arm}.jsonl"),
        ]
        assert main(argv) == 0
    capsys.readouterr()
    assert (
        main(
            [
                "compare",
                "--arm",
                f"off={tmp_path / 'off.jsonl'}",
                "--arm",
                f"on={tmp_path / 'on.jsonl'}",
                "--json",
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    records = [json.loads(line) for line in (tmp_path / "on.jsonl").read_text().splitlines()]
    assert sum(group["requests"] for group in report["groups"]) == 40
    assert main(["analyze", str(tmp_path / "on.jsonl"), "--json"]) == 0
    analysis = json.loads(capsys.readouterr().out)
    assert analysis["input"]["records"] == 40
    reused = sum(r["cached_tokens"] for r in records) / sum(r["prompt_tokens"] for r in records)
    assert analysis["overall"]["token_reuse_ratio"] == pytest.approx(reused, rel=1e-12)
    for arm in ("off", "on"):  # vllm bench serve: no cached tokens; compared as all-miss when said so
        argv = ["import", "vllm-bench", str(VLLM / f"{arm}.json"), "--missing-cached-is-zero"]
        assert main([*argv, "-o", str(tmp_path / f"v{arm}.jsonl")]) == 0
    assert (
        main(
            [
                "compare",
                "--arm",
                f"off={tmp_path / 'voff.jsonl'}",
                "--arm",
                f"on={tmp_path / 'von.jsonl'}",
                "--json",
            ]
        )
        == 0
    )
    assert sum(group["requests"] for group in json.loads(capsys.readouterr().out)["groups"]) == 40


@pytest.mark.timeout(20)
def test_an_aiperf_line_that_never_ends_stops_the_read_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvlens.sources import jsonlines

    monkeypatch.setattr(jsonlines, "MAX_LINE_BYTES", 10_000)
    good = (AIPERF / "on" / "profile_export.jsonl").read_text().splitlines()[0]
    path = tmp_path / "endless.jsonl"
    path.write_bytes(good.encode() + b"\n" + b"0" * (8 << 20))  # /dev/zero's kind: no newline
    assert main(["import", "aiperf", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == f"kvlens import: {path}: line 2 is longer than 10,000 bytes: not read\n"


def test_an_output_that_is_the_input_itself_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "on.json"
    path.write_bytes((VLLM / "on.json").read_bytes())
    link = tmp_path / "link.json"
    link.symlink_to(path)
    for out in (path, link):
        assert main(["import", "vllm-bench", str(path), "-o", str(out)]) == 2
        assert capsys.readouterr().err == f"kvlens import: {out} is {path} itself: not overwritten\n"
        assert path.read_bytes() == (VLLM / "on.json").read_bytes()


def test_an_output_that_cannot_be_written_is_one_line_and_the_old_one_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    on = str(VLLM / "on.json")
    assert main(["import", "vllm-bench", on, "-o", "/dev/full"]) == 2
    assert capsys.readouterr().err == "kvlens import: cannot write /dev/full: No space left on device\n"
    out = tmp_path / "out.jsonl"
    out.write_bytes(b"the last run\n")

    def full(_fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)  # the disk fills while OUT is written
    assert main(["import", "vllm-bench", on, "-o", str(out)]) == 2
    assert capsys.readouterr().err == f"kvlens import: cannot write {out}: No space left on device\n"
    assert out.read_bytes() == b"the last run\n"
    assert [p.name for p in tmp_path.iterdir()] == ["out.jsonl"]  # no temporary left beside it
    monkeypatch.undo()
    assert main(["import", "vllm-bench", on, "-o", str(out)]) == 0
    assert len(out.read_bytes().splitlines()) == 40
    assert [p.name for p in tmp_path.iterdir()] == ["out.jsonl"]


def test_a_huge_integer_in_a_number_field_is_a_bad_entry(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    huge = 10**400  # float() of it overflows
    result = json.loads((VLLM / "on.json").read_text())
    result["ttfts"][3] = huge
    result["itls"][5][0] = huge
    path = tmp_path / "huge.json"
    path.write_text(json.dumps(result))
    records, err = imported(capsys, "vllm-bench", str(path), code=1)
    assert [r["request_id"] for r in records] == [str(i) for i in range(40) if i not in (3, 5)]
    assert err.splitlines()[:2] == [
        f"kvlens import: {path}: request 3: ttfts: must be a finite number: left out",
        f"kvlens import: {path}: request 5: itls[0]: must be a finite number: left out",
    ]
    lines = (AIPERF / "on" / "profile_export.jsonl").read_text().splitlines()
    ttft, start = json.loads(lines[5]), json.loads(lines[6])
    ttft["metrics"]["time_to_first_token"]["value"] = huge
    start["metadata"]["request_start_ns"] = huge  # like any start out of range: no arrival_time
    lines[5], lines[6] = json.dumps(ttft), json.dumps(start)
    path = tmp_path / "profile_export.jsonl"
    path.write_text("\n".join(lines) + "\n")
    records, err = imported(capsys, "aiperf", str(path), code=1)
    assert len(records) == 39
    assert err.splitlines()[0] == (
        f"kvlens import: {path}: line 6: metrics.time_to_first_token: must be a finite number: left out"
    )
    session = str(start["metadata"]["session_num"])
    assert next(r for r in records if r["request_id"] == session).get("arrival_time") is None


def test_an_aiperf_unit_that_is_not_a_string_is_a_bad_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = (AIPERF / "on" / "profile_export.jsonl").read_text().splitlines()
    for number, unit in ((5, ["ms"]), (6, {"ms": 1})):
        line = json.loads(lines[number])
        line["metrics"]["time_to_first_token"]["unit"] = unit
        lines[number] = json.dumps(line)
    path = tmp_path / "profile_export.jsonl"
    path.write_text("\n".join(lines) + "\n")
    records, err = imported(capsys, "aiperf", str(path), code=1)
    assert len(records) == 38
    assert err.splitlines()[:2] == [
        f"kvlens import: {path}: line 6: metrics.time_to_first_token: has unit \"['ms']\", not one of "
        "ns, us, ms, s, sec: left out",
        f"kvlens import: {path}: line 7: metrics.time_to_first_token: has unit \"{{'ms': 1}}\", not one of "
        "ns, us, ms, s, sec: left out",
    ]


def test_per_request_arrays_of_different_lengths_refuse_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = json.loads((VLLM / "on.json").read_text())
    result["input_lens"] = [0] * 200_000  # a 39 KB gzip held 20 million: one bad entry each
    result["output_lens"] = []
    path = tmp_path / "lengths.json"
    path.write_text(json.dumps(result))
    assert main(["import", "vllm-bench", str(path)]) == 2
    assert capsys.readouterr() == (
        "",
        f"kvlens import: {path}: per-request arrays of different lengths (input_lens 200000, "
        "output_lens 0, ttfts 40, itls 40, latencies 40, errors 40): not one run's requests\n",
    )


def test_only_the_first_bad_entries_are_kept_the_rest_counted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    count = 5000
    result = {name: [0] * count for name in ("input_lens", "output_lens", "ttfts", "itls", "latencies")}
    result["errors"] = [None] * count  # every entry bad
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(result))
    read = bench_tools.read("vllm-bench", str(path))
    assert (read.bad_count, len(read.bad), read.records) == (count, bench_tools.KEPT_BAD, [])
    assert (
        read.bad[-1]
        == f"request {bench_tools.KEPT_BAD - 1}: errors: must be a string (empty when the request succeeded)"
    )
    assert main(["import", "vllm-bench", str(path)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == bench_tools.KEPT_BAD + 2
    assert err[-2] == f"kvlens import: ... and {count - bench_tools.KEPT_BAD} more entries left out"
    assert err[-1] == (
        "kvlens import: 0 records written (0 of failed requests, with their error and no timings), "
        f"{count} entries left out as unreadable"
    )


def vllm_result(requests: int, output_tokens: int, text_bytes: int) -> dict[str, Any]:
    """A vllm bench serve --save-detailed result, sized by its requests."""
    return {
        "model_id": "simulated",
        "input_lens": [100 + i % 4000 for i in range(requests)],
        "output_lens": [output_tokens] * requests,
        "ttfts": [0.01 + i % 7 / 100 for i in range(requests)],
        "itls": [[0.001 + j % 13 / 1000 for j in range(output_tokens - 1)] for _ in range(requests)],
        "latencies": [1.5 + i % 5 / 10 for i in range(requests)],
        "start_times": [float(i) for i in range(requests)],
        "generated_texts": ["x" * text_bytes] * requests,
        "errors": [""] * requests,
    }


def test_a_vllm_bench_result_is_read_as_it_streams_not_held_whole(tmp_path: Path) -> None:
    """The per-request arrays are read element by element, the text (generated_texts) not at all:
    the reader holds its records, not the file (it held the file's bytes and all of it decoded,
    about 4.5 times the file)."""
    import tracemalloc

    result = vllm_result(1000, 256, 10000)
    path = tmp_path / "big.json"
    path.write_text(json.dumps(result))
    size = path.stat().st_size
    assert size > 12 * 1024 * 1024
    tracemalloc.start()
    try:
        read = bench_tools.read("vllm-bench", str(path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(read.records) == 1000 and read.bad_count == 0
    assert read.records[999]["prompt_tokens"] == 1099
    assert peak < size / 2, f"peak {peak / 2**20:.1f} MiB for a {size / 2**20:.1f} MiB file"


def test_a_file_that_is_no_json_object_stops_the_read_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    """/dev/zero is refused at its first bytes, not read to the 512 MiB bound first."""
    assert main(["import", "vllm-bench", "/dev/zero"]) == 2
    assert capsys.readouterr().err == (
        "kvlens import: /dev/zero: not a vllm bench serve result (one JSON object)\n"
    )
