"""kvlens scraping engine /metrics over real HTTP: reconciliation, deadlines, caps, garbage."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import threading
import time
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvlens.sources import vllm_metrics
from kvlens.sources.encoding import DecodeLimits
from tests.integration.conftest import Running, free_port, start_kvlens
from tests.live import TextHandler

pytestmark = pytest.mark.integration
FIXTURE = (Path(__file__).parent.parent / "fixtures" / "vllm-0.33-metrics.prom").read_text()


class FakeEngine(TextHandler):
    """Serves vLLM 0.33 exposition text, and the ways an upstream goes wrong."""

    exposition = FIXTURE
    stop = threading.Event()

    def do_GET(self) -> None:
        if self.path == "/metrics":
            self.answer(self.exposition.encode())
        elif self.path == "/huge/metrics":
            self.answer(b"# " + b"x" * (2 * 1024 * 1024) + b"\n")
        elif self.path == "/garbage/metrics":
            self.answer(b'vllm:prompt_tokens_total{model_name="m" 3\n')
        elif self.path == "/missing/metrics":
            self.send_response(404)
            self.end_headers()
        elif self.path == "/drip/metrics":  # one byte a second, at most 30
            self.send_response(200)
            self.send_header("content-length", "30")
            self.end_headers()
            for _ in range(30):
                if self.stop.wait(1.0):
                    return
                self.wfile.write(b"#")
                self.wfile.flush()


@pytest.fixture
def engine() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeEngine)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    FakeEngine.stop.clear()
    FakeEngine.exposition = FIXTURE
    yield f"http://127.0.0.1:{server.server_address[1]}"
    FakeEngine.stop.set()
    server.shutdown()
    server.server_close()


def values(running: Running) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = httpx.get(f"{running.url}/metrics").text
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls)


def wait_for(
    running: Running, done: object, seconds: float = 20
) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    deadline = time.monotonic() + seconds
    while True:
        samples = values(running)
        if done(samples) or time.monotonic() > deadline:  # type: ignore[operator]
            return samples
        time.sleep(0.1)  # the sidecar scrapes on its own interval


def test_scrape_reconciles_and_survives_every_kind_of_bad_upstream(engine: str) -> None:
    host = engine.removeprefix("http://")
    dead = f"127.0.0.1:{free_port()}"
    targets = [f"{engine}/metrics"] + [
        f"{engine}/{kind}/metrics" for kind in ("huge", "garbage", "missing", "drip")
    ]
    env = {
        "KVLENS_SCRAPE_TARGETS": str([*targets, f"http://{dead}/metrics"]).replace("'", '"'),
        "KVLENS_SCRAPE_INTERVAL_SECONDS": "0.2",
        "KVLENS_SCRAPE_TIMEOUT_SECONDS": "1.5",
        "KVLENS_SCRAPE_MAX_BYTES": "65536",
    }
    running = start_kvlens("serve", env=env)
    try:

        def every_failure_seen(samples: dict[tuple[str, frozenset[tuple[str, str]]], float]) -> bool:
            errors = "kvlens_upstream_scrape_errors_total"
            return (
                all(
                    value(samples, errors, target=f"{host}/{kind}/metrics", reason=reason) >= 1
                    for kind, reason in (
                        ("huge", "too_large"),
                        ("garbage", "parse"),
                        ("missing", "http_status"),
                        ("drip", "timeout"),
                    )
                )
                and value(samples, errors, target=dead, reason="connect") >= 1
            )

        samples = wait_for(running, every_failure_seen)
        assert every_failure_seen(samples)
        assert value(samples, "kvlens_upstream_up", target=host) == 1
        for down in (f"{host}/huge/metrics", f"{host}/garbage/metrics", f"{host}/drip/metrics", dead):
            assert value(samples, "kvlens_upstream_up", target=down) == 0
        assert value(samples, "kvlens_engine_requests_running", target=host, model="Qwen/Qwen3-8B") == 5

        # The engine serves 500 more cached tokens: kvlens's engine counter grows by exactly that.
        before = value(samples, "kvlens_engine_prefix_cache_hit_tokens_total", target=host)
        FakeEngine.exposition = FIXTURE.replace(
            'vllm:prefix_cache_hits_total{engine="0",model_name="Qwen/Qwen3-8B"} 1008.0',
            'vllm:prefix_cache_hits_total{engine="0",model_name="Qwen/Qwen3-8B"} 1508.0',
        )
        samples = wait_for(
            running, lambda s: value(s, "kvlens_engine_prefix_cache_hit_tokens_total", target=host) > before
        )
        assert value(samples, "kvlens_engine_prefix_cache_hit_tokens_total", target=host) == before + 500
        assert (
            httpx.post(f"{running.url}/v1/records", json={"prompt_tokens": 1, "cached_tokens": 0}).status_code
            == 200
        )
    finally:
        FakeEngine.stop.set()
        running.output()


def test_a_scrape_cancelled_at_any_step_of_its_exchange_stops() -> None:
    """A sidecar told to stop cancels its scrape loop; a scrape must never swallow that.

    ``asyncio.wait_for`` before Python 3.12 returns the inner result when the cancellation lands
    in the loop iteration where the read completes, and the scrape loop then went on for ever: a
    SIGTERM-ed sidecar that scraped every 10 ms never exited (seen in CI). This cancels one scrape
    at each step of a real exchange over loopback, from its first await to its end.
    """
    body = b"# TYPE vllm:prompt_tokens counter\nvllm:prompt_tokens_total 1\n"
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n\r\n" % len(body)

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            while await reader.readuntil(b"\r\n\r\n"):
                writer.write(head + body)
                await writer.drain()
        writer.close()

    async def cancel_at_every_step() -> tuple[int, int]:
        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        target = vllm_metrics.ScrapeTarget.from_url(f"http://127.0.0.1:{port}/metrics")
        limits = DecodeLimits(1 << 20, math.inf, 4)
        swallowed = cancelled = 0
        async with server, httpx.AsyncClient() as client:
            for steps in itertools.chain.from_iterable(itertools.repeat(range(40), 4)):
                scrape = asyncio.create_task(
                    vllm_metrics.fetch(client, target, deadline_seconds=5, limits=limits)
                )
                for _ in range(steps):
                    await asyncio.sleep(0)
                if scrape.done():  # finished before this step: nothing to cancel
                    await scrape
                    continue
                scrape.cancel()
                try:
                    await scrape
                    swallowed += 1
                except asyncio.CancelledError:
                    cancelled += 1
        return swallowed, cancelled

    swallowed, cancelled = asyncio.run(cancel_at_every_step())
    assert cancelled >= 40  # the sweep did cancel scrapes in flight
    assert swallowed == 0
