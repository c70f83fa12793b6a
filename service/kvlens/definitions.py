"""Every number kvlens reports, defined once (DESIGN section 1).

For request i: prompt length ``n`` (tokens fed to the model) and reused length ``h`` (prompt
tokens whose KV came from the prefix cache), ``0 <= h <= n``. Functions take numpy columns (or
scalars) and do no I/O; the live exporter, the analyzer and the simulator all call these.

Ratios are ratios of sums over one window (:class:`Totals`), never means of per-request ratios.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
ArrayLike = npt.ArrayLike

# The units modelled work is counted in. Work of different units is never added: each has its
# own exported counters, and a ratio is only ever taken within one unit.
WORK_UNITS = "work_units"  # the article's illustrative unit (a = 1 a token, b = 1/1024 a pair)
FLOPS = "flops"  # from the model's shape (flops_cost_model)
SECONDS = "seconds"  # fitted to measured prefill times (kvlens analyze --calibrate)
UNITS = (WORK_UNITS, FLOPS, SECONDS)


@dataclass(frozen=True)
class CostModel:
    """Modelled prefill work ``C(n) = a*n + b*n*(n+1)/2``, in ``unit``.

    ``a`` is the per-token linear work (projections, MLP), ``b`` the work per causal
    query-key pair (attention). The default is the article's illustrative unit: one token of
    linear work is one unit, a 1024-token causal attention row about one unit; the article says
    itself that it is "not microseconds or GPU FLOPs" (real 1.5B-8B models measure b/a 10-14x
    smaller).
    """

    a: float = 1.0
    b: float = 1.0 / 1024.0
    unit: str = WORK_UNITS

    def __post_init__(self) -> None:
        for name in ("a", "b"):
            value = getattr(self, name)
            if not (np.isfinite(value) and value >= 0):
                raise ValueError(f"cost model {name} must be a finite number >= 0")
        if self.unit not in UNITS:
            raise ValueError(f"cost model unit must be one of {', '.join(UNITS)}")

    def work(self, tokens: ArrayLike) -> FloatArray:
        """``C(n)``: the work to prefill ``n`` tokens from scratch."""
        return self._of(*work_terms(tokens))

    def remaining_work(self, prompt_tokens: ArrayLike, cached_tokens: ArrayLike) -> FloatArray:
        """Work left when ``h`` tokens come from the cache: ``C(n) - C(h)``."""
        return self._of(*remaining_work_terms(prompt_tokens, cached_tokens))

    def remaining_work_of(self, prompt_tokens: int, cached_tokens: int) -> float:
        """:meth:`remaining_work` of one request, in plain floats."""
        return self._of(*_remaining(float(prompt_tokens), float(cached_tokens)))

    def remaining_work_function(self) -> Callable[[int, int], float]:
        """:meth:`remaining_work` of one request at a time, in plain floats, ``a`` and ``b`` bound
        (the simulator costs requests one at a time, where numpy's per-call overhead, and a method
        call per term, would dominate)."""
        a, b = self.a, self.b

        def remaining(prompt_tokens: int, cached_tokens: int) -> float:
            linear, pairs = _remaining(float(prompt_tokens), float(cached_tokens))
            return a * linear + b * pairs

        return remaining

    def work_of_sums(self, tokens: int, pairs: int) -> float:
        """``sum C(n)`` of requests whose ``n`` add up to ``tokens`` and whose causal pairs
        ``n*(n+1)/2`` add up to ``pairs``: ``C`` is linear in both, so work summed from exact
        integer sums is the same whatever order or engine added the requests."""
        return self._of(float(tokens), float(pairs))

    def _of(self, linear: Amount, pairs: Amount) -> Amount:
        return self.a * linear + self.b * pairs


Amount = TypeVar("Amount", float, FloatArray)


def work_terms(tokens: ArrayLike) -> tuple[FloatArray, FloatArray]:
    """What ``a`` and ``b`` multiply in ``C(n)``: ``n`` tokens and ``n*(n+1)/2`` causal pairs."""
    n = np.asarray(tokens, dtype=np.float64)
    return n, n * (n + 1.0) / 2.0


def remaining_work_terms(prompt_tokens: ArrayLike, cached_tokens: ArrayLike) -> tuple[FloatArray, FloatArray]:
    """What ``a`` and ``b`` multiply in ``C(n) - C(h)``: the ``m = n - h`` new tokens, and the
    pairs ``m*h + m*(m+1)/2``, because the new tokens still attend to the ``h`` cached ones (so
    the remaining work is never ``C(m)``)."""
    return _remaining(
        np.asarray(prompt_tokens, dtype=np.float64), np.asarray(cached_tokens, dtype=np.float64)
    )


def _remaining(n: Amount, h: Amount) -> tuple[Amount, Amount]:
    m = n - h
    return m, m * h + m * (m + 1.0) / 2.0


DEFAULT_COST_MODEL = CostModel()


def flops_cost_model(linear_weights_per_token: float, heads: int, head_dim: int, layers: int) -> CostModel:
    """``C(n)`` in FLOPs: a token meets each linear weight once (a multiply and an add, 2 FLOPs),
    and each causal query-key pair costs a dot product for the score and one for the value, over
    every head's dimensions in every layer (4 FLOPs per head dimension). The Llama-3.1-8B shape
    gives ``b/a = 1/26,624``."""
    return CostModel(a=2.0 * linear_weights_per_token, b=4.0 * heads * head_dim * layers, unit=FLOPS)


def modelled_work(
    prompt_tokens: npt.NDArray[np.int64],
    cached_tokens: npt.NDArray[np.int64],
    keys: npt.NDArray[Any],
    cost_for: Callable[[Any], CostModel],
) -> tuple[FloatArray, FloatArray, npt.NDArray[np.int8]]:
    """``C(n)``, ``C(h)`` and the unit (an index into ``UNITS``) per request, each with its own
    model's cost (``keys`` name the model of each request; ``cost_for`` maps a key to its cost
    model)."""
    by_cost: dict[CostModel, list[Any]] = {}
    for key in np.unique(keys).tolist():
        by_cost.setdefault(cost_for(key), []).append(key)
    if len(by_cost) == 1:  # one cost model for every request (the common case): no rows to pick
        (cost,) = by_cost
        unit_of_all = np.full(prompt_tokens.shape, UNITS.index(cost.unit), np.int8)
        return cost.work(prompt_tokens), cost.work(cached_tokens), unit_of_all
    prompt_work = np.empty_like(prompt_tokens, dtype=np.float64)
    reused_work = np.empty_like(prompt_tokens, dtype=np.float64)
    unit = np.empty_like(prompt_tokens, dtype=np.int8)
    for cost, group in by_cost.items():
        rows = keys == group[0] if len(group) == 1 else np.isin(keys, group)
        prompt_work[rows] = cost.work(prompt_tokens[rows])
        reused_work[rows] = cost.work(cached_tokens[rows])
        unit[rows] = UNITS.index(cost.unit)
    return prompt_work, reused_work, unit


DEFAULT_BLOCK_SIZE = 16  # vLLM's default: the block size of a record that names none


def cached_blocks(cached_tokens: int, block_size: int) -> int:
    """The blocks of a request's chain it got from the cache: ``floor(h / block_size)``, the
    full blocks its cached tokens cover (a partial block is never credited: a lower bound)."""
    return cached_tokens // block_size


def reusable_full_block_tokens(shared_prefix_tokens: ArrayLike, block_size: int) -> npt.NDArray[np.int64]:
    """Tokens of a shared prefix that a block cache can reuse: only full blocks are cached."""
    if block_size <= 0:
        raise ValueError("block_size must be a positive integer")
    shared = np.asarray(shared_prefix_tokens, dtype=np.int64)
    return np.asarray((shared // block_size) * block_size, dtype=np.int64)


def safe_ratio(numerator: float, denominator: float) -> float | None:
    """``numerator / denominator``, or None for an empty window (never NaN)."""
    if denominator <= 0:
        return None
    return float(numerator) / float(denominator)


NO_WORK = (0.0,) * len(UNITS)


@dataclass(frozen=True)
class Totals:
    """The sums over one window from which every ratio is taken.

    Totals add: the totals of two batches equal the totals of their union, which is what lets
    the exporter keep running sums and Prometheus sum counters across replicas. Modelled work is
    kept per unit (``prompt_work[i]`` in ``UNITS[i]``), never added across units.
    """

    requests: int = 0
    hit_requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prompt_work: tuple[float, ...] = NO_WORK
    reused_work: tuple[float, ...] = NO_WORK

    def __add__(self, other: Totals) -> Totals:
        def add(left: Any, right: Any) -> Any:
            if isinstance(left, tuple):
                return tuple(a + b for a, b in zip(left, right, strict=True))
            return left + right

        return Totals(*(add(getattr(self, f.name), getattr(other, f.name)) for f in fields(self)))

    @property
    def units(self) -> list[str]:
        """The units some modelled work was counted in."""
        return [unit for unit, work in zip(UNITS, self.prompt_work, strict=True) if work > 0]

    @property
    def work_unit(self) -> str | None:
        """The one unit of all the modelled work, or None (no work, or several units)."""
        units = self.units
        return units[0] if len(units) == 1 else None

    def compute_saved_ratio_in(self, unit: str) -> float | None:
        index = UNITS.index(unit)
        return safe_ratio(self.reused_work[index], self.prompt_work[index])

    @property
    def request_hit_ratio(self) -> float | None:
        """``count(h > 0) / count(requests)``."""
        return safe_ratio(self.hit_requests, self.requests)

    @property
    def token_reuse_ratio(self) -> float | None:
        """``sum(h) / sum(n)``."""
        return safe_ratio(self.cached_tokens, self.prompt_tokens)

    @property
    def compute_saved_ratio(self) -> float | None:
        """``sum C(h) / sum C(n)``: share of modelled prefill work the cache saved; None when
        the work is in several units (see :meth:`compute_saved_ratio_in`)."""
        unit = self.work_unit
        return None if unit is None else self.compute_saved_ratio_in(unit)


@dataclass(frozen=True)
class TtftComponents:
    """TTFT split into queue, prefill and the rest (``ttft - queue - prefill``).

    Sources may measure the parts on overlapping clocks, so "other" is clamped at 0 and the
    requests where it came out negative are flagged in ``overlapped``.
    """

    queue: FloatArray
    prefill: FloatArray
    other: FloatArray
    overlapped: npt.NDArray[np.bool_]


def ttft_components(ttft: ArrayLike, queue: ArrayLike, prefill: ArrayLike) -> TtftComponents:
    t = np.asarray(ttft, dtype=np.float64)
    q = np.asarray(queue, dtype=np.float64)
    p = np.asarray(prefill, dtype=np.float64)
    other = t - q - p
    overlapped = other < 0
    return TtftComponents(q, p, np.where(overlapped, 0.0, other), overlapped)


def ttft_seconds(queue: ArrayLike, prefill: ArrayLike, other: ArrayLike = 0.0) -> FloatArray:
    """Time to first token as the sum of its parts."""
    parts = (np.asarray(part, dtype=np.float64) for part in (queue, prefill, other))
    return np.asarray(sum(parts), dtype=np.float64)


def cache_route_pays(
    *,
    prefill_saved_seconds: float,
    extra_queue_seconds: float,
    transfer_seconds: float = 0.0,
    routing_seconds: float = 0.0,
) -> bool:
    """Routing rule: send a request to the replica holding its prefix only when the prefill
    it saves, net of KV transfer, exceeds the extra queueing and routing it costs."""
    return prefill_saved_seconds - transfer_seconds > extra_queue_seconds + routing_seconds


def request_reuse_fraction(prompt_tokens: ArrayLike, cached_tokens: ArrayLike) -> FloatArray:
    """Per-request ``h / n`` (0 for empty prompts), for distributions only, never averaged."""
    n = np.asarray(prompt_tokens, dtype=np.float64)
    h = np.asarray(cached_tokens, dtype=np.float64)
    return np.divide(h, n, out=np.zeros_like(h), where=n > 0)


FIXED_POINT_SECONDS = 2**40
"""Durations are summed as integers of ``2**-40`` s (under a picosecond): ``floor(x * 2**40)``
is exact in binary floating point, and integer sums do not depend on the order of addition, so
every engine and every partitioning of the records gives the same sums (float sums would differ
in their last bits)."""


def fixed_point_seconds(seconds: ArrayLike) -> npt.NDArray[np.int64]:
    """``floor(x * 2**40)`` of each duration (durations are at most ``MAX_SECONDS`` < 2**17, so
    the result fits 57 bits)."""
    return np.floor(np.asarray(seconds, dtype=np.float64) * float(FIXED_POINT_SECONDS)).astype(np.int64)


def quantile_ranks(count: int, fraction: float) -> tuple[int, int, float]:
    """The two order statistics (0-based ranks in ascending order) and the weight between them
    of the ``fraction`` quantile of ``count`` values, linear between order statistics (numpy's
    default, Hyndman and Fan's type 7). Any engine that can fetch exact order statistics gives
    the same quantile through :func:`interpolate`."""
    virtual = (count - 1) * fraction
    if virtual >= count - 1:
        return count - 1, count - 1, 0.0
    low = int(np.floor(virtual))
    return low, low + 1, virtual - low


def interpolate(low: float, high: float, weight: float) -> float:
    """Between two order statistics, the way numpy does it (from the nearer end), so quantiles
    from :func:`quantile_ranks` equal ``np.quantile`` to the last bit."""
    difference = high - low
    if weight >= 0.5:
        return float(high - difference * (1 - weight))
    return float(low + difference * weight)


def quantiles(
    count: int, fractions: tuple[float, ...], pick: Callable[[list[int]], list[float]]
) -> list[float]:
    """Exact quantiles of ``count`` values; ``pick`` returns the values at the given ascending
    ranks (an engine's order statistics)."""
    ranks = [quantile_ranks(count, fraction) for fraction in fractions]
    wanted = sorted({rank for low, high, _ in ranks for rank in (low, high)})
    value = dict(zip(wanted, pick(wanted), strict=True))
    return [interpolate(value[low], value[high], weight) for low, high, weight in ranks]


def prompt_length_labels(edges: list[int]) -> list[str]:
    """Names of the prompt-length groups: ``[512, 2048]`` -> ``["0-511", "512-2047", "2048+"]``."""
    lows = [0, *edges]
    return [f"{low}-{high - 1}" for low, high in zip(lows, edges, strict=False)] + [f"{lows[-1]}+"]


def prompt_length_bucket(prompt_tokens: ArrayLike, edges: ArrayLike) -> npt.NDArray[np.intp]:
    """Index into :func:`prompt_length_labels` of each prompt length."""
    return np.searchsorted(np.asarray(edges), np.asarray(prompt_tokens), side="right")
