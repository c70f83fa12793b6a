"""kvlens's numpy NNLS finds scipy's optimum: the same residual on random problems of the sizes
kvlens fits (and a little beyond), never a worse one, and no negative coefficient."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.optimize import nnls as reference

from kvlens.nnls import MAX_COEFFICIENTS, nnls, reduce


def test_the_residual_of_scipys_optimum_on_random_problems() -> None:
    rng = np.random.default_rng(7)
    for _ in range(500):
        rows, columns = int(rng.integers(2, 30)), int(rng.integers(1, 5))
        design, target = rng.normal(size=(rows, columns)), rng.normal(size=rows)
        _, expected = reference(design, target)
        x, residual = nnls(design, target)
        assert (x >= 0).all()
        assert residual == pytest.approx(float(np.linalg.norm(design @ x - target)), rel=1e-12, abs=1e-12)
        assert residual == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_an_exact_non_negative_fit_is_found_exactly() -> None:
    design = np.column_stack([np.ones(4), [1.0, 2.0, 3.0, 4.0]])
    x, residual = nnls(design, design @ np.array([0.5, 2.0]))
    assert x == pytest.approx([0.5, 2.0], rel=1e-12) and residual == pytest.approx(0, abs=1e-12)


def test_too_many_coefficients_are_refused() -> None:
    with pytest.raises(ValueError, match="at most 8 coefficients, not 9"):
        nnls(np.ones((10, MAX_COEFFICIENTS + 1)), np.ones(10))


def test_tall_and_rank_deficient_problems_reduced_to_their_r_factor_keep_scipys_optimum() -> None:
    rng = np.random.default_rng(11)
    for case in range(40):
        rows = int(rng.integers(200, 3000))
        design = rng.normal(size=(rows, 3)) * [1.0, 1e3, 1e-3]
        if case % 3 == 0:
            design[:, 2] = design[:, 0]  # the same column twice
        if case % 3 == 1:
            design[:, 1] = 0.0  # a column of zeros
        target = design @ rng.normal(size=3) + rng.normal(size=rows) * rng.random()
        small, reduced = reduce(design, target)
        assert small.shape == (4, 3)
        x, residual = nnls(design, target)
        assert (x >= 0).all()
        assert residual == pytest.approx(float(np.linalg.norm(design @ x - target)), rel=1e-9)
        assert residual == pytest.approx(reference(design, target)[1], rel=1e-9)
        # the identity holds for any coefficients and any subset of the columns
        probe = rng.normal(size=3)
        assert float(np.linalg.norm(small[:, :2] @ probe[:2] - reduced)) == pytest.approx(
            float(np.linalg.norm(design[:, :2] @ probe[:2] - target)), rel=1e-9
        )
