"""The record's schema as DuckDB SQL: each field's column type, and the checks the validator
makes (:mod:`kvlens.records`) written as SQL for rows that no Python reads (Parquet scanned in
place, JSON lines parsed by DuckDB).

A label (a model's or tenant's name) is checked in three spellings, all built from the one rule
in :mod:`kvlens.records.labels`: Python's :func:`~kvlens.records.labels.valid_label` decides;
:func:`~kvlens.records.labels.invalid_label_sql` is its RE2 spelling, for when distinct labels
are too many for Python; :func:`~kvlens.records.labels.beyond_short_ascii` is the cheap GLOB
that leaves only the labels Python must see (short printable ASCII is valid).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvlens import records, sqltext
from kvlens.records.labels import beyond_short_ascii, invalid_label_sql

_SQL_TYPE = {int: "BIGINT", float: "DOUBLE", str: "VARCHAR"}
SPEC = {spec.name: spec for spec in records.FIELDS}


def sql_type(name: str) -> str:
    """The DuckDB type of the record's field ``name``."""
    return _SQL_TYPE[SPEC[name].kind]


def rejection_sql(columns: set[str] | Sequence[str], invalid_labels: bool | None = None) -> str:
    """``'field:reason'`` of the first rule a row breaks (in the record's field order), else
    NULL: the bounds are read off :data:`kvlens.records.FIELDS`, the schema's own.
    ``invalid_labels`` (:func:`kvlens.analysis.duckdb.parquet.invalid_labels`): False, every
    label is valid; True, the invalid ones are in the table ``invalid_labels``; None, unknown:
    each row is checked by :func:`~kvlens.records.labels.invalid_label_sql`."""
    rules: list[tuple[str, str, str]] = []
    for spec in records.FIELDS:
        if spec.name not in columns:
            if spec.required:
                rules.append(("TRUE", spec.name, "missing"))
            continue
        name = spec.name
        if spec.required:
            rules.append((f"{name} IS NULL", name, "missing"))
        if spec.kind is float:
            rules.append((f"(isnan({name}) OR isinf({name}))", name, "not_finite"))
        if spec.kind in (int, float) and spec.low is not None:
            rules.append((f"{name} < {sqltext.number(spec.low)}", name, "out_of_range"))
        if spec.kind in (int, float) and spec.high is not None:
            rules.append((f"{name} > {sqltext.number(spec.high)}", name, "out_of_range"))
        if spec.kind is str and spec.is_label:
            if invalid_labels is None:
                rules.append((invalid_label_sql(name), name, "invalid_label"))
            elif invalid_labels:
                rules.append((f"{name} IN (SELECT label FROM invalid_labels)", name, "invalid_label"))
        elif spec.kind is str and spec.max_length is not None:
            rules.append((f"length({name}) > {spec.max_length}", name, "too_long"))
        if name == "cached_tokens":
            rules.append(("cached_tokens > prompt_tokens", name, "cached_exceeds_prompt"))
    cases = " ".join(f"WHEN {condition} THEN '{name}:{reason}'" for condition, name, reason in rules)
    return f"CASE {cases} END"


def labels_to_check(source: str, labels: list[str]) -> str:
    """A query of the distinct values of the ``labels`` columns of the query or table
    ``source`` that are not short printable ASCII (:func:`beyond_short_ascii`)."""
    return " UNION ".join(
        f"SELECT DISTINCT {name} AS label FROM {source} WHERE {beyond_short_ascii(name)}" for name in labels
    )
