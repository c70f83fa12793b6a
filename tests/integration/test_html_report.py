"""The HTML report opened by a real browser (Debian's headless Chromium): it renders, offline,
without console errors, the verdict first, and its print layout fits a page's width."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import orjson
import pytest

from kvlens.analysis import html_report
from kvlens.analysis.analyze import analyze
from kvlens.cli import main
from kvlens.config import load_settings
from tests.article import article_records
from tests.unit.test_compare_html import arm_records, write

pytestmark = pytest.mark.integration


def open_in_chromium(page: Path, tmp_path: Path, width: int = 1200) -> tuple[str, list[str]]:
    """(the rendered DOM, the page's console messages), with the network off."""
    binary = shutil.which("chromium")
    if binary is None:
        pytest.fail("chromium is missing: scripts/test installs Debian's chromium package")
    done = subprocess.run(
        [
            binary,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            "--proxy-server=127.0.0.1:9",  # any attempt to fetch something would fail
            f"--user-data-dir={tmp_path / 'profile'}",
            "--enable-logging=stderr",
            "--v=0",
            f"--screenshot={tmp_path / 'report.png'}",
            f"--window-size={width},2400",
            "--dump-dom",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    console = re.findall(r"CONSOLE(?:\(\d+\)|:\d+)\] (.*)", done.stderr)
    return done.stdout, console


def test_console_errors_are_detected(tmp_path: Path) -> None:
    page = tmp_path / "broken.html"
    page.write_text("<!doctype html><title>x</title><script>console.error('boom'); nope();</script>")
    _, console = open_in_chromium(page, tmp_path)
    assert any("boom" in line for line in console)


def article_page(tmp_path: Path) -> str:
    records = tmp_path / "article.jsonl"
    records.write_bytes(b"\n".join(orjson.dumps(r) for r in article_records()))
    settings = load_settings()
    report, _ = analyze([str(records)], settings)
    return html_report.page(report, settings.cost_model_for)


def test_html_report_renders_offline_without_console_errors(tmp_path: Path) -> None:
    page = tmp_path / "report.html"
    page.write_text(article_page(tmp_path))
    dom, console = open_in_chromium(page, tmp_path)
    assert console == []
    assert "kvlens analyze" in dom and "90.00 %" in dom and "1.54 %" in dom and "0.344 %" in dom
    # as the browser built it: the verdict, then the context, before any chart or table
    assert dom.index('id="verdict"') < dom.index('id="context"') < dom.index("<svg") < dom.index("<table")
    assert dom.count("<svg") == 6  # ratios, shares, TTFT, queue, prefill, calibration
    assert (tmp_path / "report.png").stat().st_size > 10_000


# Appended to a copy of the report: the print rules applied on screen, then every element's
# right edge measured against the window's width, written into the DOM for --dump-dom.
MEASURE = """<script>
const wide = [...document.querySelectorAll("body *")]
  .filter((e) => e.closest("details") === null && e.getBoundingClientRect().right > innerWidth + 0.5)
  .map((e) => e.tagName + (e.id ? "#" + e.id : "") + " " + Math.round(e.getBoundingClientRect().right));
document.body.setAttribute("data-overflow", JSON.stringify({width: innerWidth, wide: wide}));
</script>"""


def measure_width(page: str, tmp_path: Path) -> list[str]:
    """The elements wider than a 718-pixel window (A4 portrait at Chromium's default margins)."""
    copy = tmp_path / "measured.html"
    copy.write_text(page.replace("</body>", MEASURE + "</body>"))
    dom, console = open_in_chromium(copy, tmp_path, width=718)
    assert console == []
    found = re.search(r'data-overflow="([^"]*)"', dom)
    assert found is not None, "the measuring script did not run"
    measured = orjson.loads(found.group(1).replace("&quot;", '"'))
    assert measured["width"] == 718
    return measured["wide"]  # type: ignore[no-any-return]


def test_overflow_is_detected(tmp_path: Path) -> None:
    page = '<!doctype html><title>x</title><body><p>fits</p><div id="wide" style="width:900px">x</div></body>'
    assert measure_width(page, tmp_path) == ["DIV#wide 908"]


def test_html_report_fits_a_printed_page_width(tmp_path: Path) -> None:
    """With its print rules applied (on screen, so the layout can be measured), nothing of the
    report is wider than a printed page."""
    page = article_page(tmp_path)
    assert "@media print{" in page
    assert measure_width(page.replace("@media print{", "@media all{"), tmp_path) == []


def test_compare_report_renders_and_fits_a_printed_page_width(tmp_path: Path) -> None:
    """The compare page (``kvlens compare --html``), in the browser at a printed page's width:
    no console message, the three delta charts drawn, nothing wider than the page."""
    off = write(tmp_path / "off.jsonl", arm_records([40.0, 160.0], [0, 0], 0.010))
    warm = write(tmp_path / "warm.jsonl", arm_records([15.0, 30.0], [768, 3584], 0.010))
    out = tmp_path / "compare.html"
    assert main(["compare", "--arm", f"off={off}", "--arm", f"warm={warm}", "--html", str(out)]) == 0
    page = out.read_text()
    assert page.count('role="img"') == 3
    assert measure_width(page.replace("@media print{", "@media all{"), tmp_path) == []
