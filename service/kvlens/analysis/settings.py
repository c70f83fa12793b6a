"""The offline analysis's settings: the accounting, and the memory the DuckDB engine holds."""

from __future__ import annotations

from pydantic import Field, field_validator

from kvlens import limits
from kvlens.accounting import Accounting


class AnalysisSettings(Accounting):
    """What ``analyze``, ``compare`` and ``convert`` read: everything that counts, and a memory limit."""

    analyze_memory_limit: str = Field(
        limits.DEFAULT_MEMORY_LIMIT,
        description="Memory `kvlens analyze --engine duckdb` holds before it spills (`--memory-limit`).",
    )

    @field_validator("analyze_memory_limit")
    @classmethod
    def _a_size(cls, text: str) -> str:
        try:
            limits.parse_size(text)  # the parser the engine reads it with
        except ValueError:
            raise ValueError("must be a size such as 2GiB, 16GB or 1.5e10") from None
        return text
