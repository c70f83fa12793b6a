"""``kvlens analyze``: read files, build the report, diagnose, calibrate.

Two engines compute the report's :class:`~kvlens.analysis.report.Summary`: ``numpy`` holds the
records in memory (the live exporter's reducer, called); ``duckdb`` (the ``scale`` extra) runs
the reducer as SQL out of core (:mod:`kvlens.analysis.duckdb`). Everything after the summary
is one code path. What needs ``prefix_hashes`` (the prefix potential, the ``cross_tenant``
and ``misses`` sections) both engines read: DuckDB keeps the records that hold them apart
(:mod:`kvlens.analysis.duckdb.potential`).
"""

from __future__ import annotations

import gzip
import importlib.util
import os
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvlens.accounting import Accounting
from kvlens.analysis import calibration, diagnosis, misses, reader, report, sessions, tenants
from kvlens.definitions import prompt_length_labels
from kvlens.records import RecordBatch, batch_from_objects

ENGINES = ("numpy", "duckdb")
CALIBRATION_MAX_POINTS = 200_000  # per model, duckdb engine: past it an even sample is fitted
# Local JSON lines under this read faster in numpy: DuckDB's import and connection cost about
# 0.2 CPU s, which its faster read repays from about 100k records (19 MB) on a 2-core machine.
AUTO_DUCKDB_BYTES = 16 * 1024 * 1024
SESSION_SNIFF_BYTES = 64 * 1024


def analyze(
    paths: list[str],
    settings: Accounting,
    *,
    format_name: str | None = None,
    model: str | None = None,
    progress: Callable[[int], None] | None = None,
    prefill_points: Sequence[Path] = (),
    engine: str = "numpy",
    memory_limit: str | None = None,
) -> tuple[dict[str, Any], list[calibration.Fit]]:
    """The report of the records in ``paths`` (none: an empty report), with the calibration of
    each model that has prefill times and of each model in the ``prefill_points`` tables."""
    labels = prompt_length_labels(settings.prompt_length_edges)
    if engine == "duckdb":
        from kvlens.analysis.duckdb import inputs, potential
        from kvlens.analysis.duckdb import summary as in_duckdb
        from kvlens.analysis.duckdb.engine import Engine, engine_errors
        from kvlens.limits import DEFAULT_MEMORY_LIMIT

        store = Engine(memory_limit=memory_limit or DEFAULT_MEMORY_LIMIT)
        try:
            with engine_errors(store.memory_limit, store.spill_directory):
                loaded = inputs.load(
                    store,
                    paths,
                    format_name=format_name,
                    model=model,
                    progress=progress,
                    check_later=True,
                    hashes=True,
                )
                summarized = in_duckdb.summarize(
                    store, "records", settings.prompt_length_edges, settings.default_model, loaded.unchecked
                )
                summary = summarized.summary
                read, records = loaded.read, sum(cell.requests for cell in summary.cells.values())
                # one model's points at a time, fitted as they come
                fits = [
                    calibration.fit(*points)
                    for points in in_duckdb.calibration_inputs(
                        store, summarized.prefill_counts, CALIBRATION_MAX_POINTS
                    )
                ]
                span = time_range(*summarized.arrivals)
                result = _report(
                    summary,
                    settings,
                    labels,
                    read,
                    records,
                    paths,
                    span,
                    lambda: potential.prefix_potential(store),
                )
                hashed = potential.hashed_records(store)
                _hash_sections(result, hashed, settings)
        finally:
            store.close()
    else:
        read = reader.read(paths, format_name=format_name, model=model, progress=progress)
        derived = report.Derived.of(
            read.batch, settings.prompt_length_edges, settings.cost_model_for, settings.default_model
        )
        summary = report.summarize(derived)
        arrivals = read.batch.arrival_time[~np.isnan(read.batch.arrival_time)]
        span = time_range(
            float(arrivals.min()) if arrivals.size else None,
            float(arrivals.max()) if arrivals.size else None,
            int(arrivals.size),
        )
        result = _report(
            summary,
            settings,
            labels,
            read,
            len(read.batch),
            paths,
            span,
            lambda: diagnosis.prefix_potential(derived),
        )
        result["sessions"] = sessions.session_report(read.batch)
        _hash_sections(result, read.batch, settings, derived)
        fits = [
            calibration.fit(
                name,
                read.batch.prompt_tokens[rows],
                read.batch.cached_tokens[rows],
                read.batch.prefill_seconds[rows],
            )
            for name, rows in derived.reduced.rows_by_model()
            if not np.isnan(read.batch.prefill_seconds[rows]).all()
        ]
    return _calibrated(result, fits, settings, prefill_points)


def _hash_sections(
    result: dict[str, Any], batch: RecordBatch, settings: Accounting, derived: report.Derived | None = None
) -> None:
    """The report's sections read from ``prefix_hashes``, walked over the records that hold
    them (``batch``: all records, or only those, in input order: the others add nothing)."""
    shared = tenants.cross_tenant(batch, settings.tenant_remember_blocks)
    if shared is not None:  # only records with a tenant and prefix_hashes add the section
        result["cross_tenant"] = shared
    if derived is None:
        derived = report.Derived.of(
            batch, settings.prompt_length_edges, settings.cost_model_for, settings.default_model
        )
    result["misses"] = misses.request_misses(derived)


def _calibrated(
    result: dict[str, Any], fits: list[calibration.Fit], settings: Accounting, prefill_points: Sequence[Path]
) -> tuple[dict[str, Any], list[calibration.Fit]]:
    """The report with the fits of the records and of the ``prefill_points`` tables."""
    fits = [*fits, *_point_fits(settings, prefill_points)]
    result["calibration"] = [
        {**fit.as_dict(), "residuals": fit.residuals, "sample": fit.sample} for fit in fits
    ]
    return result, fits


def from_aggregates(
    paths: Sequence[Path], settings: Accounting, *, prefill_points: Sequence[Path] = ()
) -> tuple[dict[str, Any], list[calibration.Fit]]:
    """The report of a warehouse's results of the ``--print-sql`` statements (the same settings):
    everything a direct analysis reports but the calibration from records, which needs each
    request (``prefill_points`` still calibrate)."""
    from kvlens.analysis import warehouse

    summary = warehouse.summary_from(warehouse.read_aggregates(paths), paths)
    records = sum(cell.requests for cell in summary.cells.values())
    files = [str(path) for path in paths]
    read = reader.ReadResult(
        batch=batch_from_objects([]).batch, lines=records, formats=dict.fromkeys(files, "aggregates")
    )
    labels = prompt_length_labels(settings.prompt_length_edges)
    span = time_range(None, None, 0)  # the statements carry no arrival times
    result = _report(summary, settings, labels, read, records, files, span, lambda: None)
    _hash_sections(result, read.batch, settings)  # no record, no hashes: as a direct report's
    return _calibrated(result, [], settings, prefill_points)


def time_range(first: float | None, last: float | None, records: int) -> dict[str, Any]:
    """The first and last ``arrival_time`` (unix seconds) of the accepted records, and how many
    carry one (the field is optional: the range may rest on a part of the records)."""
    return {"first_arrival": first, "last_arrival": last, "records": records}


def choose_engine(requested: str, files: Sequence[str]) -> str:
    """``auto``: the faster engine, both giving the same report (the diagnosis's prefix
    potential too: :mod:`kvlens.analysis.duckdb.potential`). That is duckdb (the ``scale``
    extra) when installed, for Parquet, URLs, pipes and every input past
    :data:`AUTO_DUCKDB_BYTES`; numpy for the small local files under it, where DuckDB's
    start costs more than it saves, and for local records that name sessions (only the numpy
    engine reports reuse per session). ``files`` is what :func:`kvlens.analysis.reader.resolve`
    gave: the engine chosen reads those files, whichever it is."""
    if requested != "auto":
        return requested
    if importlib.util.find_spec("duckdb") is None:  # found, not imported: numpy may be the choice
        return "numpy"
    local = [path for path in files if path != "-"]
    if len(local) < len(files) or any(not os.path.isfile(path) or reader.is_parquet(path) for path in local):
        return "duckdb"
    if sum(os.path.getsize(path) for path in local) < AUTO_DUCKDB_BYTES:
        return "numpy"
    # Per-session reuse and the trace's theoretical reuse are the numpy engine's (from each
    # record): a replay's records name their session on every line, so the first line tells.
    return "numpy" if any(_names_sessions(path) for path in local) else "duckdb"


def _names_sessions(path: str) -> bool:
    """Whether the first line of a JSON-lines file (gzip read) names a session or a trace's
    theoretical reuse; only its first 64 KiB are read."""
    try:
        with (gzip.open if path.endswith(".gz") else open)(path, "rb") as file:
            first = file.read(SESSION_SNIFF_BYTES).split(b"\n", 1)[0]
    except (OSError, EOFError, zlib.error):
        return False  # the engine chosen reports the file's own error
    return b'"session_id"' in first or b'"trace_reusable_tokens"' in first


def _report(
    summary: report.Summary,
    settings: Accounting,
    labels: list[str],
    read: reader.ReadResult,
    records: int,
    paths: list[str],
    span: dict[str, Any],
    potential: Callable[[], dict[str, Any] | None],
) -> dict[str, Any]:
    result = report.build_from(summary, settings.cost_model_for, labels)
    result["input"] = {
        "files": paths,
        "formats": read.formats,
        "lines": read.lines,
        "ignored": read.ignored,
        "records": records,
        "skipped_total": read.skipped_total,
        "skipped": dict(sorted(read.skipped.items())),
        "skipped_examples": read.examples,
        "time_range": span,
    }
    result["diagnosis"] = diagnosis.diagnose(summary, labels, result, potential)
    result["sessions"] = None  # the numpy engine's, from each record (see sessions.session_report)
    result["misses"] = None  # set by _hash_sections for both engines, from prefix_hashes
    return result


def _point_fits(settings: Accounting, prefill_points: Sequence[Path]) -> list[calibration.Fit]:
    def layers(name: str) -> int | None:
        shape = settings.model_shapes.get(name)
        return shape.num_hidden_layers if shape is not None else None

    return [
        calibration.fit_points(points)
        for path in prefill_points
        for points in calibration.read_points(path, layers)
    ]
