"""The sidecar as users run it: a real uvicorn process, real HTTP, promtool on its output."""

from __future__ import annotations

import gzip
import math
import socket
import subprocess
import sys
import threading

import httpx
import orjson
import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families

from tests.article import article_records
from tests.integration.conftest import Running, start_kvlens
from tests.live import free_port

pytestmark = pytest.mark.integration


def ndjson(records: list[dict[str, object]]) -> bytes:
    return b"\n".join(orjson.dumps(r) for r in records)


def scraped_sums(text: str) -> dict[str, dict[frozenset[tuple[str, str]], float]]:
    out: dict[str, dict[frozenset[tuple[str, str]], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[frozenset(sample.labels.items())] = sample.value
    return out


def total(values: dict[str, dict[frozenset[tuple[str, str]], float]], name: str, **match: str) -> float:
    return sum(v for labels, v in values.get(name, {}).items() if set(match.items()) <= labels)


def test_article_ratios_from_scraped_counters(kvlens_server: Running) -> None:
    response = httpx.post(f"{kvlens_server.url}/v1/records", content=ndjson(article_records()))
    assert response.json()["accepted"] == 100
    values = scraped_sums(httpx.get(f"{kvlens_server.url}/metrics").text)

    requests = total(values, "kvlens_requests_total")
    request_hit = total(values, "kvlens_requests_total", cache="hit") / requests
    token_reuse = total(values, "kvlens_cached_tokens_total") / total(values, "kvlens_prompt_tokens_total")
    saved = total(values, "kvlens_reused_work_units_total") / total(values, "kvlens_prompt_work_units_total")
    assert f"{request_hit:.4f}" == "0.9000"
    assert f"{token_reuse:.4f}" == "0.0154"
    assert f"{saved:.5f}" == "0.00344"


def test_live_output_passes_promtool_and_the_openmetrics_parser(
    kvlens_server: Running, promtool: str
) -> None:
    httpx.post(
        f"{kvlens_server.url}/v1/records",
        content=gzip.compress(ndjson(article_records())),
        headers={"content-encoding": "gzip"},
    )
    text = httpx.get(f"{kvlens_server.url}/metrics").text
    # promtool lints the Prometheus text format (it reads OpenMetrics' HELP lines as missing).
    checked = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    open_metrics = httpx.get(
        f"{kvlens_server.url}/metrics", headers={"accept": "application/openmetrics-text; version=1.0.0"}
    ).text
    families = list(parse_openmetrics(open_metrics))  # the strict parser: +Inf == count, no NaN, # EOF
    assert any(family.name == "kvlens_ttft_seconds" for family in families)


HOSTILE_BODIES = [
    b"\x00\x01\x02 binary",
    b"[" * 100_000,
    b'{"prompt_tokens": 1, "cached_tokens": 0, "model": "\\ud800"}',
    b'{"prompt_tokens": NaN, "cached_tokens": Infinity, "queue_seconds": -Infinity}',
    b'[{"prompt_tokens": 1e400, "cached_tokens": 0}, {"prompt_tokens": 3, "cached_tokens": 1}]',
    '{"prompt_tokens": 2, "cached_tokens": 1, "model": "quote\\" back\\\\slash ünï"}'.encode(),
    b'{"prompt_tokens": 2, "cached_tokens": 1, "model": "line\\nbreak"}',
    b'{"prompt_tokens": 2, "cached_tokens": 1, "ttft_seconds": 1e-320}',
]


def test_hostile_input_never_crashes_or_reaches_the_exposition(kvlens_server: Running, promtool: str) -> None:
    for body in HOSTILE_BODIES:
        response = httpx.post(f"{kvlens_server.url}/v1/records", content=body)
        assert response.status_code in (200, 400), (body[:40], response.status_code)
    assert httpx.get(f"{kvlens_server.url}/healthz").status_code == 200
    text = httpx.get(f"{kvlens_server.url}/metrics").text
    assert "NaN" not in text and "Inf " not in text.replace('le="+Inf"', "")
    assert "\ud800" not in text and "line\nbreak" not in text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            assert math.isfinite(sample.value), sample
    values = scraped_sums(text)
    assert total(values, "kvlens_requests_total") == 3  # the valid ones beside the bad
    assert (
        subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True).returncode
        == 0
    )


def test_client_killed_mid_request_leaves_the_server_serving(kvlens_server: Running) -> None:
    port = int(kvlens_server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b'POST /v1/records HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{"prompt_tok')
    response = httpx.post(f"{kvlens_server.url}/v1/records", content=ndjson(article_records()))
    assert response.json()["accepted"] == 100


def test_scrapes_during_ingestion_see_monotonic_counters(kvlens_server: Running) -> None:
    batch = ndjson(article_records() * 10)
    stop = threading.Event()
    errors: list[BaseException] = []

    def ingest() -> None:
        with httpx.Client() as client:
            for _ in range(30):
                try:
                    assert client.post(f"{kvlens_server.url}/v1/records", content=batch).status_code == 200
                except BaseException as error:  # reported by the main thread
                    errors.append(error)
                    return
        stop.set()

    worker = threading.Thread(target=ingest)
    worker.start()
    seen = []
    with httpx.Client() as client:
        while not stop.is_set() and worker.is_alive():
            seen.append(
                total(scraped_sums(client.get(f"{kvlens_server.url}/metrics").text), "kvlens_requests_total")
            )
    worker.join()
    assert not errors
    assert seen == sorted(seen)
    final = scraped_sums(httpx.get(f"{kvlens_server.url}/metrics").text)
    assert total(final, "kvlens_requests_total") == 30 * 1000


def test_demo_replays_the_bundled_trace_on_a_simulated_fleet() -> None:
    running = start_kvlens("demo", "--duration", "30", "--every", "1", "--speed", "40")
    try:
        with httpx.Client() as client:
            for _ in range(150):
                values = scraped_sums(client.get(f"{running.url}/metrics").text)
                if total(values, "kvlens_requests_total") >= 1000:
                    break
                threading.Event().wait(0.1)
        requests = total(values, "kvlens_requests_total", model="llama-3.1-8b")
        assert requests >= 1000
        assert total(values, "kvlens_records_received_total", source="demo") == requests
        # The model has a shape: compute saved in FLOPs, and the decode gauges are there.
        assert (
            total(values, "kvlens_prompt_flops_total") > 0
            and total(values, "kvlens_prompt_work_units_total") == 0
        )
        assert total(values, "kvlens_decode_context_tokens") > 0
        reuse = total(values, "kvlens_cached_tokens_total") / total(values, "kvlens_prompt_tokens_total")
        assert 0.02 < reuse < 0.7  # the Mooncake trace reuses; no fleet reuses more than it can reach (0.65)
        # Why reuse is lost: the simulated fleet's KV events, in process; every stored block has a cause
        recomputed = "kvlens_kv_recomputed_tokens_total"
        stored = total(values, "kvlens_kv_blocks_stored_total", medium="GPU")
        assert stored > 0 and total(values, recomputed) == 512 * stored
        assert total(values, recomputed, cause="new") > 0
        assert total(values, recomputed, cause="unknown") == 0  # no store left out: every parent known
        # the replicas serve the replayed model: their lost work in its FLOPs, as compute saved is
        work = "kvlens_kv_recomputed_work_total"
        assert total(values, work, unit="flops") == total(values, work) > 0
        assert total(values, "kvlens_kv_publisher_up") == 4
    finally:
        output = running.output()
    assert "Mooncake trace" in output and "request hit" in output
    assert "\n  recomputed: new " in output


# The README's first command installs `.[serve]`: no numba, so no compiled fleet index.
WITHOUT_NUMBA = """
import importlib.util, sys
find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, package=None: None if name == "numba" else find_spec(name, package)
sys.modules["numba"] = None  # importing it fails, as where it is not installed
from kvlens.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_demo_runs_on_the_serve_extra_alone_and_says_what_shows_why_reuse_is_lost() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            WITHOUT_NUMBA,
            "demo",
            "--duration",
            "4",
            "--every",
            "1",
            "--speed",
            "40",
            "--port",
            str(free_port()),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    words = " ".join(done.stdout.split())  # the note is wrapped to the terminal's width
    assert "needs the kv-events extra: pip install 'kvlens[kv-events]'" in words
    assert " requests | hit " in done.stdout and "recomputed:" not in done.stdout


def test_synthetic_demo_serves_article_shaped_numbers() -> None:
    running = start_kvlens(
        "demo", "--traffic", "synthetic", "--duration", "30", "--every", "1", "--rate", "200"
    )
    try:
        with httpx.Client() as client:
            for _ in range(100):
                values = scraped_sums(client.get(f"{running.url}/metrics").text)
                if total(values, "kvlens_requests_total") >= 200:
                    break
                threading.Event().wait(0.1)  # waiting for the feeder thread's next tick
        requests = total(values, "kvlens_requests_total")
        assert requests >= 200
        hit = total(values, "kvlens_requests_total", cache="hit") / requests
        reuse = total(values, "kvlens_cached_tokens_total") / total(values, "kvlens_prompt_tokens_total")
        assert hit > 0.6 and reuse < 0.1  # the article's point: the hit ratio flatters
        assert total(values, "kvlens_records_received_total", source="demo") == requests
    finally:
        output = running.output()
    assert "/metrics" in output
    assert "request hit" in output and "token reuse" in output and "compute saved" in output


def test_otlp_protobuf_over_http(kvlens_server: Running) -> None:
    from tests.unit.test_otlp import SGLANG_SPAN, VLLM_SPAN, protobuf_export

    body = gzip.compress(protobuf_export(*[SGLANG_SPAN] * 9, VLLM_SPAN))
    answer = httpx.post(
        f"{kvlens_server.url}/v1/traces",
        content=body,
        headers={"content-type": "application/x-protobuf", "content-encoding": "gzip"},
    )
    assert answer.status_code == 200
    assert answer.headers["content-type"] == "application/x-protobuf"
    values = scraped_sums(httpx.get(f"{kvlens_server.url}/metrics").text)
    assert total(values, "kvlens_requests_total", model="qwen") == 9
    assert total(values, "kvlens_records_rejected_total", source="otlp", reason="missing_cached_tokens") == 1


def test_a_stalled_body_gets_408_and_other_clients_are_served() -> None:
    running = start_kvlens("serve", env={"KVLENS_BODY_TIMEOUT_SECONDS": "1"})
    try:
        port = int(running.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as stalled:
            stalled.sendall(b'POST /v1/records HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n[{"prompt_')
            ok = httpx.post(f"{running.url}/v1/records", content=ndjson(article_records()))
            assert ok.json()["accepted"] == 100  # served while the other connection stalls
            answer = stalled.recv(4096)
        assert answer.startswith(b"HTTP/1.1 408")
    finally:
        running.output()
