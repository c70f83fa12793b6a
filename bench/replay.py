"""``kvlens replay``'s client against an endpoint that streams instantly, beside a naive client in
the same run.

    .venv/bin/python bench/replay.py [--rates 50,200,500] [--seconds 5] [--sweep]

The endpoint is the minimal FastAPI SSE server of ``bench/simulate_serve.py`` (no model: 16
chunks as fast as it can), in its own process pinned to core 1; both clients run here, pinned to
core 0. At each rate (evenly spaced sends, open loop) each client sends the same token-id
prompts (64 tokens, 16 output tokens) for ``--seconds``:

- **kvlens**: ``experiment.client.replay`` (prompt synthesis, schedule, SSE parsing, usage,
  per-request record written and flushed);
- **naive** (the baseline): an asyncio loop that sleeps until each send time, posts with httpx and
  reads the stream to ``[DONE]``, noting the first ``data:`` line, nothing else.

Figures: send lag behind schedule p50/p99 and TTFT p50/p99 for each, and client-added TTFT (the
kvlens client's TTFT percentile minus the naive client's). ``--sweep`` doubles the rate from 50
until each client's lag p99 passes 5 ms and prints the highest rate each held. Goals (issue 17):
lag p99 under 5 ms and client-added TTFT p99 under 2 ms at 200 requests/s; the kvlens client holds
a rate at least the naive loop's.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.live import free_port  # noqa: E402

from kvlens.experiment.client import Endpoint, Planned, Progress, RecordWriter, replay  # noqa: E402
from kvlens.experiment.prompts import PromptSynthesizer  # noqa: E402
from kvlens.simulate.trace import TraceRequest  # noqa: E402

PROMPT_TOKENS, OUTPUT_TOKENS, LAG_GOAL = 64, 16, 0.005


def _simulate_serve_bench() -> object:
    spec = importlib.util.spec_from_file_location(
        "simulate_serve_bench", ROOT / "bench" / "simulate_serve.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look themselves up there
    spec.loader.exec_module(module)
    return module


def planned(rate: float, seconds: float) -> list[Planned]:
    count = max(1, int(rate * seconds))
    return [
        Planned(TraceRequest(i, i / rate, PROMPT_TOKENS, OUTPUT_TOKENS, (i % 4,)), i / rate, OUTPUT_TOKENS)
        for i in range(count)
    ]


def kvlens_client(
    url: str, plan: list[Planned], prompts: PromptSynthesizer
) -> tuple[list[float], list[float]]:
    endpoint = Endpoint(url, "simulated", max_concurrency=4096, late_after_seconds=LAG_GOAL)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "records.jsonl"
        with path.open("wb") as out:
            progress = asyncio.run(replay(plan, prompts, endpoint, "bench", RecordWriter(out), Progress()))
        rows = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    return progress.lags, [r["ttft_seconds"] for r in rows if "ttft_seconds" in r]


async def naive_client(
    url: str, plan: list[Planned], prompts: PromptSynthesizer
) -> tuple[list[float], list[float]]:
    lags: list[float] = []
    ttfts: list[float] = []
    bodies = [
        orjson.dumps(
            {
                "model": "simulated",
                "prompt": prompts.prompt(p.request),
                "max_tokens": OUTPUT_TOKENS,
                "stream": True,
            }
        )
        for p in plan
    ]
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=4096)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as client:
        loop = asyncio.get_running_loop()

        async def one(body: bytes) -> None:
            sent = loop.time()
            first = None
            async with client.stream("POST", "/v1/completions", content=body) as response:
                async for line in response.aiter_lines():
                    if first is None and line.startswith("data:"):
                        first = loop.time() - sent
                    if line == "data: [DONE]":
                        break
            if first is not None:
                ttfts.append(first)

        start = loop.time()
        tasks = []
        for p, body in zip(plan, bodies, strict=True):
            delay = start + p.due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            lags.append(max(0.0, loop.time() - start - p.due))
            tasks.append(asyncio.create_task(one(body)))
        await asyncio.gather(*tasks)
    return lags, ttfts


def percentiles(values: list[float]) -> tuple[float, float]:
    if not values:
        return float("nan"), float("nan")
    p50, p99 = np.percentile(np.array(values) * 1000, [50, 99])
    return float(p50), float(p99)


def measure(
    url: str, rate: float, seconds: float, only: str | None = None
) -> dict[str, tuple[float, float, float, float]]:
    prompts = PromptSynthesizer(16)
    plan = planned(rate, seconds)
    out = {}
    for name, run in (
        ("kvlens", lambda: kvlens_client(url, plan, prompts)),
        ("naive", lambda: asyncio.run(naive_client(url, plan, prompts))),
    ):
        if only is not None and name != only:
            continue
        lags, ttfts = run()
        out[name] = (*percentiles(lags), *percentiles(ttfts))
    return out


def sweep(url: str, name: str, seconds: float) -> float:
    """The highest rate, doubling from 50/s, at which ``name``'s send lag p99 stays under 5 ms."""
    held, rate = 0.0, 50.0
    while rate <= 6400:
        lag99 = measure(url, rate, min(seconds, 2000 / rate), only=name)[name][1]
        if lag99 >= LAG_GOAL * 1000:
            break
        held, rate = rate, rate * 2
    return held


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="50,200,500")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--sweep", action="store_true", help="double the rate until lag p99 > 5 ms")
    args = parser.parse_args()
    if shutil.which("taskset"):
        subprocess.run(["taskset", "-p", "-c", "0", str(os.getpid())], check=True, capture_output=True)
    bench = _simulate_serve_bench()
    port = free_port()
    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "_sse_baseline.py").write_text(bench.BASELINE)  # type: ignore[attr-defined]
        command = [sys.executable, "-m", "uvicorn", "--app-dir", folder, "_sse_baseline:app"]
        command += ["--port", str(port), "--log-level", "warning", "--no-access-log"]
        server = bench.start(command, port, 1 if shutil.which("taskset") else None)  # type: ignore[attr-defined]
        url = f"http://127.0.0.1:{port}"
        try:
            measure(url, 50, 1.0)  # warm up both clients and the server
            print(
                f"{PROMPT_TOKENS}-token prompts, {OUTPUT_TOKENS} output tokens, {args.seconds:g} s per rate"
            )
            headings = "".join(f"{h:>9}" for h in ("lag p50", "lag p99", "TTFT p50", "TTFT p99"))
            print(f"{'rate':>6} {'client':<7}{headings}  (ms)")
            rates = [float(r) for r in args.rates.split(",")]
            for rate in rates:
                figures = measure(url, rate, args.seconds)
                for name, (lag50, lag99, ttft50, ttft99) in figures.items():
                    print(f"{rate:>6g} {name:<7} {lag50:8.2f} {lag99:8.2f} {ttft50:9.2f} {ttft99:9.2f}")
                added50 = figures["kvlens"][2] - figures["naive"][2]
                added99 = figures["kvlens"][3] - figures["naive"][3]
                print(f"{'':>6} client-added TTFT p50 {added50:+.2f} ms, p99 {added99:+.2f} ms", flush=True)
            if args.sweep:
                held = {name: sweep(url, name, args.seconds) for name in ("kvlens", "naive")}
                rates_held = ", ".join(f"{name} {rate:g}/s" for name, rate in held.items())
                print(f"highest rate with lag p99 < 5 ms: {rates_held}")
        finally:
            server.terminate()
            server.wait(10)
    return 0


if __name__ == "__main__":
    started = time.perf_counter()
    code = main()
    print(f"({time.perf_counter() - started:.0f} s)")
    sys.exit(code)
