"""Non-negative least squares for the few coefficients kvlens fits (a prefill cost model's
``a, b, c``; a decode path's ``t0`` and bytes per second), with numpy alone: ``analyze --json``
and the calibration run in the sidecar's install, which has no scipy.

With n coefficients the optimum is the unconstrained least-squares solution on some subset of
them (the rest at zero) that is itself non-negative, so trying the 2^n subsets and keeping the
best feasible one is exact; n is at most ``MAX_COEFFICIENTS``.

A tall problem (a calibration fits ~10^5 requests) is first reduced to the R factor of the QR
decomposition of ``[design | target]``: ``design = Q R_d`` and ``target = Q r`` with ``Q``
orthonormal, so ``||design @ x - target|| = ||R_d @ x - r||`` for every ``x`` and for every
subset of the columns. One QR pass over the rows, then the 2^n subsets are solved on at most
n + 1 rows (a normal-equations Gram matrix would give the same in exact arithmetic but squares
the condition number)."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import numpy.typing as npt

MAX_COEFFICIENTS = 8  # 256 small solves; kvlens fits 2 or 3

FloatArray = npt.NDArray[np.float64]


def reduce(design: npt.ArrayLike, target: npt.ArrayLike) -> tuple[FloatArray, FloatArray]:
    """``(R_d, r)`` of at most ``columns + 1`` rows with ``||R_d @ x - r|| = ||design @ x - target||``
    for every ``x``; a column subset of ``R_d`` keeps the identity for that subset of the design."""
    a = np.asarray(design, dtype=np.float64)
    b = np.asarray(target, dtype=np.float64)
    if a.shape[0] <= a.shape[1] + 1:
        return a, b
    r = np.asarray(np.linalg.qr(np.column_stack([a, b]), mode="r"), dtype=np.float64)  # mode "r": R alone
    return r[:, :-1], r[:, -1]


def nnls(
    design: npt.ArrayLike, target: npt.ArrayLike, *, rows: int | None = None
) -> tuple[FloatArray, float]:
    """``x >= 0`` minimising ``||design @ x - target||`` and that norm (as scipy's ``nnls``).
    ``rows``: the row count of the problem ``design`` was reduced from (:func:`reduce`), which
    sets the rank cut-off of each subset's solve, as numpy's ``lstsq`` sets it from the rows."""
    a, b = reduce(design, target)
    n = a.shape[1]
    if n > MAX_COEFFICIENTS:
        raise ValueError(f"nnls fits at most {MAX_COEFFICIENTS} coefficients, not {n}")
    # lstsq's default cut-off, of the unreduced problem: a column within rounding of the others
    # is dropped alike whether or not the problem was reduced
    cutoff = np.finfo(np.float64).eps * max(rows or 0, np.asarray(design).shape[0], n)
    best: tuple[float, Any] = (float(np.linalg.norm(b)), np.zeros(n))  # every coefficient at zero
    for size in range(1, n + 1):
        for subset in itertools.combinations(range(n), size):
            columns = list(subset)
            solution = np.linalg.lstsq(a[:, columns], b, rcond=cutoff)[0]
            if (solution < 0).any():
                continue
            x = np.zeros(n)
            x[columns] = solution
            residual = float(np.linalg.norm(a @ x - b))
            if residual < best[0]:
                best = (residual, x)
    return best[1], best[0]
