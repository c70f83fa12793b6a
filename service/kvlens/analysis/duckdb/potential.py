"""The "little reuse" finding's prefix potential (:func:`kvlens.analysis.diagnosis.prefix_potential`)
of the records view, in SQL, so that the ``duckdb`` engine's report is the numpy engine's.

The Python walk keeps a set of every hash seen and, for each record in arrival order, counts
the leading hashes already in it. In SQL, a hash is seen before record ``k`` exactly when the
first record holding it comes before ``k``: one ``min(k)`` per distinct hash, then a record's
shared blocks are the position of its first hash whose first record is itself (all of them
when there is none). The order is the numpy path's stable sort: arrival time, records without
one last, ties in input order (``src``, ``row``).

A hash is keyed by its JSON text as DuckDB normalizes it: a string quoted and unescaped
(``"\\u0041"`` is ``"A"``), an integer as its digits (``-0`` is ``0``, past 64 bits too), so
that two hashes share a key exactly when Python holds them equal (the record's hashes are
integers and strings only: ``1`` and ``"1"`` differ in both).
"""

from __future__ import annotations

from typing import Any

from kvlens.analysis.diagnosis import LAST_DIVERGENT_BLOCK, potential_numbers
from kvlens.analysis.duckdb.engine import Engine
from kvlens.definitions import DEFAULT_BLOCK_SIZE
from kvlens.records import RecordBatch, batch_from_objects, decode_prefix_hashes

_POTENTIAL = f"""
WITH ordered AS (
    SELECT row_number() OVER (ORDER BY arrival_time ASC NULLS LAST, src, row) AS k,
        prompt_tokens AS n,
        CASE WHEN block_size > 0 THEN block_size ELSE {DEFAULT_BLOCK_SIZE} END AS block,
        json_extract(prefix_hashes, '$[*]') AS hashes
    FROM {{source}} JOIN {{hashes}} USING (src, row)
    WHERE json_array_length(prefix_hashes) > 0
),
blocks AS (
    SELECT k, CAST(unnest(hashes) AS VARCHAR) AS hash, generate_subscripts(hashes, 1) - 1 AS position
    FROM ordered
),
first_held AS (SELECT hash, min(k) AS first FROM blocks GROUP BY hash),
diverges AS (
    SELECT blocks.k, min(blocks.position) AS shared
    FROM blocks JOIN first_held ON blocks.hash = first_held.hash AND first_held.first = blocks.k
    GROUP BY blocks.k
),
shared AS (
    SELECT COALESCE(diverges.shared, len(ordered.hashes)) AS shared, ordered.block, ordered.n
    FROM ordered LEFT JOIN diverges ON diverges.k = ordered.k
)
SELECT least(shared, {LAST_DIVERGENT_BLOCK}) AS bucket, count(*),
    CAST(sum(least(shared * block, n)) AS HUGEINT), CAST(sum(n) AS HUGEINT)
FROM shared GROUP BY bucket ORDER BY bucket
"""


def prefix_potential(
    engine: Engine, source: str = "records", hashes: str = "jsonl_hashes"
) -> dict[str, Any] | None:
    """The prefix potential of the records in ``source`` (a view or table with
    ``prompt_tokens``, ``arrival_time``, ``src`` and ``row``) whose hashes are in ``hashes``
    (:func:`kvlens.analysis.duckdb.inputs.load`'s ``jsonl_hashes``), or None when no record
    has ``prefix_hashes``."""
    ((held,),) = engine.connection.execute(f"SELECT count(*) FROM {hashes}").fetchall()
    if not held:  # no join of every record for nothing
        return None
    rows = engine.connection.execute(_POTENTIAL.format(source=source, hashes=hashes)).fetchall()
    if not rows:
        return None
    first_new = {int(bucket): int(count) for bucket, count, _, _ in rows}
    reachable = sum(int(row[2]) for row in rows)
    tokens = sum(int(row[3]) for row in rows)
    return potential_numbers(first_new, reachable, tokens)


# The record's fields the report's hash-reading sections use (kvlens.analysis.tenants,
# kvlens.analysis.misses), as the records view and the hashes table hold them.
_HASHED_FIELDS = (
    "request_id",
    "model",
    "prompt_tokens",
    "cached_tokens",
    "arrival_time",
    "replica",
    "tenant",
    "block_size",
    "prefix_hashes",
)


def hashed_records(engine: Engine, source: str = "records", hashes: str = "jsonl_hashes") -> RecordBatch:
    """The records of ``source`` that hold ``prefix_hashes``, in input order (``src``, ``row``),
    as a batch the numpy engine's walks over them read (they skip the records without hashes,
    so these give the same sections); an empty batch when none does. Held in Python: as many
    as hold hashes."""
    ((held,),) = engine.connection.execute(f"SELECT count(*) FROM {hashes}").fetchall()
    if not held:  # no join of every record for nothing
        return batch_from_objects([]).batch
    selected = ", ".join(
        "CAST(prefix_hashes AS VARCHAR)" if name == "prefix_hashes" else name for name in _HASHED_FIELDS
    )
    rows = engine.connection.execute(
        f"SELECT {selected} FROM {source} JOIN {hashes} USING (src, row) ORDER BY src, row"
    ).fetchall()
    objects = [
        {
            name: decode_prefix_hashes(value.encode()) if name == "prefix_hashes" else value
            for name, value in zip(_HASHED_FIELDS, row, strict=True)
            if value is not None
        }
        for row in rows
    ]
    return batch_from_objects(objects).batch
