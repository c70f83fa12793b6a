"""Statistics shared by the reports: the report's latency percentiles (:data:`QUANTILES`, exact,
shown by ``kvlens analyze`` and ``kvlens simulate`` alike), the percentiles a report shows
(``--percentiles``, one parser for every command) and the paired statistics of two arms that
replayed the same requests.

Paired, per request: the difference ``arm TTFT - baseline TTFT`` of the same request
(matched by ``request_id``). A request *waited less* when the difference is below minus the
noise floor, *waited more* when above it, else it shows *no clear change*. The noise floor of a
request is ``max(NOISE_FLOOR_SECONDS, NOISE_FLOOR_SHARE x its baseline TTFT)``: an absolute
part for the client's and the network's jitter (about a millisecond on one host), a relative
part because a server's own run-to-run spread grows with the work (a few percent of a long
prefill). Both are stated in every report that uses them. One run of each arm cannot measure
its own spread, so the floor is fixed rather than derived; a change within it is not called a
change for that one request, whatever its sign.

The median of the paired differences carries a distribution-free 95 % interval
(:func:`median_interval`), not a bootstrap: it is exact for any continuous distribution of the
differences, needs no random numbers (the same records give the same interval on every engine
and every run), and costs one sort.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable
from fractions import Fraction
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from kvlens import definitions

QUANTILES: Final = (50, 95, 99)  # the latency percentiles of a report's groups
DEFAULT_PERCENTILES: Final = (50.0, 90.0, 95.0, 99.0)  # as vllm bench serve, GuideLLM, AIPerf
MAX_PERCENTILES: Final = 10  # each is a column of every table (and a bootstrap of its own)
NOISE_FLOOR_SECONDS: Final = 0.001
NOISE_FLOOR_SHARE: Final = 0.05
CONFIDENCE: Final = 0.95
# Up to this many pairs the interval's ranks come from the exact binomial distribution (integer
# arithmetic); beyond, from its normal approximation (off by at most one rank there).
EXACT_RANKS_UP_TO: Final = 1000

FloatArray = npt.NDArray[np.float64]


def itl_percentiles(gaps: Iterable[float]) -> dict[str, float]:
    """A request's inter-token latency from the gaps between its chunks with text, as its record
    carries it (``client_itl_p50_seconds``, ``client_itl_p99_seconds``); none without a gap. Plain
    Python: a few dozen gaps, and numpy's percentile costs ~100 us a call on a client's loop."""
    ordered = sorted(gaps)
    if not ordered:
        return {}
    p50, p99 = definitions.quantiles(len(ordered), (0.5, 0.99), lambda ranks: [ordered[r] for r in ranks])
    return {"client_itl_p50_seconds": p50, "client_itl_p99_seconds": p99}


def percentiles(values: FloatArray) -> dict[str, Any]:
    """Exact :data:`QUANTILES` (linear between order statistics) of the present values."""
    present = values[~np.isnan(values)]
    return percentiles_of(int(present.size), lambda ranks: order_statistics(present, ranks))


def percentiles_of(count: int, pick: Callable[[list[int]], list[float]]) -> dict[str, Any]:
    """:func:`percentiles` of ``count`` values whose order statistics ``pick`` returns (any
    engine's)."""
    if not count:
        return {"count": 0, **{f"p{q}": None for q in QUANTILES}}
    found = definitions.quantiles(count, tuple(q / 100 for q in QUANTILES), pick)
    return {"count": count, **{f"p{q}": v for q, v in zip(QUANTILES, found, strict=True)}}


def order_statistics(values: FloatArray, ranks: list[int]) -> list[float]:
    """The values at ``ranks`` (0-based) of ``values`` sorted, found without sorting them all."""
    return [float(v) for v in np.partition(values, ranks)[ranks]]


def parse_percentiles(text: str) -> tuple[float, ...]:
    """``--percentiles``: comma-separated numbers, each strictly between 0 and 100, ascending,
    without repeats, at most :data:`MAX_PERCENTILES`; a ValueError saying which rule failed."""
    parts = [part.strip() for part in text.split(",")]
    if not text.strip() or any(not part for part in parts):
        raise ValueError(f"percentiles are comma-separated numbers such as 50,90,99, not {text!r}")
    values = []
    for part in parts:
        try:
            value = float(part)
        except ValueError:
            raise ValueError(f"{part!r} is not a number (percentiles such as 50,90,99)") from None
        if not (0 < value < 100):  # NaN fails too
            raise ValueError(f"a percentile is above 0 and below 100, not {part}")
        values.append(value)
    if len(values) > MAX_PERCENTILES:
        raise ValueError(f"at most {MAX_PERCENTILES} percentiles, not {len(values)}")
    if len(set(values)) != len(values):
        raise ValueError(f"percentile {_repeated(values)} is given twice")
    if values != sorted(values):
        raise ValueError(f"percentiles go in ascending order: {','.join(sorted(parts, key=float))}")
    return tuple(values)


def _repeated(values: list[float]) -> str:
    seen: set[float] = set()
    for value in values:
        if value in seen:
            return percentile_name(value)
        seen.add(value)
    return ""  # pragma: no cover - called only when a value repeats


def percentile_name(value: float) -> str:
    """``50.0`` -> ``"50"``, ``99.9`` -> ``"99.9"``: the key ``p<name>`` of a report."""
    return f"{value:g}"


def named_percentiles(values: FloatArray, percentiles: tuple[float, ...]) -> dict[str, float | None]:
    """``{"p50": ..., "p99": ...}`` of ``values`` as ``np.percentile`` gives them (linear
    interpolation); None for each when there is no value."""
    if not values.size:
        return {f"p{percentile_name(q)}": None for q in percentiles}
    found = np.percentile(values, percentiles)
    return {f"p{percentile_name(q)}": float(v) for q, v in zip(percentiles, found, strict=True)}


def noise_floor(baseline_seconds: FloatArray) -> FloatArray:
    """Each request's noise floor (see the module's docstring)."""
    return np.maximum(NOISE_FLOOR_SECONDS, NOISE_FLOOR_SHARE * baseline_seconds)


def classify(baseline_seconds: FloatArray, arm_seconds: FloatArray) -> npt.NDArray[np.int8]:
    """-1 waited less, 0 no clear change, 1 waited more, per request (both arrays present)."""
    delta = arm_seconds - baseline_seconds
    floor = noise_floor(baseline_seconds)
    return np.where(delta < -floor, -1, np.where(delta > floor, 1, 0)).astype(np.int8)


def interval_ranks(count: int, confidence: float = CONFIDENCE) -> tuple[int, int] | None:
    """The 0-based ranks ``(k, count - 1 - k)`` of the order statistics that bound the median
    with at least ``confidence``: the largest ``k`` with ``P(Binomial(count, 1/2) <= k) <=
    (1 - confidence) / 2``. None when no pair of ranks reaches it (fewer than 6 values at 95 %:
    even the smallest and the largest cover the median with only 1 - 2 / 2**count)."""
    tail = (1 - confidence) / 2
    if count < 1:
        return None
    if count <= EXACT_RANKS_UP_TO:
        # exact: below / 2**count = P(X <= k + 1), compared in integers
        share = Fraction(1 - confidence).limit_denominator(10**6) / 2
        total, below, k = 2**count, 0, -1
        while True:
            below += math.comb(count, k + 1)
            if below * share.denominator > share.numerator * total:
                break
            k += 1
        if k < 0:
            return None
    else:
        z = statistics.NormalDist().inv_cdf(1 - tail)
        k = math.floor(count / 2 - z * math.sqrt(count) / 2 - 0.5)
    return k, count - 1 - k


def median_interval(values: FloatArray) -> tuple[float | None, list[float] | None]:
    """The median of ``values`` (as ``np.median``) and its distribution-free 95 % interval: the
    order statistics of :func:`interval_ranks`. Unlike a bootstrap it needs no seed and is
    exact for any continuous distribution (with ties it covers at least as often); None where
    there are too few values for one."""
    if not values.size:
        return None, None
    ordered = np.sort(values)
    ranks = interval_ranks(int(ordered.size))
    interval = None if ranks is None else [float(ordered[ranks[0]]), float(ordered[ranks[1]])]
    return float(np.median(ordered)), interval


def rank_sum_p_less(x: list[float], y: list[float]) -> float:
    """The exact one-sided Mann-Whitney p-value that ``x`` tends to be smaller than ``y``:
    P(U <= u) under the null that both are one distribution, U counting the pairs (x_i, y_j) with
    x_i > y_j (a tie counts a half, and the null is then taken as if there were none: timings in
    seconds tie rarely). Distribution-free and exact, as :func:`median_interval` is, so a few
    repeats give a p-value that means what it says: with 5 against 5, complete separation is
    1/252 (0.004). The null's counts are the coefficients of the Gaussian binomial
    [m+n choose m] in q, built as prod (1 - q^(n+i)) / (1 - q^i): O(m * m * n) integer steps."""
    m, n = len(x), len(y)
    if m == 0 or n == 0:
        raise ValueError("a rank test needs values on both sides")
    u = sum(1.0 if a > b else 0.5 if a == b else 0.0 for a in x for b in y)
    size = m * n
    counts = [1] + [0] * size
    for i in range(1, m + 1):
        for k in range(size, n + i - 1, -1):  # times (1 - q^(n+i)), from the top: old values
            counts[k] -= counts[k - n - i]
        for k in range(i, size + 1):  # divided by (1 - q^i), exactly: c'[k] = c[k] + c'[k-i]
            counts[k] += counts[k - i]
    return float(Fraction(sum(counts[: math.floor(u) + 1]), math.comb(m + n, m)))
