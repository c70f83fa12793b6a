"""Check a ``--json`` output against the JSON Schema its ``schema`` key names."""

from __future__ import annotations

from typing import Any

import jsonschema

from kvlens.outputs import json_schema


def validate(document: dict[str, Any]) -> None:
    """Raise ``jsonschema.ValidationError`` (its path and reason) where ``document`` does not fit."""
    schema = json_schema(document["schema"])
    jsonschema.Draft202012Validator(schema).validate(document)
