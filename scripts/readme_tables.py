"""Rewrite the generated tables in README.md (metrics, settings, OTLP attributes) from the code."""

from __future__ import annotations

import re
from pathlib import Path

from kvlens.config import settings_table
from kvlens.exporter.metrics import metrics_table
from kvlens.sources.otlp import attributes_table

README = Path(__file__).resolve().parent.parent / "README.md"


def main() -> None:
    text = README.read_text()
    for name, table in (
        ("metrics", metrics_table()),
        ("settings", settings_table()),
        ("otlp", attributes_table()),
    ):
        text = re.sub(
            rf"(<!-- {name}:start -->\n).*?(\n<!-- {name}:end -->)",
            lambda m, table=table: m.group(1) + table + m.group(2),
            text,
            flags=re.S,
        )
    README.write_text(text)


if __name__ == "__main__":
    main()
