"""Sizes and the default port, owned here and read by every room that states or parses them (the
settings, the command line, the vLLM plugin, the healthcheck, the DuckDB engine, the bandwidth
model). Standard library only: the vLLM plugin imports it inside vLLM's process.

A size is a number and an optional unit: ``14GiB``, ``16 GB``, ``1.5e10``, and DuckDB's own
display of its memory limit (``1.8 GiB``, ``512 bytes``); units in any case, decimal (``KB`` =
1000) or binary (``KiB`` = 1024). One parser for the flags, the settings and DuckDB's answer, so
what one accepts the others accept too.
"""

from __future__ import annotations

import math
import re
from typing import Any, Final

DEFAULT_PORT: Final = 9433  # ingest (POST /v1/records) and /metrics
ENV_PREFIX: Final = "KVLENS_"  # of every setting's environment variable (the command line's help says it)
DEFAULT_MEMORY_LIMIT: Final = "2GiB"  # DuckDB's memory before it spills (analyze, compare, convert)

SIZE_UNITS: Final = {
    "": 1,
    "b": 1,
    "bytes": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE: Final = re.compile(r"\s*((?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*")


def parse_size(text: str) -> float:
    """``14GiB``, ``16 GB``, ``1.5e10``, ``1.8 GiB`` -> bytes (above 0, finite); a ValueError
    with examples otherwise."""
    match = _SIZE.fullmatch(text.lower())
    if not match or match.group(2) not in SIZE_UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 14GiB, 16GB, 1.5e10)")
    value = float(match.group(1)) * SIZE_UNITS[match.group(2)]
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"not a positive size: {text!r}")
    return value


# The most memory one setting may ask for at its upper bound: a count setting's bound times the most
# one entry costs (measured) stays within it, so that a value with a zero too many is refused at
# start-up, naming the setting and its bound, rather than found later by the OOM killer. The
# settings that share a table (kv_events_remember_blocks and kv_events_max_held_blocks) have each
# their own share of it.
SETTING_MEMORY_BUDGET: Final = 4 * SIZE_UNITS["gib"]


def memory_bound(count: int, bytes_each: int) -> dict[str, Any]:
    """A count setting's ``Field`` bound: at most ``count`` entries of at most ``bytes_each`` bytes
    (checked here, when the settings are defined, to stay within :data:`SETTING_MEMORY_BUDGET`),
    ``bytes_each`` kept beside it for the settings loader's refusal and the settings table
    (:func:`worst_case`)."""
    if count * bytes_each > SETTING_MEMORY_BUDGET:
        raise ValueError(f"{worst_case(count, bytes_each)} is past the {SETTING_MEMORY_BUDGET:,}-byte budget")
    return {"le": count, "json_schema_extra": {"bytes_each": bytes_each}}


def worst_case(count: int, bytes_each: int) -> str:
    """``10,000,000 x 260 bytes = 2.4 GiB``: the memory a count setting at ``count`` may take."""
    return f"{count:,} x {bytes_each:,} bytes = {count * bytes_each / SIZE_UNITS['gib']:.1f} GiB"
