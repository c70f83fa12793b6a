"""Defect 9: a scraped engine must not be able to exhaust labels, poison the exposition, grow
memory without bound or drive counters to infinity.

Requirement (reliability.md 5.3, 5.4, 5.12): engine label values follow the pushed records' rules
under their own budget; a series cap per target; only finite deltas.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator

import httpx
import orjson
import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics

from tests.hostile.conftest import Serve
from tests.live import EngineServer

pytestmark = pytest.mark.integration
HELP = (
    "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.\n"
    "# TYPE vllm:prompt_tokens_total counter\n"
)


@pytest.fixture
def engine() -> Iterator[Callable[[Callable[[int], str]], EngineServer]]:
    engines: list[EngineServer] = []

    def make(exposition: Callable[[int], str]) -> EngineServer:
        engines.append(EngineServer(exposition))
        return engines[-1]

    yield make
    for made in engines:
        made.close()


def test_engine_models_do_not_spend_the_records_label_budget(
    serve: Serve, engine: Callable[..., EngineServer]
) -> None:
    models = "".join(f'vllm:prompt_tokens_total{{model_name="engine-{i}"}} {i}\n' for i in range(5))
    upstream = engine(lambda n: HELP + models)
    sidecar = serve("--scrape", upstream.url, KVLENS_MAX_MODELS="2", KVLENS_SCRAPE_INTERVAL_SECONDS="0.05")
    assert upstream.wait_for_scrapes(3) >= 3  # its model names were all seen before ours
    records = [{"prompt_tokens": 10, "cached_tokens": 1, "model": name} for name in ("a", "b")]
    httpx.post(f"{sidecar.url}/v1/records", content=orjson.dumps(records))
    assert sidecar.value("kvlens_requests_total", model="a") == 1
    assert sidecar.value("kvlens_requests_total", model="b") == 1


def test_engine_label_values_are_held_to_the_label_rules(
    serve: Serve, engine: Callable[..., EngineServer], promtool: str
) -> None:
    hostile = ["new\\nline", 'quo\\"te', "long-" + "x" * 300, "back\\\\slash"]
    text = "".join(f'vllm:prompt_tokens_total{{model_name="{name}"}} 5\n' for name in hostile)
    upstream = engine(lambda n: HELP + text.replace(" 5\n", f" {5 + n}\n"))
    sidecar = serve("--scrape", upstream.url, KVLENS_SCRAPE_INTERVAL_SECONDS="0.05")
    assert sidecar.wait_for("kvlens_engine_prompt_tokens_total", 4) >= 4
    page = httpx.get(f"{sidecar.url}/metrics").text
    # the same rules as a pushed record's model: printable and at most 128 bytes (quotes and
    # backslashes are printable, and escaped in the exposition); the others count under "other"
    assert "x" * 200 not in page and "new\\nline" not in page
    models = {
        labels
        for (name, labels), _ in sidecar.samples().items()
        if name == "kvlens_engine_prompt_tokens_total"
    }
    assert {dict(labels)["model"] for labels in models} == {'quo"te', "back\\slash", "other"}
    checked = subprocess.run([promtool, "check", "metrics"], input=page, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    accept = {"accept": "application/openmetrics-text; version=1.0.0"}
    list(parse_openmetrics(httpx.get(f"{sidecar.url}/metrics", headers=accept).text))


def test_series_that_change_every_scrape_keep_memory_flat(
    serve: Serve, engine: Callable[..., EngineServer]
) -> None:
    def churn(n: int) -> str:  # 2,000 series with labels that never repeat
        lines = (f'vllm:prompt_tokens_total{{model_name="m",pod="p{n}-{i}"}} {i}\n' for i in range(2000))
        return HELP + "".join(lines)

    upstream = engine(churn)
    sidecar = serve("--scrape", upstream.url, KVLENS_SCRAPE_INTERVAL_SECONDS="0.01")
    assert upstream.wait_for_scrapes(20) >= 20
    memory = sidecar.memory()
    before = memory.rss_mib()
    # 120,000 series come and go; kept, even 35 bytes each would show (measured: +0.02 MiB).
    assert upstream.wait_for_scrapes(80, timeout=60) >= 80
    assert memory.rss_mib() - before < 4
    assert sidecar.value("kvlens_upstream_samples_rejected_total", reason="series_overflow") > 0  # cap 1,000


def test_engine_counters_stay_finite(serve: Serve, engine: Callable[..., EngineServer]) -> None:
    values = ["1.7e308", "1e308"]
    upstream = engine(lambda n: HELP + f'vllm:prompt_tokens_total{{model_name="m"}} {values[n % 2]}\n')
    sidecar = serve("--scrape", upstream.url, KVLENS_SCRAPE_INTERVAL_SECONDS="0.02")
    assert upstream.wait_for_scrapes(11) >= 11
    total = sidecar.value("kvlens_engine_prompt_tokens_total")
    assert total == 0  # values past 2**53 cannot count tokens exactly: refused, never added
    assert sidecar.value("kvlens_upstream_samples_rejected_total", reason="invalid_value") >= 10
