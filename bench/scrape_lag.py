"""Event-loop lag while /metrics renders about 20,000 series, with 1 and with 4 concurrent scrapers.

    .venv/bin/python bench/scrape_lag.py [--series 20000] [--seconds 10]

The loop's own measure is ``kvlens_event_loop_lag_seconds`` (how late a task sleeping 100 ms
wakes); the client's is the latency of ``/healthz`` probed 20 times a second from another
process. The baseline is the same two measures on the same sidecar with no scraper.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.live import Running, start_kvlens  # noqa: E402

LENGTHS = (100, 1000, 4000, 10000, 40000)  # one per prompt_len bucket


def fill(sidecar: Running, series: int) -> int:
    """Push records until the page holds about ``series`` series; returns the count."""
    model = 0
    while True:
        records = [
            {"model": f"model-{model}", "prompt_tokens": n, "cached_tokens": h, "queue_seconds": 0.01,
             "prefill_seconds": 0.02, "ttft_seconds": 0.04, "e2e_seconds": 0.5}
            for n in LENGTHS
            for h in (0, 16)
        ]  # fmt: skip
        httpx.post(f"{sidecar.url}/v1/records", content=orjson.dumps(records))
        model += 1
        if model % 5 == 0:
            found = httpx.get(f"{sidecar.url}/metrics").text.count("\n")
            if found >= series:
                return found


def lag_buckets(sidecar: Running) -> dict[float, float]:
    return {
        float(dict(labels)["le"]): value
        for (name, labels), value in sidecar.samples().items()
        if name == "kvlens_event_loop_lag_seconds_bucket"
    }


def measure(sidecar: Running, scrapers: int, seconds: float) -> tuple[float, float, float, float, int]:
    """(loop lag p99 bound, loop lag max bound, /healthz p99, /healthz max, scrapes done)."""
    stop = threading.Event()
    done = [0]
    health: list[float] = []

    def scrape() -> None:
        with httpx.Client(timeout=60) as client:
            while not stop.is_set():
                client.get(f"{sidecar.url}/metrics")
                done[0] += 1

    def probe() -> None:
        with httpx.Client(timeout=60) as client:
            while not stop.wait(0.05):
                started = time.perf_counter()
                client.get(f"{sidecar.url}/healthz")
                health.append(time.perf_counter() - started)

    before = lag_buckets(sidecar)
    threads = [threading.Thread(target=scrape) for _ in range(scrapers)] + [threading.Thread(target=probe)]
    for thread in threads:
        thread.start()
    time.sleep(seconds)  # the measuring window
    stop.set()
    for thread in threads:
        thread.join()
    after = lag_buckets(sidecar)
    delta = sorted((bound, after[bound] - before.get(bound, 0.0)) for bound in after)
    total = delta[-1][1]
    p99 = next(bound for bound, count in delta if count >= 0.99 * total)
    worst = next(bound for bound, count in delta if count >= total)
    health.sort()
    return p99, worst, health[int(0.99 * len(health))], health[-1], done[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--series", type=int, default=20_000)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    sidecar = start_kvlens("serve", env={"KVLENS_MAX_MODELS": "1000"})
    try:
        lines = fill(sidecar, args.series)
        render = []
        for _ in range(5):
            started = time.perf_counter()
            httpx.get(f"{sidecar.url}/metrics", timeout=60)
            render.append(time.perf_counter() - started)
        print(
            f"/metrics: {lines:,} lines, one scrape {statistics.median(render) * 1000:.0f} ms (median of 5)"
        )
        columns = ("scrapers", "scrapes", "loop lag p99", "loop lag max", "healthz p99", "healthz max")
        print(
            " ".join(f"{name:>{width}}" for name, width in zip(columns, (8, 8, 13, 13, 12, 12), strict=True))
        )
        for scrapers in (0, 1, 4):
            p99, worst, health_p99, health_max, done = measure(sidecar, scrapers, args.seconds)
            print(
                f"{scrapers:>8} {done:>8} {'<= ' + format(p99 * 1000, '.1f') + ' ms':>13} "
                f"{'<= ' + format(worst * 1000, '.1f') + ' ms':>13} {health_p99 * 1000:>9.1f} ms "
                f"{health_max * 1000:>9.1f} ms"
            )
    finally:
        sidecar.output()


if __name__ == "__main__":
    main()
