"""Parsing vLLM's /metrics across versions, and reset-aware engine counters."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlens.exporter.upstream import UpstreamState
from kvlens.sources.vllm_metrics import ScrapeError, parse, target_name

FIXTURES = Path(__file__).parent.parent / "fixtures"


def by_counter(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for sample in parse(text).counters:
        out[sample.counter] = out.get(sample.counter, 0.0) + sample.value
    return out


def test_vllm_0_33_exposition() -> None:
    scrape = parse((FIXTURES / "vllm-0.33-metrics.prom").read_text())
    totals = by_counter((FIXTURES / "vllm-0.33-metrics.prom").read_text())
    assert totals == {
        "prefix_cache_queried_tokens": 3048.0,
        "prefix_cache_hit_tokens": 1008.0,
        "prompt_tokens": 3048.0,
        "cached_prompt_tokens": 1008.0,
        "requests": 5.0,
    }
    assert scrape.running == {"Qwen/Qwen3-8B": 5.0}
    assert {s.model for s in scrape.counters} == {"Qwen/Qwen3-8B"}


def test_vllm_0_8_counts_blocks_apart_from_tokens() -> None:
    totals = by_counter((FIXTURES / "vllm-0.8.5-metrics.prom").read_text())
    assert totals == {
        "prefix_cache_queried_blocks": 40.0,
        "prefix_cache_hit_blocks": 12.0,
        "prompt_tokens": 640.0,
    }


def test_gpu_names_in_tokens_stay_tokens() -> None:
    text = (
        "# HELP vllm:gpu_prefix_cache_hits_total GPU prefix cache hits, "
        "in terms of number of cached tokens.\n"
        "# TYPE vllm:gpu_prefix_cache_hits_total counter\n"
        'vllm:gpu_prefix_cache_hits_total{engine="0",model_name="m"} 7.0\n'
    )
    assert by_counter(text) == {"prefix_cache_hit_tokens": 7.0}


@pytest.mark.parametrize(
    "garbage", ['vllm:prompt_tokens_total{model_name="m" 3', "# TYPE x counter\nx{a=b} 1\n"]
)
def test_garbage_exposition_is_a_parse_error(garbage: str) -> None:
    with pytest.raises(ScrapeError) as caught:
        parse(garbage)
    assert caught.value.reason == "parse"


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300))
def test_parse_never_raises_anything_but_scrape_error(text: str) -> None:
    with contextlib.suppress(ScrapeError):
        parse(text)


def test_target_names() -> None:
    assert target_name("http://10.0.0.5:8000/metrics") == "10.0.0.5:8000"
    assert target_name("http://vllm:8000/engine/metrics") == "vllm:8000/engine/metrics"


def exposition(hits: float, engine: str = "0") -> str:
    return (
        "# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.\n"
        "# TYPE vllm:prefix_cache_hits_total counter\n"
        f'vllm:prefix_cache_hits_total{{engine="{engine}",model_name="m"}} {hits}\n'
    )


def test_counters_are_reset_aware_and_start_at_the_first_scrape() -> None:
    upstream = UpstreamState(("vllm:8000",))
    seen = []
    for hits in (100, 150, 20, 50):  # the engine restarted between 150 and 20
        upstream.record_scrape("vllm:8000", parse(exposition(hits)), lambda model: model)
        seen.append(upstream.snapshot().counters[("prefix_cache_hit_tokens", "vllm:8000", "m")])
    assert seen == [0.0, 50.0, 70.0, 100.0]
    assert upstream.snapshot().up == {"vllm:8000": 1}


def test_failure_marks_the_target_down_and_counts_the_reason() -> None:
    upstream = UpstreamState(("a:1", "b:2"))
    upstream.record_scrape("a:1", parse(exposition(5)), str)
    upstream.record_failure("b:2", "timeout")
    snapshot = upstream.snapshot()
    assert snapshot.up == {"a:1": 1, "b:2": 0}
    assert snapshot.errors[("b:2", "timeout")] == 1
    assert snapshot.errors[("a:1", "timeout")] == 0
