"""``kvlens analyze``: read files, build the report, diagnose, calibrate."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvlens.analysis import calibration, diagnosis, reader, report
from kvlens.config import Settings


def analyze(
    paths: list[str],
    settings: Settings,
    *,
    format_name: str | None = None,
    model: str | None = None,
    progress: Callable[[int], None] | None = None,
    prefill_points: Sequence[Path] = (),
) -> tuple[dict[str, Any], list[calibration.Fit]]:
    """The report of the records in ``paths`` (none: an empty report), with the calibration of
    each model that has prefill times and of each model in the ``prefill_points`` tables."""
    read = reader.read(paths, format_name=format_name, model=model, progress=progress)
    derived = report.Derived.of(
        read.batch, settings.prompt_length_edges, settings.cost_model_for, settings.default_model
    )
    result = report.build(derived)
    result["input"] = {
        "files": paths,
        "formats": read.formats,
        "lines": read.lines,
        "ignored": read.ignored,
        "records": len(read.batch),
        "skipped_total": read.skipped_total,
        "skipped": dict(sorted(read.skipped.items())),
        "skipped_examples": read.examples,
    }
    result["diagnosis"] = diagnosis.diagnose(derived, result)
    fits = [
        calibration.fit(
            name,
            read.batch.prompt_tokens[rows],
            read.batch.cached_tokens[rows],
            read.batch.prefill_seconds[rows],
        )
        for name in sorted(set(derived.model))
        if (rows := derived.model == name).any() and not np.isnan(read.batch.prefill_seconds[rows]).all()
    ]

    def layers(name: str) -> int | None:
        shape = settings.model_shapes.get(name)
        return shape.layers if shape is not None else None

    fits += [
        calibration.fit_points(points)
        for path in prefill_points
        for points in calibration.read_points(path, layers)
    ]
    result["calibration"] = [{**fit.as_dict(), "residuals": fit.residuals} for fit in fits]
    return result, fits
