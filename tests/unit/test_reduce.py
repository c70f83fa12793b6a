"""The reducer, record by record, against values worked out by hand: which model (the raw name,
the default for none), hit or not, which prompt-length group, the work in which unit, and whether
the TTFT split is complete."""

from __future__ import annotations

import numpy as np
import pytest

from kvlens.config import load_settings
from kvlens.definitions import CostModel
from kvlens.exporter.aggregator import Aggregator
from kvlens.records import batch_from_objects
from kvlens.reduce import Reduced, reduce

COSTS = {
    "a": CostModel(a=1.0, b=1.0 / 1024),
    "f": CostModel(a=2.0, b=0.5, unit="flops"),
    "s": CostModel(a=1e-5, b=1e-9, unit="seconds"),
    "fallback": CostModel(a=3.0, b=0.0),
}


def cost_for(name: str) -> CostModel:
    return COSTS.get(name, COSTS["fallback"])


RECORDS = [
    {"model": "a", "prompt_tokens": 1024, "cached_tokens": 512, "ttft_seconds": 0.5, "queue_seconds": 0.1,
     "prefill_seconds": 0.3},
    {"model": "f", "prompt_tokens": 100, "cached_tokens": 0, "ttft_seconds": 0.5, "queue_seconds": 0.1},
    {"prompt_tokens": 2048, "cached_tokens": 1, "queue_seconds": 0.1, "prefill_seconds": 0.3},
    {"model": "s", "prompt_tokens": 511, "cached_tokens": 511, "ttft_seconds": 0.2, "prefill_seconds": 0.1},
    {"model": "a", "prompt_tokens": 1, "cached_tokens": 0},
]  # fmt: skip


def reduced() -> Reduced:
    validated = batch_from_objects(RECORDS)
    assert not validated.rejections
    return reduce(validated.batch, edges=[512, 2048], cost_for=cost_for, default_model="nameless")


def test_each_record_gets_its_model_group_and_hit_status() -> None:
    r = reduced()
    assert r.model.tolist() == ["a", "f", "nameless", "s", "a"]
    assert r.hit.tolist() == [True, False, True, True, False]
    assert r.length_group.tolist() == [1, 0, 2, 0, 0]  # 2048 opens the last group; 511 is under 512


def test_each_record_is_costed_by_its_own_model_in_its_unit() -> None:
    r = reduced()
    expected_prompt = [1024 + 1024 * 1025 / 2 / 1024, 2 * 100 + 0.5 * 100 * 101 / 2, 3 * 2048,
                       1e-5 * 511 + 1e-9 * 511 * 512 / 2, 1 + 1 / 1024]  # fmt: skip
    expected_reused = [512 + 512 * 513 / 2 / 1024, 0.0, 3.0, 1e-5 * 511 + 1e-9 * 511 * 512 / 2, 0.0]
    assert r.prompt_work.tolist() == pytest.approx(expected_prompt, rel=1e-12)
    assert r.reused_work.tolist() == pytest.approx(expected_reused, rel=1e-12)
    assert r.unit.tolist() == [0, 1, 0, 2, 0]  # work_units, flops, (the fallback) work_units, seconds


def test_a_ttft_split_is_complete_only_with_all_three_parts() -> None:
    assert reduced().ttft_complete.tolist() == [True, False, False, False, False]


def test_totals_keep_each_unit_apart() -> None:
    totals = reduced().totals()
    assert (totals.requests, totals.hit_requests, totals.prompt_tokens, totals.cached_tokens) == (
        5,
        3,
        1024 + 100 + 2048 + 511 + 1,
        512 + 1 + 511,
    )
    assert totals.units == ["work_units", "flops", "seconds"]
    assert totals.work_unit is None and totals.compute_saved_ratio is None
    flops = totals.compute_saved_ratio_in("flops")
    assert flops == 0.0
    only_a = reduced().totals(np.array([True, False, False, False, True]))
    assert only_a.work_unit == "work_units"
    assert only_a.compute_saved_ratio == pytest.approx(
        (512 + 512 * 513 / 2048) / (1025 + 1024 * 1025 / 2048 + 1 / 1024)
    )


def test_the_default_model_takes_a_label_only_when_a_record_lacks_a_model() -> None:
    """With room for two labels, batches of models a then b give a and b their labels; the
    default name must not take a slot because it could have been needed."""
    aggregator = Aggregator(load_settings(None, max_models=2))
    for model in ("a", "b"):
        record = {"model": model, "prompt_tokens": 10, "cached_tokens": 0}
        aggregator.add(batch_from_objects([record]), "push")
    assert {labels[0] for _, labels in aggregator.snapshot().active_groups} == {"a", "b"}
