"""Names from the records and the command line (model, tenant, request ids, arm names, file names)
at the terminal are text as written, never rich markup: "[/x]" raised MarkupError, "[bold]z" lost
its brackets, ":smile:" became an emoji. Markdown and HTML: tests/hostile/test_report_names.py."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from kvlens.cli import main
from kvlens.cli.replay import progress_line
from kvlens.experiment.client import Progress
from kvlens.terminal import visible

MARKUP = ["[/x]", "[bold]z", "[link=e]m", "x:smile:y"]
ARM_MARKUP = ["[/x]", "[bold]z", "[red]q[/]", "x:smile:y"]  # an arm's name ends at its first "="
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x1b]*\x1b\\")


def write_records(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(record) + b"\n" for record in records))
    return path


def analyzed(name: str, tmp_path: Path) -> Path:
    """Records whose model, tenant and request id are ``name``, tenants sharing blocks (a label
    never holds a control character: the records refuse one, so a newline goes in the id only)."""
    label = "m" if any(c < " " or "\x7f" <= c <= "\x9f" for c in name) else name
    return write_records(
        tmp_path / "records.jsonl",
        [
            {"model": label, "tenant": "A", "prompt_tokens": 32, "cached_tokens": 0, "prefix_hashes": [1, 2]},
            {"model": label, "tenant": label, "request_id": name, "prompt_tokens": 32, "cached_tokens": 32,
             "prefix_hashes": [1, 2], "prefill_seconds": 0.01},
        ],
    )  # fmt: skip


def compared(name: str, tmp_path: Path) -> list[str]:
    """``--arm`` flags of two arms, the second named ``name``, whose request ids are ``name`` and
    ``name`` with a number: each pairs, and some did not benefit (listed by request id)."""
    flags = []
    # a label refuses control characters
    label = "m" if any(c < " " or "\x7f" <= c <= "\x9f" for c in name) else name
    for arm, ttft in (("base", 0.1), (name, 0.1)):
        rows = [
            {"request_id": f"{name}{i}", "prompt_tokens": 600, "cached_tokens": 0 if i % 2 else 512,
             "ttft_seconds": ttft, "model": label}
            for i in range(8)
        ]  # fmt: skip
        path = write_records(tmp_path / f"arm{len(flags)}.jsonl", rows)
        flags += ["--arm", f"{arm}={path}"]
    return flags


def at_a_terminal(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> str:
    """What ``kvlens ARGV`` prints to a stdout that says it is a terminal (rich's tables), its
    escape codes stripped."""
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    monkeypatch.setenv("COLUMNS", "200")
    assert main(argv) == 0
    return ANSI.sub("", capsys.readouterr().out)


@pytest.mark.parametrize("text", MARKUP)
def test_the_terminal_report_prints_names_as_text_never_as_markup(
    text: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["analyze", str(analyzed(text, tmp_path)), "--engine", "numpy"]) == 0
    out = capsys.readouterr().out
    assert out.count(text) >= 3  # the model's row, the pair's getter and request id, as written


@pytest.mark.parametrize("text", ARM_MARKUP)
def test_compare_at_a_terminal_prints_arm_names_and_request_ids_as_text(
    text: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # an experiment prints its report at a terminal through the same compare_text.terminal
    out = at_a_terminal(monkeypatch, capsys, ["compare", *compared(text, tmp_path), "--engine", "numpy"])
    plain = at_a_terminal(monkeypatch, capsys, ["compare", *compared("plain", tmp_path), "--engine", "numpy"])
    # where the plain name is shown (titles, "outcome in ARM" headers, lines, the listed
    # requests' ids), the other is shown as written
    for shown in (" vs base", "in {}", "{}1 "):
        assert (
            out.count(shown.format(text) if "{}" in shown else text + shown)
            == plain.count(shown.format("plain") if "{}" in shown else "plain" + shown)
            > 0
        ), shown


@pytest.mark.parametrize("text", ["[bold]z", "[red]q[red]"])
def test_simulate_and_replay_progress_print_names_as_written(
    text: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Plain print, no rich: pinned so a move to rich keeps names as text."""
    trace = write_records(
        tmp_path / f"{text}.jsonl",
        [
            {"timestamp": i * 100, "input_length": 1024, "output_length": 4, "hash_ids": [1, 2]}
            for i in range(4)
        ],
    )
    assert main(["simulate", str(trace), "--replicas", "1"]) == 0
    assert str(trace) in capsys.readouterr().out
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    progress_line(text, Progress(), 4)
    assert capsys.readouterr().err.startswith(f"\r{text}: 0/4 done")


# A terminal acts on these instead of showing them: a window title set, the screen cleared, a
# colour (ESC and its 8-bit form, CSI)
ESCAPES = ["\x1b]0;pwned\x07", "\x1b[2J\x1b[H", "a\x9b31mb", "c\rd"]


@pytest.mark.parametrize("text", ESCAPES)
def test_the_terminal_report_shows_a_names_control_characters_never_sends_them(
    text: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A request id from the records (a label refuses control characters) reaches analyze's and
    compare's terminal reports; rich passed ESC and CSI through to the terminal as they were."""
    assert main(["analyze", str(analyzed(text, tmp_path)), "--engine", "numpy"]) == 0
    out = capsys.readouterr().out
    assert not any(char in out for char in "\x1b\x9b\r\x07")
    assert visible(text) in out
    assert main(["compare", *compared(text, tmp_path), "--engine", "numpy"]) == 0
    out = capsys.readouterr().out
    assert not any(char in out for char in "\x1b\x9b\r\x07")
    assert visible(text) in out
