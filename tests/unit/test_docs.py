"""The documentation: its generated tables match the code they describe (metrics, settings, OTLP
attributes, every command's flags), its examples run, and the README keeps its two commands.
The site build itself (`mkdocs build --strict`, every link and anchor) is scripts/check's."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest

from kvlens.config import load_settings

ROOT = Path(__file__).resolve().parent.parent.parent
GENERATOR = runpy.run_path(str(ROOT / "scripts" / "docs_tables.py"))


@pytest.mark.parametrize("page", sorted(GENERATOR["TABLES"]))
def test_generated_tables_match_the_code(page: str) -> None:
    text = (ROOT / "docs" / page).read_text()
    assert text == GENERATOR["rendered"](page), f"docs/{page}: run .venv/bin/python scripts/docs_tables.py"


def test_the_settings_page_example_loads(tmp_path: Path) -> None:
    text = (ROOT / "docs" / "settings.md").read_text()
    example = re.search(r"Example `kvlens.yaml`:\n\n```yaml\n(.*?)```", text, re.S)
    assert example, "docs/settings.md lacks the example settings file"
    path = tmp_path / "kvlens.yaml"
    path.write_text(example.group(1))
    settings = load_settings(path)
    assert settings.tails and settings.scrape_targets and settings.models


def test_the_readme_keeps_its_two_commands() -> None:
    """A newcomer's first two commands, word for word (CI runs the second; the integration tests
    assume the first's `serve` extra alone)."""
    blocks = re.findall(r"```sh\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert "python3 -m venv .venv && .venv/bin/pip install -q '.[serve]' && .venv/bin/kvlens demo\n" in blocks
    assert "./scripts/test\n" in blocks
