"""The rank test of the isolation audit's timing case."""

from __future__ import annotations

import random

import pytest
from scipy.stats import mannwhitneyu

from kvlens.stats import rank_sum_p_less


def test_rank_sum_p_less_is_scipys_exact_mann_whitney() -> None:
    """The audit's timing case: exact, one-sided, checked against scipy's exact method."""
    assert rank_sum_p_less([1, 2, 3, 4, 5], [6, 7, 8, 9, 10]) == pytest.approx(1 / 252)
    assert rank_sum_p_less([6, 7, 8, 9, 10], [1, 2, 3, 4, 5]) == 1.0
    rng = random.Random(29)
    for _ in range(40):
        x = [rng.random() for _ in range(rng.randint(1, 12))]
        y = [rng.random() for _ in range(rng.randint(1, 12))]
        expected = mannwhitneyu(x, y, alternative="less", method="exact").pvalue
        assert rank_sum_p_less(x, y) == pytest.approx(expected, rel=1e-12)
    with pytest.raises(ValueError):
        rank_sum_p_less([], [1.0])
