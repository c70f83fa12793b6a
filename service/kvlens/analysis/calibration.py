"""Fit the cost model to measured prefill times: from records, or from a table of measured points.

``prefill_seconds ~ a*m + b*(m*h + m*(m+1)/2) + c`` with ``m = n - h``: the remaining work of
DESIGN section 1 (:func:`kvlens.definitions.remaining_work_terms`) plus a fixed overhead per
forward. The fit is non-negative least squares on relative errors (each row divided by its
time), so a 0.2 ms point weighs as much as a 40 ms one. Two alternatives are fitted the same way
and reported beside it: ``C(m)`` (the new tokens alone, as if they did not attend to the cached
ones) and linear only (``a*m + c``). A fit is used only when the remaining model is the best of
the three, has an R^2 of at least ``MIN_R2`` and rests on enough requests; otherwise the report
says why. A usable fit gives the sidecar a cost model in seconds (``a`` and ``b``; the constant
``c`` is not saved by the cache and a batching engine shares it across a batch, so it is left
out), and compute saved then reads as modelled prefill seconds.

R^2 is ``1 - SSE/SST`` of the times themselves; the median error is the median of
``|modelled - measured| / measured``.
"""

from __future__ import annotations

import csv
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from kvlens.definitions import SECONDS, CostModel, remaining_work_terms, work_terms
from kvlens.errors import InputError
from kvlens.shapes import ModelShape

FloatArray = npt.NDArray[np.float64]

MIN_R2: Final = 0.5
MIN_REQUESTS: Final = 20  # records: single requests, noisy
MIN_POINTS: Final = 6  # a measured table: each point a median of repeated runs
RESIDUAL_SAMPLE: Final = 400

REMAINING: Final = "remaining"
# What each candidate model's coefficients multiply, besides the constant: (terms of a, terms of b).
CANDIDATES: Final[dict[str, Callable[[FloatArray, FloatArray], tuple[FloatArray, ...]]]] = {
    REMAINING: remaining_work_terms,
    "suffix_only": lambda n, h: work_terms(n - h),  # C(m): ignores the attention to the prefix
    "linear_only": lambda n, h: (n - h,),
}


@dataclass(frozen=True)
class Quality:
    r2: float | None
    median_error: float | None
    relative_sse: float  # what the fit minimised: sum of squared relative errors


@dataclass(frozen=True)
class SavedFraction:
    """At one measured ``(n, h)`` with a measured ``(n, 0)`` beside it: the share of prefill time
    the cache saved, as measured and as each model gives it."""

    n: int
    h: int
    measured: float
    fitted: float  # the fit with its constant: 1 - t(n, h) / t(n, 0)
    cost_model: float  # the exported ratio: C(h) / C(n), without the constant
    flops: float | None  # C(h) / C(n) in FLOPs, when the table gives the shape

    def as_dict(self) -> dict[str, Any]:
        return {
            "n": self.n,
            "h": self.h,
            "measured": self.measured,
            "fitted": self.fitted,
            "cost_model": self.cost_model,
            "flops": self.flops,
        }


@dataclass(frozen=True)
class Fit:
    model: str
    requests: int  # records or points fitted
    a: float  # seconds per new token
    b: float  # seconds per causal pair
    c: float  # seconds per forward
    quality: Quality
    alternatives: dict[str, Quality]
    usable: bool
    reason: str
    residuals: list[tuple[float, float]]  # (modelled, measured) for a sample
    source: str = "records"
    sample: list[tuple[int, int, float]] = field(default_factory=list)  # (n, h, measured), same sample
    saved: list[SavedFraction] = field(default_factory=list)
    per_layer: bool = False  # times (and so a, b, c) are of one layer: the layer count is unknown

    @property
    def r2(self) -> float | None:
        return self.quality.r2

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "source": self.source,
            "per_layer": self.per_layer,
            "requests": self.requests,
            "a_seconds_per_token": self.a,
            "b_seconds_per_pair": self.b,
            "c_seconds": self.c,
            "pairs_per_token": self.a / self.b if self.b > 0 else None,
            "r2": self.quality.r2,
            "median_error": self.quality.median_error,
            "alternatives": {
                name: {"r2": q.r2, "median_error": q.median_error} for name, q in self.alternatives.items()
            },
            "usable": self.usable,
            "reason": self.reason,
            "saved_fraction": [s.as_dict() for s in self.saved],
        }

    def cost_model(self) -> CostModel:
        return CostModel(a=self.a, b=self.b, unit=SECONDS)


def _fit_candidates(n: FloatArray, h: FloatArray, y: FloatArray) -> dict[str, tuple[FloatArray, FloatArray]]:
    """Each candidate's coefficients (the constant last) minimising the squared relative error,
    and its modelled times. The candidates share columns (the new tokens, the constant), so the
    weighted columns of all of them are reduced to one small R factor in one pass over the
    requests (:func:`kvlens.nnls.reduce`), and each candidate is solved on its columns of it."""
    from kvlens.nnls import nnls, reduce

    unique: list[FloatArray] = []  # every distinct column, the constant last

    def place(column: FloatArray) -> int:
        found = next((i for i, seen in enumerate(unique) if np.array_equal(seen, column)), None)
        if found is None:
            unique.append(column)
            return len(unique) - 1
        return found

    terms = {name: terms_of(n, h) for name, terms_of in CANDIDATES.items()}
    places = {name: [place(column) for column in columns] for name, columns in terms.items()}
    constant = len(unique)
    weighted = np.empty((y.size, constant + 1), order="F")  # column-major: what the QR reads
    for i, column in enumerate(unique):
        np.divide(column, y, out=weighted[:, i])
    np.divide(1.0, y, out=weighted[:, constant])
    scale = weighted.max(axis=0)
    scale[scale <= 0] = 1.0  # a column of zeros (no new tokens anywhere) stays zero
    weighted /= scale
    small, target = reduce(weighted, np.ones_like(y))
    fitted = {}
    for name, columns in terms.items():
        chosen = [*places[name], constant]
        coefficients, _ = nnls(small[:, chosen], target, rows=y.size)
        coefficients = coefficients / scale[chosen]
        modelled = np.full_like(y, coefficients[-1])
        for column, coefficient in zip(columns, coefficients[:-1], strict=True):
            modelled += coefficient * column
        fitted[name] = (coefficients, modelled)
    return fitted


def _quality(y: FloatArray, modelled: FloatArray) -> Quality:
    spread = float(((y - y.mean()) ** 2).sum())
    relative = (modelled - y) / y
    return Quality(
        r2=1.0 - float(((y - modelled) ** 2).sum()) / spread if spread > 0 else None,
        median_error=float(np.median(np.abs(relative))),
        relative_sse=float((relative**2).sum()),
    )


def fit(
    model: str,
    prompt_tokens: npt.ArrayLike,
    cached_tokens: npt.ArrayLike,
    prefill_seconds: npt.ArrayLike,
    *,
    min_requests: int = MIN_REQUESTS,
    source: str = "records",
) -> Fit:
    """Fit the remaining-work model and its alternatives to the requests with a positive time."""
    y_all = np.asarray(prefill_seconds, dtype=np.float64)
    present = np.isfinite(y_all) & (y_all > 0)  # relative errors need a time to be relative to
    n = np.asarray(prompt_tokens, dtype=np.float64)[present]
    h = np.asarray(cached_tokens, dtype=np.float64)[present]
    y = y_all[present]
    if y.size < min_requests:
        nothing = Quality(None, None, 0.0)
        reason = f"{y.size} timed requests, fewer than {min_requests}: not used"
        return Fit(model, int(y.size), 0.0, 0.0, 0.0, nothing, {}, False, reason, [], source)

    fitted = _fit_candidates(n, h, y)
    qualities = {name: _quality(y, modelled) for name, (_, modelled) in fitted.items()}
    coefficients, modelled = fitted[REMAINING]
    a, b, c = coefficients.tolist()
    quality = qualities.pop(REMAINING)
    usable, reason = _judge(quality, qualities, a, b)
    pick = np.random.default_rng(0).choice(y.size, size=min(RESIDUAL_SAMPLE, y.size), replace=False)
    picked = np.sort(pick)
    residuals = [(float(modelled[i]), float(y[i])) for i in picked]
    sample = [(int(n[i]), int(h[i]), float(y[i])) for i in picked]
    return Fit(model, int(y.size), a, b, c, quality, qualities, usable, reason, residuals, source, sample)


def _judge(quality: Quality, alternatives: dict[str, Quality], a: float, b: float) -> tuple[bool, str]:
    tolerance = 1e-9 * max(quality.relative_sse, 1e-300)  # C(m) equals the remaining model when h = 0
    better = [name for name, q in alternatives.items() if q.relative_sse < quality.relative_sse - tolerance]
    if better:
        best = min(better, key=lambda name: alternatives[name].relative_sse)
        return False, (
            f"the {best.replace('_', ' ')} model fits better (median error "
            f"{alternatives[best].median_error:.3f} vs {quality.median_error:.3f}): the times do not "
            "follow C(n) - C(h); check that the cached tokens are the engine's own: not used"
        )
    if quality.r2 is None or quality.r2 < MIN_R2:
        shown = "none" if quality.r2 is None else f"{quality.r2:.3f}"
        return False, f"R^2 {shown} under {MIN_R2}: not used"
    if a <= 0 and b <= 0:
        return False, "the fit gives no work per token or per pair: not used"
    return True, "ok"


# --- a table of measured prefill points -------------------------------------------------------

TIME_COLUMNS: Final = {"seconds": 1.0, "ms": 1e-3, "seconds_per_layer": 1.0, "ms_per_layer": 1e-3}
SHAPE_COLUMNS: Final = ("hidden", "n_heads", "n_kv_heads", "head_dim", "intermediate")


@dataclass
class Points:
    """The measured points of one model (or shape): times in seconds for the whole model when
    ``layers`` is known, else per layer as measured."""

    name: str
    n: list[int] = field(default_factory=list)
    h: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    per_layer: bool = False
    layers: int | None = None
    shape: ModelShape | None = None  # from the table's shape columns, for the FLOPs comparison


def read_points(path: Path, layers_for: Callable[[str], int | None]) -> list[Points]:
    """Points from a CSV with a ``shape`` (or ``model``) column, ``n``, ``h`` and one time column
    (``ms_per_layer`` as ``../shared/data/prefill_h200.csv`` has it, ``seconds_per_layer``,
    ``ms`` or ``seconds``). Optional: ``m`` (checked against ``n - h``), ``layers``, and the
    shape columns ``hidden, n_heads, n_kv_heads, head_dim, intermediate``. ``layers_for`` gives
    a model's layer count from the settings (``model_shapes``) when the table has none."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise InputError(f"{path}: cannot read the prefill points: {error}") from None
    rows = csv.DictReader(text.splitlines())
    columns = set(rows.fieldnames or ())
    name_column = next((c for c in ("shape", "model") if c in columns), None)
    time_column = next((c for c in TIME_COLUMNS if c in columns), None)
    missing = [
        label for label, found in (("shape or model", name_column), ("a time", time_column)) if not found
    ]
    missing += [c for c in ("n", "h") if c not in columns]
    if missing or name_column is None or time_column is None:
        raise InputError(f"{path}: the prefill points lack the column(s) {', '.join(missing)}")
    by_name: dict[str, Points] = {}
    for line, row in enumerate(rows, start=2):
        try:
            name = row[name_column].strip()
            n, h = int(row["n"]), int(row["h"])
            seconds = float(row[time_column]) * TIME_COLUMNS[time_column]
            if not name or not 0 <= h <= n or n < 1 or not (np.isfinite(seconds) and seconds > 0):
                raise ValueError("needs a name, 0 <= h <= n, n >= 1 and a positive time")
            if row.get("m") not in (None, "") and int(row["m"]) != n - h:
                raise ValueError(f"m = {row['m']} is not n - h = {n - h}")
            points = by_name.setdefault(name, _new_points(name, row, time_column, layers_for))
        except (TypeError, ValueError) as error:
            raise InputError(f"{path} line {line}: {error}") from None
        points.n.append(n)
        points.h.append(h)
        points.seconds.append(seconds * (points.layers or 1) if points.per_layer else seconds)
    return list(by_name.values())


def _new_points(
    name: str, row: dict[str, str], time_column: str, layers_for: Callable[[str], int | None]
) -> Points:
    per_layer = time_column.endswith("_per_layer")
    layers = int(row["layers"]) if row.get("layers") else layers_for(name)
    shape = None
    if all(row.get(c) for c in SHAPE_COLUMNS):
        shape = ModelShape(
            num_hidden_layers=1,
            num_key_value_heads=int(row["n_kv_heads"]),
            head_dim=int(row["head_dim"]),
            hidden_size=int(row["hidden"]),
            num_attention_heads=int(row["n_heads"]),
            intermediate_size=int(row["intermediate"]),
        )
    return Points(name, per_layer=per_layer, layers=layers, shape=shape)


def fit_points(points: Points) -> Fit:
    """The fit of one model's measured points, with the saved fraction at each point that has a
    measurement without cache beside it."""
    n, h, y = (np.asarray(v, dtype=np.float64) for v in (points.n, points.h, points.seconds))
    result = fit(points.name, n, h, y, min_requests=MIN_POINTS, source="points")
    saved = list(_saved_fractions(points, result)) if result.requests else []
    if result.usable and points.per_layer and points.layers is None:
        result = replace(
            result,
            per_layer=True,
            usable=False,
            reason=f"times are per layer and the layer count is unknown (a `layers` column, or "
            f"model_shapes.{points.name}.num_hidden_layers in --config): not written",
        )
    return replace(result, saved=saved)


def _saved_fractions(points: Points, result: Fit) -> Iterable[SavedFraction]:
    without_cache = {n: t for n, h, t in zip(points.n, points.h, points.seconds, strict=True) if h == 0}
    cost = result.cost_model()
    flops = points.shape.prefill_cost_model() if points.shape is not None else None
    for n, h, t in zip(points.n, points.h, points.seconds, strict=True):
        if h == 0 or n not in without_cache:
            continue
        full = float(cost.work(n)) + result.c
        remaining = cost.remaining_work_of(n, h) + result.c
        yield SavedFraction(
            n=n,
            h=h,
            measured=1.0 - t / without_cache[n],
            fitted=float(1.0 - remaining / full),
            cost_model=float(cost.work(h) / cost.work(n)),
            flops=float(flops.work(h) / flops.work(n)) if flops is not None else None,
        )


def cost_model_file(fits: list[Fit]) -> dict[str, Any]:
    """Settings the sidecar accepts (``kvlens serve --config``): cost models of usable fits, in
    seconds."""
    return {"cost_models": {f.model: {"a": f.a, "b": f.b, "unit": SECONDS} for f in fits if f.usable}}
