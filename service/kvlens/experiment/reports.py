"""What an experiment leaves in its out-dir and what its exit code says.

Every experiment writes ``report.md``, ``report.html`` and ``report.json`` into its out-dir, with
nothing beyond the ``serve`` extra (the terminal tables of ``rich`` are the CLI's, and optional).
A run's failures are never silent: each arm's failed requests are counted per reason from its
records file (:func:`kvlens.analysis.run_facts.errors_in`), and :func:`failures` turns them into
the run's verdict: an arm with more than ``max_error_rate`` of its requests failed makes the run
exit 1 (after its report is written), an arm with nothing answered exit 2.
"""

from __future__ import annotations

import html
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Final

from kvlens.analysis import run_facts
from kvlens.analysis.html_report import STYLE
from kvlens.experiment.protocol import ExperimentError
from kvlens.terminal import NARROWEST, visible, wrap

REPORTS: Final = ("report.md", "report.html", "report.json")
DEFAULT_MAX_ERROR_RATE: Final = 0.05
TOO_MANY_FAILED, NOTHING_ANSWERED = 1, 2  # exit codes


def write_reports(out_dir: Path, *, markdown: str, page: str, report: dict[str, Any]) -> list[Path]:
    """The three reports into ``out_dir`` (made when missing), each written whole or not at all
    (a file beside it, then renamed): a report read while a rerun writes is never half of one."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in zip(REPORTS, (markdown, page, json.dumps(report, indent=2) + "\n"), strict=True):
        path = out_dir / name
        staged = path.with_name(path.name + ".writing")
        try:
            staged.write_text(text)
            staged.replace(path)
        except OSError as error:
            raise ExperimentError(f"cannot write {path}: {error.strerror or error}") from None
        paths.append(path)
    return paths


def text_page(title: str, text: str) -> str:
    """A report that is text (``kvlens experiment quantization``'s) as one HTML page."""
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8"/>'
        '<meta name="viewport" content="width=device-width,initial-scale=1"/>'
        f"<title>{html.escape(title)}</title><style>{STYLE}</style></head>"
        f"<body><pre>{html.escape(text)}</pre></body></html>\n"
    )


def with_facts(text: str, report: dict[str, Any]) -> str:
    """A report's text with its failed requests and the reminder that latency is not quality."""
    failed = [
        folded for line in run_facts.error_lines(report) for folded in wrap(f"- {visible(line)}", NARROWEST)
    ]
    lines = ["Failed requests:", *failed, ""] if failed else []
    return text + "\n".join([*lines, *wrap(run_facts.PRESUMES_QUALITY, NARROWEST, indent=""), ""])


def check_error_rate(rate: float) -> None:
    if not 0 <= rate <= 1:
        raise ExperimentError(f"--max-error-rate takes a share from 0 to 1, not {rate:g}")


def failures(
    runs: Iterable[tuple[str, dict[str, Any] | None]], max_error_rate: float
) -> tuple[int, list[str]]:
    """The run's exit code from each arm's failures (0, TOO_MANY_FAILED or NOTHING_ANSWERED) and
    a line for each arm past the bound."""
    code, lines = 0, []
    for name, counts in runs:
        if not counts or not counts["requests"] or not counts["failed"]:
            continue
        failed, requests = counts["failed"], counts["requests"]
        reasons = run_facts.reasons_text(counts["reasons"])
        if failed == requests:
            code = NOTHING_ANSWERED
            lines.append(f"arm {name}: no request was answered ({failed} of {requests} failed: {reasons})")
        elif failed / requests > max_error_rate:
            code = max(code, TOO_MANY_FAILED)
            lines.append(
                f"arm {name}: {failed} of {requests} requests failed ({100 * failed / requests:.1f} %, "
                f"more than --max-error-rate {100 * max_error_rate:.1f} %): {reasons}"
            )
    return code, lines
