"""MkDocs hook: the files at the repository's root that are pages of the site too.

README.md is the home page, RUNBOOK.md and CHANGELOG.md pages of their own: each is written
once, where GitHub shows it, and its page in docs/ holds only a line saying so. Their links are
written for the repository (README.md links ``docs/metrics.md``, a page links
``../RUNBOOK.md#kvlensdown``); here they are mapped to the site's pages, so that the same links
work on GitHub and in the site, and ``mkdocs build --strict`` checks every one of them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# page in docs/ -> the file at the root it shows
PAGES_AT_ROOT = {"index.md": "README.md", "runbook.md": "RUNBOOK.md", "changelog.md": "CHANGELOG.md"}
SITE_PAGE = {source: page for page, source in PAGES_AT_ROOT.items()}


def _link_target(target: str, at_root: bool) -> str:
    """A Markdown link's target as the site has it: ``docs/x.md`` (from the root) is ``x.md``,
    a root file is its page, ``../README.md`` (from docs/) is ``index.md``."""
    path, hash_, anchor = target.partition("#")
    if at_root and path.startswith("docs/"):
        path = path.removeprefix("docs/")
    elif not at_root and path.startswith("../") and path[3:] in SITE_PAGE:
        path = SITE_PAGE[path[3:]]
    elif at_root and path in SITE_PAGE:
        path = SITE_PAGE[path]
    return path + hash_ + anchor


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    source = PAGES_AT_ROOT.get(page.file.src_uri)
    text = (ROOT / source).read_text() if source else markdown
    return re.sub(
        r"\]\(([^)\s]+)\)",
        lambda m: "](" + _link_target(m.group(1), at_root=source is not None) + ")",
        text,
    )
