"""Values exactly on every edge, read back from the exposition: a latency on a bucket's `le` is
in that bucket (Prometheus buckets are inclusive), a reuse ratio on an edge too, and a prompt of
exactly an edge's length opens the next `prompt_len` group. And per-model cost models under label
overflow give the exporter and `analyze` the same sums, in-process (the integration suite does it
across real processes)."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvlens.analysis.report import Derived
from kvlens.config import Settings, load_settings
from kvlens.definitions import UNITS
from kvlens.exporter.aggregator import Aggregator
from kvlens.exporter.collector import KVLensCollector
from kvlens.records import batch_from_objects

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def exposition(settings: Settings, records: list[dict[str, Any]]) -> Samples:
    aggregator = Aggregator(settings)
    validated = batch_from_objects(records)
    assert not validated.rejections, validated.rejections.details(3)
    aggregator.add(validated, "push")
    registry = CollectorRegistry()
    registry.register(KVLensCollector(aggregator))
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for sample in family.samples
    }


def total(samples: Samples, name: str, **labels: str) -> float:
    wanted = set(labels.items())
    return sum(value for (found, keys), value in samples.items() if found == name and wanted <= keys)


def le(value: float) -> str:
    return "+Inf" if value == float("inf") else str(float(value))


@pytest.mark.parametrize("field", ["ttft_seconds", "queue_seconds", "prefill_seconds"])
def test_a_latency_on_each_le_is_counted_in_that_bucket(field: str) -> None:
    settings = load_settings()
    edges = settings.latency_buckets_seconds
    records = [{"prompt_tokens": 100, "cached_tokens": 0, field: edge} for edge in edges]
    samples = exposition(settings, records)
    family = f"kvlens_{field}_bucket"
    for i, edge in enumerate(edges):
        # Cumulative: the values on this edge and every lower one; an exclusive edge would give i.
        assert total(samples, family, le=le(edge)) == i + 1, edge
    assert total(samples, family, le="+Inf") == len(edges)


def test_a_reuse_ratio_on_each_edge_is_counted_in_that_bucket() -> None:
    settings = load_settings()
    records = []
    for edge in settings.reuse_ratio_buckets:
        exact = Fraction(edge).limit_denominator(10_000)
        n, h = exact.denominator * 8, exact.numerator * 8
        assert h / n == edge, edge  # the division lands on the edge's own float
        records.append({"prompt_tokens": n, "cached_tokens": h})
    samples = exposition(settings, records)
    # Buckets are per hit status: the ratio-0 request (if an edge is 0) is a miss, the rest hits.
    for i, edge in enumerate(settings.reuse_ratio_buckets):
        assert total(samples, "kvlens_request_reuse_ratio_bucket", le=le(edge)) == i + 1, edge


def test_a_prompt_of_an_edges_length_opens_the_next_group() -> None:
    settings = load_settings()
    edges = settings.prompt_length_edges
    assert edges == [512, 2048, 8192, 32768]
    labels = ["0-511", "512-2047", "2048-8191", "8192-32767", "32768+"]
    records = [{"prompt_tokens": n, "cached_tokens": 0} for edge in edges for n in (edge - 1, edge)]
    samples = exposition(settings, records)
    # Each group holds the edge that opens it and the length just under the next edge.
    for i, label in enumerate(labels):
        expected = ([edges[i - 1]] if i > 0 else []) + ([edges[i] - 1] if i < len(edges) else [])
        assert total(samples, "kvlens_prompt_tokens_total", prompt_len=label) == sum(expected), label


WORK = {
    "work_units": ("kvlens_prompt_work_units_total", "kvlens_reused_work_units_total"),
    "flops": ("kvlens_prompt_flops_total", "kvlens_reused_flops_total"),
    "seconds": ("kvlens_modelled_prefill_seconds_total", "kvlens_saved_prefill_seconds_total"),
}


def test_per_model_cost_models_under_label_overflow_give_both_paths_the_same_sums() -> None:
    settings = load_settings(
        None,
        max_models=1,
        cost_models={"own": {"a": 1, "b": 0.01}, "timed": {"a": 7e-5, "b": 5e-9, "unit": "seconds"}},
        model_shapes={"shaped": {"layers": 32, "kv_heads": 8, "head_dim": 128, "hidden_size": 4096,
                                 "heads": 32, "intermediate_size": 14336}},
    )  # fmt: skip
    rng = np.random.default_rng(5)
    records: list[dict[str, Any]] = []
    for model in ("first", "own", "shaped", "timed", None):
        for _ in range(30):
            n = int(rng.integers(1, 20_000))
            record: dict[str, Any] = {"prompt_tokens": n, "cached_tokens": int(rng.integers(0, n + 1))}
            records.append(record if model is None else {**record, "model": model})
    samples = exposition(settings, records)
    derived = Derived.of(
        batch_from_objects(records).batch,
        settings.prompt_length_edges,
        settings.cost_model_for,
        settings.default_model,
    )
    offline = derived.totals()
    assert total(samples, "kvlens_requests_total") == offline.requests
    assert total(samples, "kvlens_requests_total", cache="hit") == offline.hit_requests
    assert total(samples, "kvlens_cached_tokens_total") == offline.cached_tokens
    for index, unit in enumerate(UNITS):
        prompt, reused = WORK[unit]
        assert offline.prompt_work[index] > 0, unit
        assert total(samples, prompt) == pytest.approx(offline.prompt_work[index], rel=1e-12), unit
        assert total(samples, reused) == pytest.approx(offline.reused_work[index], rel=1e-12), unit
    # The folded models keep their own cost models inside "other".
    folded = derived.totals(derived.model != "first")
    work_units = UNITS.index("work_units")
    assert total(samples, "kvlens_reused_work_units_total", model="other") == pytest.approx(
        folded.reused_work[work_units], rel=1e-12
    )
    # Per group (prompt_len x cache) too.
    for length, label in enumerate(derived.length_labels):
        for hit, cache in ((False, "miss"), (True, "hit")):
            rows = (derived.length_group == length) & (derived.reduced.hit == hit)
            group = derived.totals(rows)
            assert (
                total(samples, "kvlens_prompt_tokens_total", prompt_len=label, cache=cache)
                == group.prompt_tokens
            )
            for index, unit in enumerate(UNITS):
                assert total(samples, WORK[unit][0], prompt_len=label, cache=cache) == pytest.approx(
                    group.prompt_work[index], rel=1e-12, abs=1e-9
                )
