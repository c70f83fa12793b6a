"""Names from the records and the command line in the Markdown kvlens writes outside its tables:
the bullets, headings and lines of ``kvlens compare --markdown`` (an experiment's report.md is the
same text), of ``kvlens analyze --markdown``, and the names in the quantization report. A newline
in an arm's name or a request id ended its bullet and started a line of its own; ``*x*`` became
emphasis; a name starting ``# `` or ``1. `` made a heading or a list inside the bullet; a control
character went into the file as it was. The tables' cells: tests/hostile/test_report_names.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvlens.analysis.render import md_lines, md_text
from kvlens.cli import main
from kvlens.experiment import quantization_text
from kvlens.terminal import visible
from tests.hostile.test_markup_names import compared, write_records

# name -> how the Markdown shows it: escaped where Markdown would read it, control characters
# as their escapes (\n, \x1b), never as themselves
SHOWN = {
    "a\nb": "a\\nb",
    "a\r\nb": "a\\r\\nb",
    "a|b": "a\\|b",
    "c`d": "c\\`d",
    "e*f*": "e\\*f\\*",
    "# h": "\\# h",
    "1. x": "1\\. x",
    "- y": "\\- y",
    "z\x1bq": "z\\x1bq",
}
# mid-line (a heading's baseline, a bullet's later words) a block's start is text as it is
MID_LINE = {**SHOWN, "# h": "# h", "1. x": "1. x", "- y": "- y"}


def markdown_compare(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], *, first: bool) -> str:
    flags = compared(name, tmp_path)
    if first:  # the named arm the baseline: in the heading and after every "vs"
        flags = flags[2:] + flags[:2]
    assert main(["compare", *flags, "--engine", "numpy", "--markdown"]) == 0
    return capsys.readouterr().out


def no_control_characters(text: str) -> None:
    assert [c for c in text if (c < " " and c != "\n") or c in "\x7f\u2028\u2029\x85"] == []


@pytest.mark.parametrize("first", [False, True], ids=["arm", "baseline"])
@pytest.mark.parametrize("name", list(SHOWN))
def test_compare_markdown_shows_an_arm_name_inside_its_own_line(
    name: str, first: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = markdown_compare(name, tmp_path, capsys, first=first)
    plain = markdown_compare("plain", tmp_path, capsys, first=first)
    no_control_characters(out)
    # the same lines as with a plain name, each of the same kind (heading, bullet, row, text)
    assert [line[:2] for line in out.splitlines()] == [line[:2] for line in plain.splitlines()]
    shown = SHOWN[name]
    if first:
        assert out.startswith(f"# kvlens compare (baseline: {MID_LINE[name]})\n")
        assert out.count(f" vs {MID_LINE[name]}") == plain.count(" vs plain") > 0
    else:
        assert f"\n- {shown} vs base, " in out
        assert out.count(f"- {shown} vs base") == plain.count("- plain vs base") > 0


def analyzed_with_misses(tmp_path: Path, request_id: str, model: str) -> Path:
    """Records that miss blocks an earlier record had (the worst ones listed by request id and
    replica) and a model a calibration line names."""
    return write_records(
        tmp_path / "records.jsonl",
        [
            {"model": model, "request_id": f"{request_id}{i}", "replica": "a",
             "prompt_tokens": 64, "cached_tokens": 0 if i % 2 else 32, "prefix_hashes": [1, 2, 3, 4],
             "prefill_seconds": 0.01, "block_size": 16, "ttft_seconds": 0.1}
            for i in range(6)
        ],
    )  # fmt: skip


@pytest.mark.parametrize("name", ["r\nq", "r*q*", "# r", "r\x1bq"])
def test_analyze_markdown_shows_request_ids_and_models_inside_their_lines(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = "m*x*"  # a label refuses control characters: markup only
    path = analyzed_with_misses(tmp_path, name, model)
    assert main(["analyze", str(path), "--engine", "numpy", "--markdown"]) == 0
    out = capsys.readouterr().out
    no_control_characters(out)
    shown = {"r\nq": "r\\nq", "r*q*": "r\\*q\\*", "# r": "# r", "r\x1bq": "r\\x1bq"}[name]
    worst = [line for line in out.splitlines() if line.startswith("- 0-511: ")]
    assert len(worst) == 5 and all(line.startswith(f"- 0-511: {shown}") for line in worst), worst
    assert "- calibration m\\*x\\* (6 records)" in out


def test_the_quantization_report_shows_an_endpoint_name_inside_its_lines() -> None:
    stats = {
        "requests": 4, "ttft_p50_seconds": 0.1, "itl_p50_seconds": 0.01, "itl_p99_seconds_median": 0.02,
        "e2e_p50_seconds": 0.5, "output_tokens_per_second": 100.0,
    }  # fmt: skip
    plain = quantization_text.text({"baseline": "a", "fixed_work": {"a": {"short": stats}}})
    text = quantization_text.text({"baseline": "a\nb", "fixed_work": {"a\nb": {"short": stats}}})
    no_control_characters(text)
    assert text.startswith("# kvlens quantization (baseline: a\\nb)\n")
    assert len(text.splitlines()) == len(plain.splitlines())
    assert "a\\nb short: 100 output tokens/s" in text


def test_every_control_character_is_shown_as_its_escape() -> None:
    """What str.splitlines breaks at (U+2028, U+0085, U+001C) and what a terminal obeys (ESC, DEL)."""
    assert visible("a\u2028b\x85c\x1cd\x1be\x7ff\tg\x00") == "a\\u2028b\\x85c\\x1cd\\x1be\\x7ff\\tg\\x00"
    assert md_text("a\u2029|b") == "a\\u2029\\|b"
    assert md_lines(["1) x", "+ y", "--- z", "> q", "2024-01 w", "-6.0 ms"]) == [
        "- 1\\) x", "- \\+ y", "- \\--- z", "- \\> q", "- 2024-01 w", "- -6.0 ms"
    ]  # fmt: skip
