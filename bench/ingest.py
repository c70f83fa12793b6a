"""Ingest and exposition benchmarks, each printed beside a baseline measured in the same run.

    .venv/bin/python bench/ingest.py [--quick]
    .venv/bin/python bench/ingest.py --http [--plugin] [--rounds N] [--before OTHER/service]

Figures (medians of repeated runs; these machines are noisy, so compare ratios):
- in-process ingest (decode + validate + aggregate) vs the raw orjson parse of the same NDJSON
  payload, and vs a naive implementation (pydantic per record, prometheus_client
  ``.labels(...).inc()/.observe()`` per record);
- HTTP ingest of 1,000-record NDJSON batches to ``kvlens serve`` vs the naive implementation
  served the same way (uvicorn, one worker, a separate process), with and without a scraper;
  one client, the servers taking turns each round; with the servers' CPU per 100 bodies.
  ``--plugin`` sends the same requests as the vLLM plugin does (JSON arrays, its fields, a
  batch id each); ``--before`` serves another checkout's kvlens in the same rounds;
- ``/metrics`` render time at about 2,000 and 20,000 series vs prometheus_client rendering
  the same number of series from its own Counter/Histogram objects;
- RSS after 1M and after 10M records;
- ``--tenants``: the same records with a tenant, and with prefix_hashes (checked and dropped, or
  through the tenants' block storers), against the records without.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import socket
import statistics
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import orjson
import psutil
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from kvlens.config import load_settings
from kvlens.exporter.aggregator import Aggregator
from kvlens.exporter.collector import KVLensCollector
from kvlens.records import Record, batch_from_objects
from kvlens.simulate.demo import DemoTraffic
from kvlens.sources import push, vllm_plugin
from kvlens.sources.vllm_plugin import records_from_rows

ROOT = Path(__file__).resolve().parent.parent
BATCH = 1000


PLUGIN_HEADERS = {"content-type": "application/json", vllm_plugin.SOURCE_HEADER: vllm_plugin.SOURCE}
PLUGIN_FIELDS = (
    "request_id",
    "prompt_tokens",
    "cached_tokens",
    "output_tokens",
    "queue_seconds",
    "prefill_seconds",
    "decode_seconds",
    "e2e_seconds",
    "finish_reason",
)


def plugin_payload(bodies: list[bytes], seed: int = 1) -> list[bytes]:
    """The same requests as the vLLM plugin sends them (sources/vllm_plugin.py): a JSON array of
    its fields (vLLM's own, a request id like vLLM's, durations at full float precision, TTFT =
    queue + prefill, the model and the replica), no arrival_time, block_size or prefix_hashes."""
    rng = random.Random(seed)
    out = []
    for body in bodies:
        rows = []
        for line in body.splitlines():
            demo = orjson.loads(line)
            demo["request_id"] = f"cmpl-{rng.getrandbits(128):032x}-0"
            values = tuple(
                value * (1 + rng.random() * 1e-6) if name.endswith("_seconds") and value else value
                for name in PLUGIN_FIELDS
                for value in (demo.get(name),)
            )  # in the order of the plugin's attributes
            rows.append((demo.get("model"), "node-3:0", values))
        out.append(b"[" + b",".join(vllm_plugin.encode_records(records_from_rows(rows))[0]) + b"]")
    return out


def payload(batches: int, seed: int = 1) -> list[bytes]:
    traffic = DemoTraffic(rate_per_second=BATCH * 1.2, seed=seed)
    out = []
    for i in range(batches):
        records = traffic.records(float(i), float(i + 1))[:BATCH]
        out.append(b"\n".join(orjson.dumps(r) for r in records) + b"\n")
    return out


def interleaved_rates(runs: dict[str, Callable[[], int]], repeats: int) -> dict[str, list[float]]:
    """Records per second of each run, the runs taking turns in every repeat so that they share
    the machine's state (these machines are noisy); compare per-repeat ratios, not rates."""
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            records = run()
            rates[name].append(records / (time.perf_counter() - start))
    return rates


def median_ratio(numerator: list[float], denominator: list[float]) -> float:
    return statistics.median(a / b for a, b in zip(numerator, denominator, strict=True))


# ---- the naive implementation: what one writes first ------------------------------------------

NAIVE_APP = textwrap.dedent(
    """
    import orjson
    from fastapi import FastAPI, Request, Response
    from prometheus_client import CollectorRegistry, generate_latest
    from bench.ingest import NaiveExporter

    exporter = NaiveExporter()
    app = FastAPI()

    @app.post("/v1/records")
    async def ingest(request: Request) -> Response:
        accepted = exporter.ingest(await request.body())
        return Response(orjson.dumps({"accepted": accepted}), media_type="application/json")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(exporter.registry), media_type="text/plain")
    """
)

LATENCY_BUCKETS = load_settings().latency_buckets_seconds


class NaiveExporter:
    """Per record: orjson, pydantic validation, then prometheus_client per metric."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = ("model", "prompt_len", "cache")
        self.counters = [
            Counter(name, name, labels, registry=self.registry)
            for name in ("requests", "prompt_tokens", "cached_tokens", "prompt_work", "reused_work")
        ]
        self.histograms = [
            Histogram(name, name, labels, buckets=LATENCY_BUCKETS, registry=self.registry)
            for name in ("queue_seconds", "prefill_seconds", "ttft_seconds", "e2e_seconds")
        ]

    def ingest(self, body: bytes) -> int:
        accepted = 0
        for item in orjson.loads(body) if body[:1] == b"[" else body.splitlines():
            try:
                record = Record.model_validate(item if isinstance(item, dict) else orjson.loads(item))
            except Exception:
                continue
            n, h = record.prompt_tokens, record.cached_tokens
            length = "0-511" if n < 512 else "512-2047" if n < 2048 else "2048-8191" if n < 8192 else "8192+"
            labels = (record.model or "unknown", length, "hit" if h else "miss")
            work = (n + n * (n + 1) / 2048, h + h * (h + 1) / 2048)
            for counter, value in zip(self.counters, (1, n, h, *work), strict=True):
                counter.labels(*labels).inc(value)
            for histogram, seconds in zip(
                self.histograms,
                (record.queue_seconds, record.prefill_seconds, record.ttft_seconds, record.e2e_seconds),
                strict=True,
            ):
                if seconds is not None:
                    histogram.labels(*labels).observe(seconds)
            accepted += 1
        return accepted


# ---- figures -----------------------------------------------------------------------------------


def in_process(bodies: list[bytes], repeats: int) -> None:
    records = sum(body.count(b"\n") for body in bodies)

    def parse_only() -> int:
        for body in bodies:
            for line in body.splitlines():
                orjson.loads(line)
        return records

    def kvlens_ingest() -> int:
        aggregator = Aggregator(load_settings())
        for body in bodies:
            aggregator.add(push.read_records(body, 100_000), "push")
        return records

    def naive() -> int:
        exporter = NaiveExporter()
        return sum(exporter.ingest(body) for body in bodies)

    rates = interleaved_rates({"parse": parse_only, "kvlens": kvlens_ingest, "naive": naive}, repeats)
    ours = statistics.median(rates["kvlens"])
    print(f"in-process ingest      {ours:>12,.0f} records/s (median of {repeats})")
    print(
        f"  raw orjson parse     {statistics.median(rates['parse']):>12,.0f} records/s   "
        f"kvlens = {median_ratio(rates['kvlens'], rates['parse']):.0%} of it (target >= 35 %)"
    )
    print(
        f"  naive per-record     {statistics.median(rates['naive']):>12,.0f} records/s   "
        f"kvlens = {median_ratio(rates['kvlens'], rates['naive']):.1f}x (target >= 5x)"
    )


def with_tenants(bodies: list[bytes], tenants: int, hashes: bool) -> list[bytes]:
    """The same records, each with one of ``tenants`` tenants and, with ``hashes``, the chained
    ids of its prompt's full 16-token blocks (the first 32 blocks shared by all: a system prompt)."""
    out = []
    for body in bodies:
        records = [orjson.loads(line) for line in body.splitlines()]
        for i, record in enumerate(records):
            record["tenant"] = f"tenant-{i % tenants}"
            if hashes:
                blocks = record["prompt_tokens"] // 16
                record["prefix_hashes"] = [
                    (j if j < 32 else hash((i, j))) & (2**63 - 1) for j in range(blocks)
                ]
        out.append(b"\n".join(orjson.dumps(r) for r in records) + b"\n")
    return out


def tenant_cost(bodies: list[bytes], repeats: int) -> None:
    """The ingest path with records that carry tenants (per-tenant sums), and with prefix_hashes
    through the block storers (tenant_remember_blocks), against the same records without."""
    records = sum(body.count(b"\n") for body in bodies)
    tenanted = with_tenants(bodies, 20, hashes=False)
    hashed = with_tenants(bodies, 20, hashes=True)
    blocks = sum(body.count(b",") for body in hashed)  # about the hashes sent

    def run(payloads: list[bytes], **settings: int) -> Callable[[], int]:
        def ingest() -> int:
            aggregator = Aggregator(load_settings(**settings))
            keep = aggregator.tenants.storers is not None
            for body in payloads:
                validated = push.read_records(body, 100_000, keep_prefix_hashes=keep)
                aggregator.add(validated, "push")
                aggregator.tenants.store(validated.batch, validated.batch.prefix_keys())
            return records

        return ingest

    rates = interleaved_rates(
        {
            "none": run(bodies),
            "tenant": run(tenanted),
            "hashes_dropped": run(hashed),
            "hashes_checked": run(hashed, tenant_remember_blocks=1_000_000),
        },
        repeats,
    )
    print(f"tenants: {records:,} records, about {blocks / records:,.0f} prefix hashes each when hashed")
    for name, title in (
        ("tenant", "with a tenant (per-tenant sums)"),
        ("hashes_dropped", "+ prefix_hashes, check off"),
        ("hashes_checked", "+ prefix_hashes, block storers on"),
    ):
        print(
            f"  {title:<36} {statistics.median(rates[name]):>12,.0f} records/s   "
            f"{median_ratio(rates[name], rates['none']):.0%} of the same records without "
            f"({statistics.median(rates['none']):,.0f} records/s)"
        )


def start_server(
    args: list[str], env: dict[str, str] | None = None, service: Path = ROOT / "service"
) -> tuple[subprocess.Popen[bytes], str]:
    """A server on a free port, importing kvlens from ``service`` (this checkout's by default:
    the venv's editable install may point at another one)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, *args, "--port", str(port)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join((str(service), str(ROOT))), **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(400):
        try:
            httpx.get(f"{url}/metrics", timeout=1)
            return process, url
        except httpx.TransportError:
            time.sleep(0.05)
    process.kill()
    raise RuntimeError(f"server {args} did not start")


def http_rate(url: str, bodies: list[bytes], scrape: bool) -> tuple[float, float]:
    """Records per second over HTTP, and the median scrape time when scraping alongside."""
    stop = threading.Event()
    scrape_times: list[float] = []

    def scraper() -> None:
        with httpx.Client() as client:
            while not stop.wait(0.2):
                start = time.perf_counter()
                client.get(f"{url}/metrics")
                scrape_times.append(time.perf_counter() - start)

    thread = threading.Thread(target=scraper)
    if scrape:
        thread.start()
    records = 0
    with httpx.Client(timeout=60) as client:
        start = time.perf_counter()
        for body in bodies:
            headers = {"content-type": "application/x-ndjson"}
            if body[:1] == b"[":  # as the vLLM plugin sends: a new batch id per batch
                headers = {**PLUGIN_HEADERS, vllm_plugin.BATCH_HEADER: uuid.uuid4().hex}
            answer = client.post(f"{url}/v1/records", content=body, headers=headers)
            records += answer.json()["accepted"] if answer.status_code == 200 else 0
        elapsed = time.perf_counter() - start
    stop.set()
    if scrape:
        thread.join()
    expected = sum(body.count(b"\n") or body.count(b"prompt_tokens") for body in bodies)
    if records != expected:  # a server that refuses fast must not look fast
        raise RuntimeError(f"{url} accepted {records} of {expected} records")
    return records / elapsed, statistics.median(scrape_times) if scrape_times else 0.0


def over_http(bodies: list[bytes], repeats: int, before: Path | None = None) -> None:
    """Each server in turn every round (one client); with ``before``, also kvlens served from
    that checkout's ``service/``. Rates and the servers' CPU seconds per round are medians."""
    naive_module = ROOT / "bench" / "_naive_app.py"
    naive_module.write_text(NAIVE_APP)
    servers = {"kvlens": start_server(["-m", "kvlens.cli", "serve"])}
    if before is not None:
        servers["before"] = start_server(["-m", "kvlens.cli", "serve"], service=before)
    servers["naive"] = start_server(
        ["-m", "uvicorn", "bench._naive_app:app", "--log-level", "warning", "--no-access-log"]
    )
    rates: dict[str, list[float]] = {name: [] for name in servers}
    cpu: dict[str, list[float]] = {name: [] for name in servers}
    try:
        for _ in range(repeats):  # taking turns, as in interleaved_rates
            for name, (process, url) in servers.items():
                server = psutil.Process(process.pid)
                start = server.cpu_times()
                rates[name].append(http_rate(url, bodies, False)[0])
                end = server.cpu_times()
                cpu[name].append(end.user + end.system - start.user - start.system)
        scraped, scrape_seconds = http_rate(servers["kvlens"][1], bodies, True)
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.wait()
        naive_module.unlink()
    ours = statistics.median(rates["kvlens"])
    per_100 = 100 / len(bodies)
    shape = "arrays as the vLLM plugin's" if bodies[0][:1] == b"[" else "NDJSON"
    print(
        f"HTTP ingest (1,000-record {shape})  {ours:>10,.0f} records/s (median of {repeats}), "
        f"server CPU {statistics.median(cpu['kvlens']) * per_100:.2f} s per 100 bodies"
    )
    if before is not None:
        print(
            f"  kvlens from {before}  {statistics.median(rates['before']):>10,.0f} records/s   "
            f"now = {median_ratio(rates['kvlens'], rates['before']):.2f}x of it; server CPU "
            f"{statistics.median(cpu['before']) * per_100:.2f} s per 100 bodies"
        )
    naive = statistics.median(rates["naive"])
    lowest, highest = min(rates["kvlens"]) / max(rates["naive"]), max(rates["kvlens"]) / min(rates["naive"])
    print(
        f"  naive served the same way        {naive:>10,.0f} records/s   "
        f"kvlens = {median_ratio(rates['kvlens'], rates['naive']):.2f}x (target >= 5x; spread "
        f"{lowest:.2f}-{highest:.2f}); "
        f"server CPU {statistics.median(cpu['naive']) * per_100:.2f} s per 100 bodies"
    )
    if before is not None:
        print(f"  before = {median_ratio(rates['before'], rates['naive']):.2f}x the naive")
    print(
        f"  with a scrape every 200 ms       {scraped:>10,.0f} records/s   "
        f"= {scraped / ours:.0%} of unscraped; median scrape {scrape_seconds * 1000:.1f} ms"
    )


def render(target_series: int, repeats: int) -> None:
    """Fill enough (model, prompt_len, cache) groups to expose about ``target_series`` samples."""
    settings = load_settings(max_models=500)
    aggregator = Aggregator(settings)
    registry = CollectorRegistry()
    registry.register(KVLensCollector(aggregator))
    models = 0
    while generate_latest(registry).count(b"\n") - generate_latest(registry).count(b"\n# ") < target_series:
        records = [
            {"model": f"model-{models}", "prompt_tokens": n, "cached_tokens": h, "queue_seconds": 0.01,
             "prefill_seconds": 0.02, "ttft_seconds": 0.04, "e2e_seconds": 1.0}
            for n in (100, 1000, 4000, 10000, 40000) for h in (0, 64)
        ]  # fmt: skip
        aggregator.add(batch_from_objects(records), "push")
        models += 1
    text = generate_latest(registry)
    series = text.count(b"\n") - text.count(b"# ")

    baseline = CollectorRegistry()
    counter = Counter("baseline", "baseline", ("model", "i"), registry=baseline)
    histogram = Histogram("baseline_seconds", "b", ("model", "i"), buckets=LATENCY_BUCKETS, registry=baseline)
    per_label_set = 1 + len(LATENCY_BUCKETS) + 3  # a counter and a histogram (buckets, +Inf, sum, count)
    for i in range(series // per_label_set):
        counter.labels("m", str(i)).inc()
        histogram.labels("m", str(i)).observe(0.1)
    baseline_series = generate_latest(baseline).count(b"\n") - generate_latest(baseline).count(b"# ")

    def timed(reg: CollectorRegistry) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            generate_latest(reg)
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1000

    ours, theirs = timed(registry), timed(baseline)
    print(
        f"/metrics render, {series:>6,} series   {ours:7.1f} ms   "
        f"prometheus_client native, {baseline_series:,} series: {theirs:.1f} ms"
    )


def rss(records_total: int) -> None:
    process = psutil.Process()
    aggregator = Aggregator(load_settings())
    traffic = DemoTraffic(rate_per_second=BATCH * 1.2, seed=3)
    objects = [traffic.records(float(i), float(i + 1))[:BATCH] for i in range(50)]
    done = 0
    after_first_million = None
    while done < records_total:
        for batch in objects:
            aggregator.add(batch_from_objects(batch), "push")
            done += len(batch)
            if after_first_million is None and done >= 1_000_000:
                gc.collect()
                after_first_million = process.memory_info().rss
            if done >= records_total:
                break
    gc.collect()
    first, last = after_first_million or 0, process.memory_info().rss
    print(
        f"RSS after 1M records {first / 2**20:7.1f} MiB, after {done / 1e6:.0f}M "
        f"{last / 2**20:7.1f} MiB: {(last - first) / 2**20:+.1f} MiB (target within 10 MiB)"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="smaller runs (a smoke test, not figures)")
    parser.add_argument("--tenants", action="store_true", help="only the cost of tenants on the ingest path")
    parser.add_argument("--http", action="store_true", help="only HTTP ingest against the naive sidecar")
    parser.add_argument("--rounds", type=int, help="HTTP rounds (default 5, 3 with --quick)")
    parser.add_argument("--plugin", action="store_true", help="HTTP: the vLLM plugin's bodies (arrays)")
    parser.add_argument("--before", type=Path, metavar="DIR", help="HTTP: also kvlens from this service/ dir")
    args = parser.parse_args()
    repeats = 3 if args.quick else 7
    bodies = payload(20 if args.quick else 100)
    size = sum(map(len, bodies)) / len(bodies)
    print(f"payload: {len(bodies)} NDJSON batches of {BATCH} records, {size:,.0f} bytes each")
    if args.tenants:
        tenant_cost(bodies, repeats)
        return
    http_rounds = args.rounds or (3 if args.quick else 5)
    http_bodies = plugin_payload(bodies) if args.plugin else bodies
    if args.plugin:
        print(f"HTTP: the plugin's arrays, {sum(map(len, http_bodies)) / len(http_bodies):,.0f} bytes each")
    if args.http:
        over_http(http_bodies[:20] if args.quick else http_bodies, http_rounds, args.before)
        return
    in_process(bodies, repeats)
    over_http(http_bodies[:20] if args.quick else http_bodies, http_rounds, args.before)
    for target in (2_000, 20_000):
        render(target, repeats)
    rss(2_000_000 if args.quick else 10_000_000)


if __name__ == "__main__":
    main()
