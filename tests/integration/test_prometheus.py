"""A real Prometheus (Debian's) scrapes a real kvlens fed known records, evaluates the rules,
and answers every dashboard query; the headline ratios match the records."""

from __future__ import annotations

import math
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from kvlens.fleet.wire import BlockRemoved, BlockStored
from kvlens.sources.demo import REPLAY_SHAPE
from tests.article import article_records
from tests.dashboards import DASHBOARDS, load, queries
from tests.integration.conftest import Running, free_port, start_kvlens
from tests.integration.test_scrape import FIXTURE, FakeEngine
from tests.kv_publisher import TestPublisher

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parent.parent.parent


@pytest.fixture
def engine() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeEngine)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    FakeEngine.exposition = FIXTURE
    yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    server.shutdown()
    server.server_close()


@pytest.fixture
def kv_publisher() -> Iterator[TestPublisher]:
    publisher = TestPublisher(free_port())
    yield publisher
    publisher.close()


@pytest.fixture
def prometheus(tmp_path: Path, engine: str, kv_publisher: TestPublisher) -> Iterator[tuple[Running, str]]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("prometheus is missing: scripts/test installs Debian's prometheus package")
    kvlens = start_kvlens(
        "serve",
        "--scrape",
        engine,
        env={
            "KVLENS_SCRAPE_INTERVAL_SECONDS": "0.5",
            "KVLENS_MODELS": '["article-model", "Qwen/Qwen3-8B", "flops-model", "seconds-model"]',
            # article-model: a decode shape only, so its compute stays in the article's unit;
            # flops-model: a full shape (FLOPs); seconds-model: calibrated in seconds.
            "KVLENS_MODEL_SHAPES": orjson.dumps(
                {
                    "article-model": {"layers": 32, "kv_heads": 8, "head_dim": 128, "weight_bytes": "14GiB"},
                    "flops-model": REPLAY_SHAPE,
                }
            ).decode(),
            "KVLENS_COST_MODELS": '{"seconds-model": {"a": 7.3e-5, "b": 5.3e-9, "unit": "seconds"}}',
            "KVLENS_KV_EVENTS": orjson.dumps([{"name": "r0", "endpoint": kv_publisher.endpoint}]).decode(),
        },
    )
    # One replica's KV events: a block stored, evicted and stored again (the fleet row has data).
    kv_publisher.wait_subscribed()
    for event in (
        BlockStored([1], None, [1, 2, 3, 4], 4, None, "GPU", None),
        BlockRemoved([1], "GPU"),
        BlockStored([1], None, [1, 2, 3, 4], 4, None, "GPU", None),
    ):
        kv_publisher.publish_events([event])
    config = tmp_path / "prometheus.yml"
    config.write_text(
        orjson.dumps(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "rule_files": [
                    str(p) for p in sorted((ROOT / "deploy" / "prometheus").glob("kvlens-*.yaml"))
                ],
                "scrape_configs": [
                    {
                        "job_name": "kvlens",
                        "static_configs": [{"targets": [kvlens.url.removeprefix("http://")]}],
                    }
                ],
            }
        ).decode()
    )
    port = free_port()
    process = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait(lambda: httpx.get(f"{url}/-/ready", timeout=1).status_code == 200)
        yield kvlens, url
    finally:
        process.terminate()
        process.wait(timeout=20)
        kvlens.output()


def wait(done: Any, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if done():
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)  # Prometheus scrapes and evaluates on its own 1 s clock
    raise AssertionError("timed out waiting for Prometheus")


def finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def query(url: str, expr: str) -> list[dict[str, Any]]:
    answer = httpx.get(f"{url}/api/v1/query", params={"query": expr}).json()
    assert answer["status"] == "success", (expr, answer)
    return answer["data"]["result"]  # type: ignore[no-any-return]


def scalar(url: str, expr: str) -> float | None:
    """The single value of ``expr``, or None while it has none."""
    result = query(url, expr)
    assert len(result) <= 1, result
    return float(result[0]["value"][1]) if result else None


def test_rules_and_every_dashboard_query_on_a_real_prometheus(prometheus: tuple[Running, str]) -> None:
    kvlens, url = prometheus
    post = lambda records: httpx.post(f"{kvlens.url}/v1/records", content=orjson.dumps(records))  # noqa: E731
    # Earlier traffic creates the series, and Prometheus must see them before the measured
    # requests: a series' first sample is its baseline. Plenty of it, so that rate() never
    # clamps its extrapolation at zero (which it would do per series, skewing the ratios).
    short, long = article_records()[0], article_records()[-1]  # with timings: histograms exist too
    # The same requests, as two other models, give the FLOPs and seconds families data.
    other_units = [
        {**record, "model": model} for model in ("flops-model", "seconds-model") for record in (short, long)
    ]
    post([short, long] * 1000 + other_units * 100)
    wait(lambda: scalar(url, "sum(kvlens_requests_total)") == 2400)
    post(article_records() + other_units)
    FakeEngine.exposition = FIXTURE.replace("} 1008.0", "} 2016.0").replace("} 2048.0", "} 4096.0")
    wait(lambda: scalar(url, "sum(kvlens_requests_total)") == 2504)
    # Until the rules have been evaluated on a scrape that saw those requests, the ratios are
    # NaN (0/0) or absent.
    headline = [
        'model:kvlens_request_hit_ratio:ratio_rate5m{model="article-model"}',
        'unit:kvlens_compute_saved_ratio:ratio_rate5m{unit="work_units"}',
    ]
    wait(
        lambda: all(
            finite(scalar(url, expr))
            for expr in [*headline, "model:kvlens_engine_token_reuse_ratio:ratio_rate5m"]
        )
    )

    # The headline ratios, as the recording rules compute them, equal the records' own.
    article = '{model="article-model"}'
    assert scalar(url, f"model:kvlens_request_hit_ratio:ratio_rate5m{article}") == pytest.approx(
        0.9000, abs=0.001
    )
    assert scalar(url, f"model:kvlens_token_reuse_ratio:ratio_rate5m{article}") == pytest.approx(
        0.0154, abs=0.001
    )
    assert scalar(url, f"model:kvlens_compute_saved_ratio:ratio_rate5m{article}") == pytest.approx(
        0.00344, abs=0.001
    )
    # Only article-model counts in work units, so the fleet's work-unit ratio is its ratio;
    # FLOPs and seconds are never added to it.
    assert scalar(url, 'unit:kvlens_compute_saved_ratio:ratio_rate5m{unit="work_units"}') == pytest.approx(
        0.00344, abs=0.001
    )
    for unit in ("flops", "seconds"):
        assert finite(scalar(url, f'unit:kvlens_compute_saved_ratio:ratio_rate5m{{unit="{unit}"}}'))
    assert finite(scalar(url, 'model:kvlens_saved_prefill_seconds:rate5m{model="seconds-model"}'))

    rules = httpx.get(f"{url}/api/v1/rules").json()["data"]["groups"]
    assert {group["name"] for group in rules} == {
        "kvlens-ratios",
        "kvlens-latency",
        "kvlens-kv-events",
        "kvlens-alerts",
    }
    assert all(rule["health"] == "ok" for group in rules for rule in group["rules"]), rules

    for path in DASHBOARDS:
        for title, _, expr in queries(load(path)):
            result = query(url, expr)
            assert result, f"{path.name}: panel {title!r} returned no data for {expr}"
