"""The ``--json`` outputs: each carries a ``schema`` key, ``kvlens.<output>/v<N>``, that names
the JSON Schema file shipped in the package, ``kvlens/schemas/<output>.v<N>.json``."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any


def schema_file_name(schema: str) -> str:
    """``kvlens.analyze/v1`` -> ``analyze.v1.json``."""
    name, separator, version = schema.removeprefix("kvlens.").partition("/")
    if not schema.startswith("kvlens.") or not name or not separator or not version.startswith("v"):
        raise ValueError(f"not a kvlens output schema: {schema!r}")
    return f"{name}.{version}.json"


def json_schema(schema: str) -> dict[str, Any]:
    """The JSON Schema of the output whose ``schema`` key is ``schema``."""
    text = (resources.files("kvlens") / "schemas" / schema_file_name(schema)).read_text(encoding="utf-8")
    loaded: dict[str, Any] = json.loads(text)
    return loaded
