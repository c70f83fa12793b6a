"""Names from the records and the command line (model, tenant, request ids, arm names) in the
reports kvlens writes are shown as written, never read as the format's markup: a Markdown table's
cell ("a|b" or a newline split its row, "[l](url)" made a link, "<b>" HTML), an HTML page
("<script>" in a model name)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvlens.cli import main
from tests.hostile.test_markup_names import analyzed, compared

# --- Markdown -----------------------------------------------------------------------------------

CELLS = ["a|b", "x\ny", "c`d", "e\\|f", "[l](http://e)", "<b>g"]


def table_rows(markdown: str) -> list[list[str]]:
    """Each line of a Markdown table split into its cells at the unescaped pipes."""
    return [re.split(r"(?<!\\)\|", line)[1:-1] for line in markdown.splitlines() if line.startswith("|")]


def tables_hold(markdown: str) -> None:
    """Every table line has as many cells as the header above it; no line starts in a row's
    middle (a newline in a cell)."""
    widths: list[int] = []
    previous = ""
    for line in markdown.splitlines():
        if line.startswith("|"):
            cells = len(re.split(r"(?<!\\)\|", line)) - 2
            if not previous.startswith("|"):
                widths.append(cells)
            assert cells == widths[-1], line
            assert line.endswith("|"), line
        else:
            assert not previous.startswith("|") or not line, f"a row cut by a newline: {line!r}"
        previous = line
    assert widths


@pytest.mark.parametrize("name", CELLS)
def test_analyze_markdown_keeps_its_tables_whole_whatever_the_names(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["analyze", str(analyzed(name, tmp_path)), "--engine", "numpy", "--markdown"]) == 0
    out = capsys.readouterr().out
    tables_hold(out)
    shown = {
        "a|b": "| a\\|b |",  # the model's row
        "x\ny": "| x\\ny |",  # the request id of the tenants' pair, its newline shown
        "c`d": "| c\\`d |",
        "e\\|f": "| e\\\\\\|f |",
        "[l](http://e)": "| [l\\](http://e) |",  # never a link
        "<b>g": "| \\<b>g |",  # never HTML
    }
    assert shown[name] in out


@pytest.mark.parametrize("name", CELLS)
def test_compare_markdown_keeps_its_tables_whole_whatever_the_names(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # an experiment's report.md is compare_text.markdown too
    assert main(["compare", *compared(name, tmp_path), "--engine", "numpy", "--markdown"]) == 0
    out = capsys.readouterr().out
    tables_hold(out)
    rows = [line for line in out.splitlines() if line.startswith("|")]
    raw = re.compile(r"(?<!\\)" + re.escape(name))
    assert not [line for line in rows if raw.search(line)]  # each shown escaped
    escaped = name.replace("\\", "\\\\").replace("|", "\\|").replace("`", "\\`").replace("<", "\\<")
    escaped = escaped.replace("](", "\\](").replace("\n", "\\n")
    assert sum(escaped in line for line in rows) >= 2  # the arm in its rows, the listed request ids


# --- HTML -----------------------------------------------------------------------------------------

SCRIPT = "<script>alert(1)</script>"


def test_analyze_html_escapes_every_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    page_path = tmp_path / "report.html"
    assert (
        main(["analyze", str(analyzed(SCRIPT, tmp_path)), "--engine", "numpy", "--html", str(page_path)]) == 0
    )
    page = page_path.read_text()
    assert "<script" not in page.lower()
    assert page.count("&lt;script&gt;alert(1)&lt;/script&gt;") >= 3  # model rows, tenants, the data


def test_compare_html_escapes_every_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    page_path = tmp_path / "compare.html"
    assert (
        main(
            ["compare", *compared(SCRIPT, tmp_path), "--engine", "numpy", "--html", str(page_path), "--json"]
        )
        == 0
    )
    page = page_path.read_text()
    assert "<script" not in page.lower()
    assert page.count("&lt;script&gt;alert(1)&lt;/script&gt;") >= 3  # arm in context, charts, the data
