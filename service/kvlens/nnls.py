"""Non-negative least squares for the few coefficients kvlens fits (a prefill cost model's
``a, b, c``; a decode path's ``t0`` and bytes per second), with numpy alone: ``analyze --json``
and the calibration run in the sidecar's install, which has no scipy.

With n coefficients the optimum is the unconstrained least-squares solution on some subset of
them (the rest at zero) that is itself non-negative, so trying the 2^n subsets and keeping the
best feasible one is exact; n is at most ``MAX_COEFFICIENTS``."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import numpy.typing as npt

MAX_COEFFICIENTS = 8  # 256 small solves; kvlens fits 2 or 3

FloatArray = npt.NDArray[np.float64]


def nnls(design: npt.ArrayLike, target: npt.ArrayLike) -> tuple[FloatArray, float]:
    """``x >= 0`` minimising ``||design @ x - target||`` and that norm (as scipy's ``nnls``)."""
    a = np.asarray(design, dtype=np.float64)
    b = np.asarray(target, dtype=np.float64)
    n = a.shape[1]
    if n > MAX_COEFFICIENTS:
        raise ValueError(f"nnls fits at most {MAX_COEFFICIENTS} coefficients, not {n}")
    best: tuple[float, Any] = (float(np.linalg.norm(b)), np.zeros(n))  # every coefficient at zero
    for size in range(1, n + 1):
        for subset in itertools.combinations(range(n), size):
            columns = list(subset)
            solution = np.linalg.lstsq(a[:, columns], b, rcond=None)[0]
            if (solution < 0).any():
                continue
            x = np.zeros(n)
            x[columns] = solution
            residual = float(np.linalg.norm(a @ x - b))
            if residual < best[0]:
                best = (residual, x)
    return best[1], best[0]
