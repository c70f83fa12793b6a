"""A real Prometheus (Debian's) scrapes a real kvlens fed known records, evaluates the rules,
and answers every dashboard query; the headline ratios match the records."""

from __future__ import annotations

import math
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from kvlens.fleet.schema import BlockRemoved, BlockStored
from kvlens.simulate.demo import REPLAY_SHAPE
from tests.article import article_records
from tests.dashboards import DASHBOARDS, SUBSTITUTIONS, annotation_queries, load, queries, variable_queries
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
def kv_publishers() -> Iterator[tuple[TestPublisher, TestPublisher]]:
    publishers = (TestPublisher(free_port()), TestPublisher(free_port()))
    yield publishers
    for publisher in publishers:
        publisher.close()


@pytest.fixture
def honest_fleet() -> Iterator[Running]:
    """A simulated engine that honours cache salts: the sidecar's isolation probe of it passes
    (the verdicts and the last conclusive probe's time the overview's isolation row reads)."""
    running = start_kvlens("simulate", "serve", "--block-size", "16", "--speed", "0.5", ready="/health")
    yield running
    running.output()


@pytest.fixture
def prometheus(
    tmp_path: Path,
    engine: str,
    kv_publishers: tuple[TestPublisher, TestPublisher],
    honest_fleet: Running,
) -> Iterator[tuple[Running, str, Callable[[int], Running]]]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("prometheus is missing: scripts/test installs Debian's prometheus package")
    # A followed file, so that the tail's checkpoint state (a sidecar-dashboard panel) exists.
    (tmp_path / "records.jsonl").write_text("")

    def launch(port: int | None = None) -> Running:
        return start_kvlens(
            "serve",
            "--scrape",
            engine,
            "--tail",
            str(tmp_path / "records.jsonl"),
            port=port,
            env={
                "KVLENS_STATE_DIR": str(tmp_path / "state"),
                "KVLENS_SCRAPE_INTERVAL_SECONDS": "0.5",
                "KVLENS_MODELS": '["article-model", "Qwen/Qwen3-8B", "flops-model", "seconds-model"]',
                # article-model: a decode shape only, so its compute stays in the article's unit;
                # flops-model: a full shape (FLOPs); seconds-model: calibrated in seconds.
                "KVLENS_MODEL_SHAPES": orjson.dumps(
                    {
                        "article-model": {
                            "layers": 32,
                            "kv_heads": 8,
                            "head_dim": 128,
                            "weight_bytes": "14GiB",
                        },
                        "flops-model": REPLAY_SHAPE,
                    }
                ).decode(),
                "KVLENS_COST_MODELS": '{"seconds-model": {"a": 7.3e-5, "b": 5.3e-9, "unit": "seconds"}}',
                # Records' prefix_hashes through modelled caches of 2 blocks (the modelled causes).
                "KVLENS_MODELLED_CAPACITY_BLOCKS": "2",
                "KVLENS_MODELLED_BLOCK_SIZE": "4",
                # Records' tenant and prefix_hashes: who stored each block (the cross-tenant row).
                "KVLENS_TENANT_REMEMBER_BLOCKS": "64",
                # Probed every second, the first run within a second of the start.
                "KVLENS_ISOLATION_PROBES": orjson.dumps([f"honest={honest_fleet.url}#simulated"]).decode(),
                "KVLENS_ISOLATION_EVERY_SECONDS": "1",
                "KVLENS_KV_EVENTS": orjson.dumps(
                    [{"name": f"r{i}", "endpoint": p.endpoint} for i, p in enumerate(kv_publishers)]
                ).decode(),
            },
        )

    kvlens = launch()
    # Two replicas' KV events, so that every cause the "Why reuse is lost" row reads has data: r0
    # computes blocks 1 and 2 (new), r1 computes block 1 while r0 holds it (held_elsewhere), r0
    # evicts block 2 and computes it again (evicted_here). Timestamps order them across publishers.
    r0, r1 = kv_publishers
    for publisher in kv_publishers:
        publisher.wait_subscribed()
    for at, (publisher, event) in enumerate(
        (
            (r0, BlockStored([1], None, [1, 2, 3, 4], 4, None, "GPU", None)),
            (r0, BlockStored([2], None, [5, 6, 7, 8], 4, None, "GPU", None)),
            (r1, BlockStored([1], None, [1, 2, 3, 4], 4, None, "GPU", None)),
            (r0, BlockRemoved([2], "GPU")),
            (r0, BlockStored([2], None, [5, 6, 7, 8], 4, None, "GPU", None)),
        ),
        start=1,
    ):
        publisher.publish_events([event], ts=1_800_000_000.0 + at)
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
        yield kvlens, url, launch
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


def test_rules_and_every_dashboard_query_on_a_real_prometheus(
    prometheus: tuple[Running, str, Callable[[int], Running]],
) -> None:
    kvlens, url, launch = prometheus
    post = lambda records: httpx.post(f"{kvlens.url}/v1/records", content=orjson.dumps(records))  # noqa: E731
    # Earlier traffic creates the series, and Prometheus must see them before the measured
    # requests: a series' first sample is its baseline. Plenty of it, so that rate() never
    # clamps its extrapolation at zero (which it would do per series, skewing the ratios).
    # With timings (end-to-end too): the latency histograms exist. Two tenants: team-b sends the
    # long requests and one short one (s1), team-a the rest.
    records = [
        {
            **record,
            "e2e_seconds": record["ttft_seconds"] + 2.0,
            "tenant": "team-b" if record["request_id"] == "s1" or record["cached_tokens"] == 0 else "team-a",
        }
        for record in article_records()
    ]
    short, long = records[0], records[-1]
    # Five of the measured requests carry a gateway's prefix_hashes and replica: through the
    # modelled caches of 2 blocks, r0 computes 1 and 2 (new), r1 computes 1 while r0 holds it
    # (held_elsewhere), r0 computes 3 and 4 (new, evicting 1 and 2), then 2 again (evicted_here,
    # evicting the leaf 4, not its parent 3), and r1 computes 4, which only r0 had held
    # (evicted_elsewhere). By tenant: s1 (team-b) got block 1 from the cache, which s0 (team-a)
    # stored, its 16 tokens (a block of the records' default size) a cross-tenant hit.
    modelled = [("r0", [1, 2]), ("r1", [1]), ("r0", [3, 4]), ("r0", [2]), ("r1", [4])]
    measured = [
        {**record, "replica": replica, "prefix_hashes": ids}
        for record, (replica, ids) in zip(records, modelled, strict=False)
    ] + records[len(modelled) :]
    # The same requests, as two other models, give the FLOPs and seconds families data.
    other_units = [
        {**record, "model": model} for model in ("flops-model", "seconds-model") for record in (short, long)
    ]
    post([short, long] * 1000 + other_units * 100)
    wait(lambda: scalar(url, "sum(kvlens_requests_total)") == 2400)
    post(measured + other_units)
    FakeEngine.exposition = FIXTURE.replace("} 1008.0", "} 2016.0").replace("} 2048.0", "} 4096.0")
    wait(lambda: scalar(url, "sum(kvlens_requests_total)") == 2504)
    # Until the rules have been evaluated on a scrape that saw those requests, the ratios are
    # NaN (0/0) or absent.
    article = '{model="article-model"}'
    wait(
        lambda: all(
            finite(scalar(url, expr))
            for expr in [
                f"namespace_model:kvlens_request_hit_ratio:ratio_rate5m{article}",
                "instance_model:kvlens_engine_token_reuse_ratio:ratio_rate5m",
            ]
        )
    )

    # The headline ratios, as the recording rules compute them, equal the records' own, and the
    # rules keep the job and instance the dashboard selects on.
    sidecar = kvlens.url.removeprefix("http://")
    for level in ("instance_model", "namespace_model"):
        hit = query(url, f"{level}:kvlens_request_hit_ratio:ratio_rate5m{article}")
        assert len(hit) == 1 and hit[0]["metric"]["job"] == "kvlens"
        assert hit[0]["metric"].get("instance") == (sidecar if level == "instance_model" else None)
        assert float(hit[0]["value"][1]) == pytest.approx(0.9000, abs=0.001)
        assert scalar(url, f"{level}:kvlens_token_reuse_ratio:ratio_rate5m{article}") == pytest.approx(
            0.0154, abs=0.001
        )

    # The overview's own stats, as Grafana would send them for a 5-minute range.
    overview = load(next(path for path in DASHBOARDS if path.name == "kvlens-overview.json"))
    stats = {title: expr for title, _, expr in queries(overview)}
    # The measured requests: the article's 100 (90 hits) and 4 of the other models (2 hits).
    assert scalar(url, stats["Request hit ratio"]) == pytest.approx(92 / 104, abs=0.005)
    units = {
        result["metric"]["unit"]: float(result["value"][1])
        for result in query(url, stats["Compute saved (modelled)"])
    }
    # Only article-model counts in work units, so the fleet's work-unit ratio is its ratio;
    # FLOPs and seconds are never added to it.
    assert set(units) == {"work_units", "flops", "seconds"}
    assert units["work_units"] == pytest.approx(0.00344, abs=0.001)
    assert all(math.isfinite(value) for value in units.values())
    per_model = {
        result["metric"]["model"]: float(result["value"][1])
        for result in query(
            url,
            next(expr for title, raw, expr in queries(overview) if title == "Per model" and "saved" in raw),
        )
    }
    assert per_model["article-model"] == pytest.approx(0.00344, abs=0.001)

    # The hit-beside-miss table orders its rows by a numeric label taken from prompt_len.
    rows = [
        result["metric"]
        for title, _, expr in queries(overview)
        if title.startswith("TTFT by prompt length")
        for result in query(url, expr)
    ]
    assert {(row["prompt_len"], row["length_from"]) for row in rows} == {
        ("0-511", "0"),
        ("8192-32767", "8192"),
    }

    # The modelled causes reach Prometheus apart from the observed ones, 4 tokens a block.
    wait(lambda: scalar(url, "sum(kvlens_kv_modelled_records_total)") == 5)
    assert {
        result["metric"]["cause"]: float(result["value"][1])
        for result in query(url, "sum by (cause) (kvlens_kv_modelled_recomputed_tokens_total)")
    } == {
        "new": 16,
        "held_elsewhere": 4,
        "evicted_here": 4,
        "evicted_elsewhere": 4,
        "held_here": 0,
        "unknown": 0,
    }

    # Every request by tenant; the cross-tenant tokens by the tenant that got them.
    assert {
        (result["metric"]["tenant"], result["metric"]["cache"]): float(result["value"][1])
        for result in query(url, "sum by (tenant, cache) (kvlens_tenant_requests_total)")
    } == {("team-a", "hit"): 1291, ("team-a", "miss"): 0, ("team-b", "hit"): 1, ("team-b", "miss"): 1212}
    wait(lambda: scalar(url, "sum(kvlens_cross_tenant_cached_tokens_total)") == 16)
    assert {
        result["metric"]["tenant"]: float(result["value"][1])
        for result in query(url, "kvlens_cross_tenant_cached_tokens_total")
    } == {"team-a": 0, "team-b": 16}

    # The isolation probe of the honest fleet: a conclusive run's time is kept, the cases read
    # from cached_tokens pass, and timing never shows a leak (on a loaded host it may find too
    # little contrast to judge: -1).
    wait(lambda: query(url, "kvlens_isolation_probe_last_success_timestamp_seconds") != [])
    verdicts = {
        result["metric"]["case"]: float(result["value"][1])
        for result in query(url, 'kvlens_isolation_probe_result{target="honest"}')
    }
    assert verdicts.pop("timing") in {1, -1}
    assert verdicts == {"same_salt": 1, "different_salt": 1, "salt_vs_none": 1}

    rules = httpx.get(f"{url}/api/v1/rules").json()["data"]["groups"]
    assert {group["name"] for group in rules} == {"kvlens-ratios", "kvlens-kv-events", "kvlens-alerts"}
    assert all(rule["health"] == "ok" for group in rules for rule in group["rules"]), rules

    # Every panel of every dashboard has data with every variable on "All" (`.*` matching the
    # cluster and namespace labels this Prometheus does not have), and with this sidecar chosen.
    chosen = {**SUBSTITUTIONS, "$instance": sidecar.replace(".", "\\\\.")}
    for path in DASHBOARDS:
        dashboard = load(path)
        for substitutions in (SUBSTITUTIONS, chosen):
            for title, _, expr in queries(dashboard, substitutions):
                result = query(url, expr)
                assert result, f"{path.name}: panel {title!r} returned no data for {expr}"
        for _, expr in annotation_queries(dashboard):
            assert query(url, expr) == [], expr  # no restart yet
        values = {
            variable: httpx.get(f"{url}/api/v1/label/{label}/values", params={"match[]": selector}).json()[
                "data"
            ]
            for variable, label, selector in variable_queries(dashboard)
        }
        expected = {"cluster": [], "namespace": [], "job": ["kvlens"], "instance": [sidecar]}
        if "model" in values:
            expected["model"] = sorted(["article-model", "Qwen/Qwen3-8B", "flops-model", "seconds-model"])
        assert values == expected, path.name

    # A restart of kvlens (same port, so the same target): the restart annotation marks it.
    kvlens.output()
    restarted = launch(kvlens.port)
    try:
        for path in DASHBOARDS:
            for _, expr in annotation_queries(load(path)):
                wait(lambda expr=expr: [r["metric"]["instance"] for r in query(url, expr)] == [sidecar])
    finally:
        restarted.output()
