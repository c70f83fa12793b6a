"""The HTML report opened by a real browser (Debian's headless Chromium): it renders, offline,
without console errors."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import orjson
import pytest

from kvlens.analysis import render
from kvlens.analysis.analyze import analyze
from kvlens.config import load_settings
from tests.article import article_records

pytestmark = pytest.mark.integration


def open_in_chromium(page: Path, tmp_path: Path) -> tuple[str, list[str]]:
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
            "--window-size=1200,2400",
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


def test_html_report_renders_offline_without_console_errors(tmp_path: Path) -> None:
    records = tmp_path / "article.jsonl"
    records.write_bytes(b"\n".join(orjson.dumps(r) for r in article_records()))
    report, _ = analyze([str(records)], load_settings())
    page = tmp_path / "report.html"
    page.write_text(render.html_page(report))
    dom, console = open_in_chromium(page, tmp_path)
    assert console == []
    assert "kvlens analyze" in dom and "90.00 %" in dom and "1.54 %" in dom and "0.344 %" in dom
    assert dom.count("<svg") >= 3
    assert (tmp_path / "report.png").stat().st_size > 10_000
