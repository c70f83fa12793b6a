"""``kvlens analyze`` and ``kvlens compare`` out of core: the reducer as SQL, run by DuckDB
in-process (the ``scale`` extra).

The records never sit in Python: JSON lines go through the same reader and validator as the
numpy path, one block at a time, into a DuckDB table spilled to disk past the memory limit
(:mod:`.jsonl`); Parquet files are scanned where they lie, checked against the bounds
:class:`kvlens.records.Record` declares (:mod:`.sql`), and copied into memory once only when
they fit in half the limit (:mod:`.parquet`); one view ``records`` holds both
(:mod:`.inputs`). The per-record decisions of :func:`kvlens.reduce.reduce` are the view of
:func:`kvlens.reduce_sql.reduced_sql`; :mod:`.summary` computes the report's
:class:`kvlens.analysis.report.Summary` from it in a few scans, with exact order statistics
in bounded memory (:mod:`.order_statistics`), and :mod:`.compare` answers ``kvlens compare``'s
questions of two or more arms. Each engine's report is built by the numpy path's code.

Modules, each importing only those before it: :mod:`.engine` (the connection, its memory
limit and errors), :mod:`.sql`, :mod:`.jsonl`, :mod:`.parquet`, :mod:`.inputs`,
:mod:`.order_statistics`, :mod:`.summary`, :mod:`.compare`, :mod:`.potential` (the diagnosis's
prefix potential, after :mod:`kvlens.analysis.diagnosis`).
"""
