"""Parsing vLLM's /metrics across versions, and reset-aware engine counters."""

from __future__ import annotations

import base64
import contextlib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlens.exporter.labels import ClosedLabels
from kvlens.exporter.upstream import UpstreamState
from kvlens.sources.vllm_metrics import (
    MAX_LINE_CHARS,
    ScrapeError,
    ScrapeTarget,
    longest_line,
    parse,
    target_name,
)

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
    assert target_name("http://u:p%40ss@[::1]:8000/metrics?token=t") == "[::1]:8000"  # no secrets


def test_a_target_keeps_its_credentials_apart_from_its_url(tmp_path: Path) -> None:
    target = ScrapeTarget.from_url("http://scraper:p%40ss@vllm:8000/metrics?token=t")
    assert (target.name, target.url) == ("vllm:8000", "http://vllm:8000/metrics?token=t")
    auth = target.auth()
    assert auth is not None and auth._auth_header == "Basic " + base64.b64encode(b"scraper:p@ss").decode()
    assert "p@ss" not in repr(target) and "token" not in repr(target)
    password = tmp_path / "password"
    password.write_text("first\n")
    from_file = ScrapeTarget.from_url("http://vllm:8000/metrics", "scraper", password)
    first = from_file.auth()
    password.write_text("rotated")
    rotated = from_file.auth()  # read at each scrape, as Prometheus' password_file
    assert first is not None and rotated is not None
    assert first._auth_header == "Basic " + base64.b64encode(b"scraper:first").decode()
    assert rotated._auth_header == "Basic " + base64.b64encode(b"scraper:rotated").decode()
    password.unlink()
    with pytest.raises(ScrapeError, match="password file") as failed:
        from_file.auth()
    assert failed.value.reason == "connect"
    assert ScrapeTarget.from_url("http://vllm:8000/metrics").auth() is None


def exposition(hits: float, engine: str = "0") -> str:
    return (
        "# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.\n"
        "# TYPE vllm:prefix_cache_hits_total counter\n"
        f'vllm:prefix_cache_hits_total{{engine="{engine}",model_name="m"}} {hits}\n'
    )


def upstream_state(*targets: str, max_series: int = 1000) -> UpstreamState:
    return UpstreamState(targets, ClosedLabels([], 50, "unknown"), max_series=max_series)


def test_counters_are_reset_aware_and_start_at_the_first_scrape() -> None:
    upstream = upstream_state("vllm:8000")
    seen = []
    for hits in (100, 150, 20, 50):  # the engine restarted between 150 and 20
        upstream.record_scrape("vllm:8000", parse(exposition(hits)))
        seen.append(upstream.snapshot().counters[("prefix_cache_hit_tokens", "vllm:8000", "m")])
    assert seen == [0.0, 50.0, 70.0, 100.0]
    assert upstream.snapshot().up == {"vllm:8000": 1}


def test_failure_marks_the_target_down_and_counts_the_reason() -> None:
    upstream = upstream_state("a:1", "b:2")
    upstream.record_scrape("a:1", parse(exposition(5)))
    upstream.record_failure("b:2", "timeout")
    snapshot = upstream.snapshot()
    assert snapshot.up == {"a:1": 1, "b:2": 0}
    assert snapshot.errors[("b:2", "timeout")] == 1
    assert snapshot.errors[("a:1", "timeout")] == 0


def test_values_that_cannot_count_tokens_are_refused_and_counted() -> None:
    upstream = upstream_state("e:1")
    for hits in ("10", "NaN", "-5", "+Inf", "1e300", "30"):
        upstream.record_scrape("e:1", parse(exposition(hits)))  # type: ignore[arg-type]
    snapshot = upstream.snapshot()
    assert snapshot.counters[("prefix_cache_hit_tokens", "e:1", "m")] == 20.0  # 10 -> 30, nothing else
    assert snapshot.rejected[("e:1", "invalid_value")] == 4


def test_series_past_the_cap_are_refused_and_churn_is_forgotten() -> None:
    upstream = upstream_state("e:1", max_series=2)
    lines = "".join(f'vllm:prompt_tokens_total{{model_name="m",pod="{i}"}} {i}\n' for i in range(3))
    upstream.record_scrape("e:1", parse("# TYPE vllm:prompt_tokens_total counter\n" + lines))
    assert upstream.snapshot().rejected[("e:1", "series_overflow")] == 1
    assert len(upstream._previous["e:1"]) == 2
    fresh = 'vllm:prompt_tokens_total{model_name="m",pod="new"} 7\n'
    upstream.record_scrape("e:1", parse("# TYPE vllm:prompt_tokens_total counter\n" + fresh))
    assert set(upstream._previous["e:1"]) == {("prompt_tokens", (("model_name", "m"), ("pod", "new")))}


def test_engine_model_names_are_labels_under_their_own_budget() -> None:
    labels = ClosedLabels([], 1, "unknown")
    upstream = UpstreamState(("e:1",), labels, max_series=100)
    text = "".join(
        f'vllm:prompt_tokens_total{{model_name="{name}"}} 1\n'
        for name in ("first", "second", "other", "bad\\nname")
    )
    upstream.record_scrape("e:1", parse("# TYPE vllm:prompt_tokens_total counter\n" + text))
    models = {model for (_, _, model) in upstream.snapshot().counters}
    assert models == {"first", "other"}


def test_a_line_past_the_limit_is_refused_before_it_is_parsed() -> None:
    head = '# TYPE vllm:prompt_tokens_total counter\nvllm:prompt_tokens_total{model_name="'
    fits = head + "x" * (MAX_LINE_CHARS - len(head.splitlines()[1]) - 4) + '"} 1\n'
    assert longest_line(fits) == MAX_LINE_CHARS
    assert len(parse(fits).counters) == 1
    with pytest.raises(ScrapeError, match="longer than") as refused:
        parse(fits.replace('"} 1', 'x"} 1'))
    assert refused.value.reason == "too_large"
    assert longest_line("") == 0 and longest_line("ab\nc") == 2 and longest_line("a\n\nabc\n") == 3
