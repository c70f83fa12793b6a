"""Fit the cost model to measured prefill times, per model.

``prefill_seconds ~ a*m + b*(m*h + m*(m+1)/2) + c`` with ``m = n - h``: the remaining work of
DESIGN section 1 plus a fixed overhead, by non-negative least squares (scipy). A fit with too
few requests or an R^2 under ``MIN_R2`` is reported as poor and not used. A good fit gives the
sidecar a cost model in seconds, so compute saved reads as modelled prefill seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvlens.definitions import CostModel

MIN_R2 = 0.5
MIN_REQUESTS = 20
RESIDUAL_SAMPLE = 400


@dataclass(frozen=True)
class Fit:
    model: str
    requests: int
    a: float
    b: float
    c: float
    r2: float | None
    usable: bool
    reason: str
    residuals: list[tuple[float, float]]  # (predicted, measured) for a sample of requests

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "requests": self.requests,
            "a_seconds_per_token": self.a,
            "b_seconds_per_pair": self.b,
            "c_seconds": self.c,
            "r2": self.r2,
            "usable": self.usable,
            "reason": self.reason,
        }

    def cost_model(self) -> CostModel:
        return CostModel(a=self.a, b=self.b)


def fit(
    model: str,
    prompt_tokens: npt.NDArray[np.int64],
    cached_tokens: npt.NDArray[np.int64],
    prefill_seconds: npt.NDArray[np.float64],
) -> Fit:
    from scipy.optimize import nnls  # the "analyze" extra

    present = ~np.isnan(prefill_seconds)
    n = prompt_tokens[present].astype(np.float64)
    h = cached_tokens[present].astype(np.float64)
    y = prefill_seconds[present]
    if y.size < MIN_REQUESTS:
        return Fit(model, int(y.size), 0.0, 0.0, 0.0, None, False, f"fewer than {MIN_REQUESTS} requests", [])
    m = n - h
    design = np.column_stack([m, m * h + m * (m + 1.0) / 2.0, np.ones_like(m)])
    scale = np.where(design.max(axis=0) > 0, design.max(axis=0), 1.0)  # conditioning
    coefficients, _ = nnls(design / scale, y)
    a, b, c = (coefficients / scale).tolist()
    predicted = design @ np.array([a, b, c])
    total = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float(((y - predicted) ** 2).sum()) / total if total > 0 else None
    usable = r2 is not None and r2 >= MIN_R2 and (a > 0 or b > 0)
    reason = "ok" if usable else f"R^2 {r2 if r2 is None else round(r2, 3)} under {MIN_R2}: not used"
    pick = np.random.default_rng(0).choice(y.size, size=min(RESIDUAL_SAMPLE, y.size), replace=False)
    residuals = [(float(predicted[i]), float(y[i])) for i in np.sort(pick)]
    return Fit(model, int(y.size), a, b, c, r2, usable, reason, residuals)


def cost_model_file(fits: list[Fit]) -> dict[str, Any]:
    """Settings the sidecar accepts (``kvlens serve --config``): cost models of usable fits."""
    return {"cost_models": {f.model: {"a": f.a, "b": f.b} for f in fits if f.usable}}
