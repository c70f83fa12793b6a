"""Every golden value of DESIGN section 1 (article 1), and the properties the definitions keep."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvlens import definitions as d
from kvlens.records import batch_from_objects
from kvlens.reduce import reduce

ARTICLE = d.CostModel(a=1.0, b=1.0 / 1024.0)


def totals_of(n: Sequence[int], h: Sequence[int], cost: d.CostModel = ARTICLE) -> d.Totals:
    """The totals of requests of one model, through the reducer every consumer uses."""
    objects = [{"prompt_tokens": int(a), "cached_tokens": int(b)} for a, b in zip(n, h, strict=True)]
    validated = batch_from_objects(objects)
    assert not validated.rejections, validated.rejections.details(3)
    reduced = reduce(validated.batch, edges=[1024], cost_for=lambda _: cost, default_model="m")
    return reduced.totals()


def article_totals() -> d.Totals:
    return totals_of([128] * 90 + [8192] * 10, [16] * 90 + [0] * 10)


def test_article_ratios() -> None:
    totals = article_totals()
    assert totals.prompt_tokens == 93_440
    assert totals.cached_tokens == 1_440
    assert f"{100 * totals.request_hit_ratio:.2f}" == "90.00"
    assert f"{100 * totals.token_reuse_ratio:.2f}" == "1.54"
    assert f"{100 * totals.compute_saved_ratio:.3f}" == "0.344"


def test_remaining_work_is_not_work_of_the_suffix() -> None:
    assert ARTICLE.remaining_work(8192, 4096) == pytest.approx(28674.0, abs=1e-9)
    assert ARTICLE.work(8192 - 4096) == pytest.approx(12290.0, abs=1e-9)  # the wrong C(n - h)


def test_only_full_blocks_are_reusable() -> None:
    assert d.reusable_full_block_tokens(1000, 16) == 992
    assert d.reusable_full_block_tokens([1000, 15], 1).tolist() == [1000, 15]  # block size 1: every token
    with pytest.raises(ValueError, match=r"^block_size must be a positive integer$"):
        d.reusable_full_block_tokens(1000, 0)


def test_faster_prefill_under_queueing() -> None:
    before = d.ttft_seconds(0.800, 0.200)
    after = d.ttft_seconds(0.800, 0.020)
    assert before == pytest.approx(1.000)
    assert after == pytest.approx(0.820)
    assert f"{before / after:.2f}" == "1.22"


def test_a_cache_route_pays_only_past_transfer_routing_and_queue() -> None:
    pays = d.cache_route_pays
    assert pays(
        prefill_saved_seconds=0.3, extra_queue_seconds=0.1, transfer_seconds=0.1, routing_seconds=0.05
    )
    assert not pays(
        prefill_saved_seconds=0.3, extra_queue_seconds=0.1, transfer_seconds=0.2, routing_seconds=0.05
    )
    assert not pays(prefill_saved_seconds=0.25, extra_queue_seconds=0.125, transfer_seconds=0.0625,
                    routing_seconds=0.0625)  # fmt: skip  # exactly even: no gain, stay
    assert not pays(prefill_saved_seconds=0.3, extra_queue_seconds=0.1, routing_seconds=0.25)


def test_routing_prefers_the_idle_uncached_replica() -> None:
    cached_replica = d.ttft_seconds(0.600, 0.040)
    uncached_replica = d.ttft_seconds(0.020, 0.200)
    assert cached_replica == pytest.approx(0.640)
    assert uncached_replica == pytest.approx(0.220)
    assert not d.cache_route_pays(prefill_saved_seconds=0.200 - 0.040, extra_queue_seconds=0.600 - 0.020)
    assert d.cache_route_pays(prefill_saved_seconds=0.160, extra_queue_seconds=0.100)


def test_ttft_components_clamp_and_flag_overlap() -> None:
    parts = d.ttft_components([1.0, 0.5, 0.5], [0.3, 0.4, 0.25], [0.2, 0.3, 0.25])
    assert parts.other.tolist() == pytest.approx([0.5, 0.0, 0.0])
    assert parts.overlapped.tolist() == [False, True, False]  # parts that add up exactly do not overlap


def test_columns_are_float64_whatever_the_input() -> None:
    """Consumers store NaN for absent values and add fractional work: integer input must not
    turn a column into integers."""
    ints = [3, 5]
    cost = d.CostModel(a=1.0, b=0.5)
    assert cost.work(ints).dtype == np.float64
    assert cost.remaining_work(ints, [1, 2]).dtype == np.float64
    assert all(column.dtype == np.float64 for column in d.work_terms(ints))
    assert all(column.dtype == np.float64 for column in d.remaining_work_terms(ints, [1, 2]))
    parts = d.ttft_components([1, 2], [0, 1], [1, 0])
    assert {parts.queue.dtype, parts.prefill.dtype, parts.other.dtype} == {np.dtype(np.float64)}
    assert np.asarray(d.ttft_seconds(1, 2, 3)).dtype == np.float64
    assert d.request_reuse_fraction(ints, [1, 5]).dtype == np.float64
    assert d.reusable_full_block_tokens([17.0], 16).dtype == np.int64


def test_request_reuse_fraction_of_empty_and_one_token_prompts() -> None:
    assert d.request_reuse_fraction([0, 1, 1, 4], [0, 1, 0, 1]).tolist() == [0.0, 1.0, 0.0, 0.25]


def test_a_single_request_has_ratios_of_one() -> None:
    totals = totals_of([1], [1])
    assert (totals.request_hit_ratio, totals.token_reuse_ratio, totals.compute_saved_ratio) == (1.0, 1.0, 1.0)
    assert d.safe_ratio(1, 1) == 1.0 and d.safe_ratio(0, 0) is None


def test_empty_window_has_no_ratio() -> None:
    empty = d.Totals()
    assert empty.request_hit_ratio is None
    assert empty.token_reuse_ratio is None
    assert empty.compute_saved_ratio is None


def test_cost_model_refuses_negative_or_nan() -> None:
    with pytest.raises(ValueError, match=r"^cost model a must be a finite number >= 0$"):
        d.CostModel(a=-1.0)
    with pytest.raises(ValueError, match=r"^cost model b must be a finite number >= 0$"):
        d.CostModel(b=float("nan"))
    with pytest.raises(ValueError, match=r"^cost model unit must be one of work_units, flops, seconds$"):
        d.CostModel(unit="joules")


prompt_and_cached = st.integers(0, 10_000_000).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n)))
cost_models = st.builds(
    d.CostModel,
    a=st.floats(0, 100, allow_nan=False),
    b=st.floats(0, 1, allow_nan=False),
)
requests = st.lists(prompt_and_cached, min_size=0, max_size=50)


@given(prompt_and_cached, cost_models)
def test_remaining_work_equals_difference_and_exceeds_suffix_work(
    pair: tuple[int, int], cost: d.CostModel
) -> None:
    n, h = pair
    remaining = float(cost.remaining_work(n, h))
    difference = float(cost.work(n) - cost.work(h))
    assert remaining == pytest.approx(difference, rel=1e-9, abs=1e-6)
    assert remaining >= float(cost.work(n - h)) - 1e-6 * max(1.0, remaining)


@given(prompt_and_cached, cost_models)
def test_one_requests_remaining_work_in_floats_is_the_columns(
    pair: tuple[int, int], cost: d.CostModel
) -> None:
    n, h = pair
    for one in (cost.remaining_work_of(n, h), cost.remaining_work_function()(n, h)):
        assert isinstance(one, float)
        assert one == pytest.approx(float(cost.remaining_work([n], [h])[0]), rel=1e-12, abs=1e-9)


@given(requests, cost_models)
def test_every_ratio_is_within_zero_and_one(pairs: list[tuple[int, int]], cost: d.CostModel) -> None:
    totals = totals_of([p[0] for p in pairs], [p[1] for p in pairs], cost)
    for ratio in (totals.request_hit_ratio, totals.token_reuse_ratio, totals.compute_saved_ratio):
        assert ratio is None or 0.0 <= ratio <= 1.0


@given(requests, requests, cost_models)
def test_totals_of_two_batches_equal_totals_of_their_union(
    first: list[tuple[int, int]], second: list[tuple[int, int]], cost: d.CostModel
) -> None:
    def totals(pairs: list[tuple[int, int]]) -> d.Totals:
        return totals_of([p[0] for p in pairs], [p[1] for p in pairs], cost)

    added = totals(first) + totals(second)
    union = totals(first + second)
    assert (added.requests, added.hit_requests, added.prompt_tokens, added.cached_tokens) == (
        union.requests,
        union.hit_requests,
        union.prompt_tokens,
        union.cached_tokens,
    )
    assert added.prompt_work == pytest.approx(union.prompt_work, rel=1e-12)
    assert added.reused_work == pytest.approx(union.reused_work, rel=1e-12)
