"""The exposition: a golden file byte for byte, its values parsed back, OpenMetrics validity."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families

from kvlens.config import load_settings
from kvlens.exporter import metrics
from kvlens.exporter.aggregator import Aggregator
from kvlens.exporter.collector import KVLensCollector
from kvlens.records import batch_from_objects
from tests.article import article_records

GOLDEN = Path(__file__).parent.parent / "golden" / "article.prom"


def article_registry() -> tuple[CollectorRegistry, KVLensCollector]:
    aggregator = Aggregator(load_settings())
    aggregator.add(batch_from_objects(article_records()), "push")
    aggregator.add(
        batch_from_objects(
            [{"prompt_tokens": 5, "cached_tokens": 9}, {"prompt_tokens": "7", "cached_tokens": 0}]
        ),
        "push",
    )
    registry = CollectorRegistry()
    collector = KVLensCollector(aggregator)
    registry.register(collector)
    return registry, collector


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_golden_exposition_byte_for_byte(update_golden: bool) -> None:
    registry, _ = article_registry()
    text = generate_latest(registry)
    if update_golden:
        GOLDEN.write_bytes(text)
    assert text == GOLDEN.read_bytes(), "exposition changed; rerun with --update-golden if intended"


def test_golden_exposition_values() -> None:
    values = samples(GOLDEN.read_text())

    def total(name: str, **match: str) -> float:
        return sum(
            value
            for (sample, labels), value in values.items()
            if sample == name and set(match.items()) <= set(labels)
        )

    requests = total("kvlens_requests_total")
    assert requests == 100
    assert total("kvlens_requests_total", cache="hit") / requests == pytest.approx(0.9)
    assert total("kvlens_cached_tokens_total") / total("kvlens_prompt_tokens_total") == pytest.approx(
        1440 / 93440
    )
    saved = total("kvlens_reused_work_units_total") / total("kvlens_prompt_work_units_total")
    assert f"{saved:.5f}" == "0.00344"
    assert total("kvlens_records_received_total", source="push") == 102
    assert total("kvlens_records_rejected_total", reason="cached_exceeds_prompt") == 1
    assert total("kvlens_records_rejected_total", reason="not_an_integer") == 1
    assert total("kvlens_ttft_seconds_count", prompt_len="8192-32767") == 10
    assert total("kvlens_ttft_seconds_bucket", prompt_len="0-511", le="0.05") == 90
    assert total("kvlens_ttft_component_seconds_total", component="queue") == pytest.approx(
        90 * 0.02 + 10 * 0.5
    )


def test_every_exported_family_is_in_the_metric_table() -> None:
    registry, _ = article_registry()
    names = {family.name for family in text_string_to_metric_families(generate_latest(registry).decode())}
    # with --scrape, model_shapes, tails, --kv-events, --isolation-probe, the app (ServiceHealth,
    # diagnoses), a tenant, and tenant_remember_blocks
    optional = {
        spec.name
        for spec in (
            *metrics.UPSTREAM,
            *metrics.DECODE,
            *metrics.TAIL,
            *metrics.KV,
            *metrics.KV_MODELLED,
            *metrics.DIAGNOSES,
            *metrics.ISOLATION,
            *metrics.SERVICE,
            *metrics.TENANT,
            *metrics.CROSS_TENANT,
        )
    }
    assert names == {spec.name for spec in metrics.ALL} - optional


def test_openmetrics_output_passes_the_strict_parser() -> None:
    registry, _ = article_registry()
    families = list(parse_openmetrics(generate_openmetrics(registry).decode()))
    assert {family.name for family in families} >= {"kvlens_requests", "kvlens_ttft_seconds"}


def test_a_failing_family_is_left_out_and_counted() -> None:
    registry, collector = article_registry()
    collector.aggregator.snapshot = broken_snapshot(collector.aggregator.snapshot)  # type: ignore[method-assign]
    text = generate_latest(registry).decode()
    assert "kvlens_requests_total" in text
    assert "kvlens_collector_errors_total 1.0" in text
    assert "kvlens_records_received_total" not in text


def test_a_failing_snapshot_still_answers() -> None:
    registry, collector = article_registry()

    def fail() -> None:
        raise RuntimeError("boom")

    collector.aggregator.snapshot = fail  # type: ignore[assignment,method-assign]
    assert "kvlens_collector_errors_total 1.0" in generate_latest(registry).decode()


def broken_snapshot(real):  # type: ignore[no-untyped-def]
    def snapshot():  # type: ignore[no-untyped-def]
        snap = real()
        snap.received = None  # breaks only the received family
        return snap

    return snapshot


def test_live_w4a16_estimate_uses_the_bandwidth_model() -> None:
    from kvlens import bandwidth

    settings = load_settings(
        model_shapes={"m": {"layers": 32, "kv_heads": 8, "head_dim": 128, "weight_bytes": "14GiB"}}
    )
    aggregator = Aggregator(settings)
    records = [{"model": "m", "prompt_tokens": 8000, "cached_tokens": 0, "output_tokens": 192}] * 50
    aggregator.add(batch_from_objects(records), "push")
    registry = CollectorRegistry()
    registry.register(KVLensCollector(aggregator))
    values = samples(generate_latest(registry).decode())
    m = frozenset({("model", "m")})
    assert values[("kvlens_decode_context_tokens", m)] == pytest.approx(8192)
    assert values[("kvlens_decode_batch", m)] == 1  # no engine scrape: batch 1
    step = bandwidth.compare_step(
        weight_bytes_16=14 * 2**30,
        weight_bytes_q=14 * 2**30 * bandwidth.quantized_weight_ratio(0.9, 4, 128),
        kv_bytes_per_token_=128 * 1024,
        batch=1,
        context_tokens=8192,
        bandwidth=1.0,
    )
    assert values[("kvlens_w4a16_decode_speedup", m)] == pytest.approx(step.speedup)
    assert values[("kvlens_decode_weight_share", m)] == pytest.approx(14 / 15)
