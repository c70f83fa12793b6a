"""``kvlens replay``'s client against an endpoint that streams instantly, beside a naive client in
the same run.

    .venv/bin/python bench/replay.py [--rates 50,200,500] [--seconds 5] [--repeats 3] [--sweep]

The endpoint is the minimal FastAPI SSE server of ``bench/simulate_serve.py`` (no model: one
chunk per output token as fast as it can, then ``[DONE]``), in its own process pinned to core 1;
this process (both clients, one after the other) is pinned to core 0 with
``os.sched_setaffinity``. At each rate (evenly spaced sends, open loop) each client sends the same
requests (64 token ids, 16 output tokens, the same JSON body) for ``--seconds``:

- **kvlens**: ``experiment.client.replay`` (prompt synthesis ahead of time, schedule, SSE parsing,
  usage, per-request record written and flushed);
- **naive** (the baseline): an asyncio loop that sleeps until each send time, posts the prepared
  body with one ``httpx.AsyncClient`` (pool as large as kvlens's concurrency, keep-alive) and reads
  the stream's lines to ``[DONE]``, noting the first ``data:`` line, nothing else.

Each client run is a forked child process (a fresh heap and event loop, the same core), killed if
it overstays three times its schedule plus 20 s (then its figures are infinite and "answered" 0).
Both time on ``time.perf_counter``: lag = send - scheduled time, TTFT = first chunk - send.
Each rate runs ``--repeats`` times, the clients' order alternating; each figure is the median of
the repeats. Client-added TTFT: kvlens's TTFT percentile minus the naive loop's in the same
repeat (the endpoint and the machine being the same, what differs is the client). ``--sweep``
doubles the rate from 50 until each client's lag p99 passes 5 ms and prints the highest rate each
held. Goals (issue 17): lag p99 under 5 ms and client-added TTFT p99 under 2 ms at 200
requests/s; the kvlens client holds a rate at least the naive loop's. The machine's load average
is printed beside the figures: on a shared machine compare within a run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import math
import multiprocessing
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.live import free_port  # noqa: E402

from kvlens.experiment.client import (  # noqa: E402
    Endpoint,
    Planned,
    Progress,
    RecordWriter,
    completions_body,
    replay,
)
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


MAX_CONCURRENCY = 256


def kvlens_client(
    url: str, plan: list[Planned], prompts: PromptSynthesizer
) -> tuple[list[float], list[float]]:
    endpoint = Endpoint(url, "simulated", max_concurrency=MAX_CONCURRENCY, late_after_seconds=LAG_GOAL)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "records.jsonl"
        with path.open("wb") as out:
            progress = Progress()
            run = replay(plan, prompts, endpoint, "bench", RecordWriter(out), progress)
            with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
                asyncio.run(asyncio.wait_for(run, patience(plan)))
        rows = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    return progress.lags, [r["ttft_seconds"] for r in rows if "ttft_seconds" in r]


async def naive_client(
    url: str, plan: list[Planned], prompts: PromptSynthesizer
) -> tuple[list[float], list[float]]:
    lags: list[float] = []
    ttfts: list[float] = []
    # The same bytes kvlens sends, prepared before the clock starts: the loop does nothing else.
    bodies = [completions_body("simulated", prompts.tokens(p.request), p.output_tokens) for p in plan]
    limits = httpx.Limits(max_connections=MAX_CONCURRENCY, max_keepalive_connections=MAX_CONCURRENCY)
    headers = {"content-type": "application/json"}
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60, headers=headers) as client:

        async def one(body: bytes) -> None:
            sent = time.perf_counter()
            first = None
            try:
                async with client.stream("POST", "/v1/completions", content=body) as response:
                    async for line in response.aiter_lines():
                        if first is None and line.startswith("data:"):
                            first = time.perf_counter() - sent
                        if line == "data: [DONE]":
                            break
            except httpx.HTTPError:
                return  # an error has no TTFT, as in kvlens's records
            if first is not None:
                ttfts.append(first)

        start = time.perf_counter()
        tasks = []
        for p, body in zip(plan, bodies, strict=True):
            delay = start + p.due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            lags.append(max(0.0, time.perf_counter() - start - p.due))
            tasks.append(asyncio.create_task(one(body)))
        # No in-process deadline: cancelling thousands of requests queued in httpcore's pool costs
        # a pool scan each (minutes); the parent kills a run that overstays instead.
        await asyncio.gather(*tasks)
    return lags, ttfts


def patience(plan: list[Planned]) -> float:
    """How long a client may take over a run before its unanswered requests are dropped (a client
    that falls behind on a loaded machine can take minutes to drain; "answered" says so)."""
    return 3 * (plan[-1].due if plan else 0.0) + 20


def isolated(run: Callable[[], tuple[list[float], list[float]]], seconds: float) -> tuple[float, ...] | None:
    """``run`` in a forked child (a fresh heap and loop per run, the same core), its figures back
    through a pipe; None if it has not finished within ``seconds`` (then it is killed)."""
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)

    def child() -> None:
        lags, ttfts = run()
        sender.send((*percentiles(lags), *percentiles(ttfts), len(ttfts)))

    process = context.Process(target=child, daemon=True)
    process.start()
    sender.close()
    figures = receiver.recv() if receiver.poll(seconds) else None
    if figures is None:
        process.kill()
    process.join()
    return figures


def percentiles(values: list[float]) -> tuple[float, float]:
    if not values:
        return float("nan"), float("nan")
    p50, p99 = np.percentile(np.array(values) * 1000, [50, 99])
    return float(p50), float(p99)


CLIENTS = ("kvlens", "naive")


def measure(
    url: str, rate: float, seconds: float, repeats: int, only: str | None = None
) -> dict[str, list[float]]:
    """Per client: the medians over repeats of lag p50, lag p99, TTFT p50, TTFT p99 (ms) and the
    percentage of requests answered; under "added", the medians of the per-repeat client-added
    TTFT p50 and p99."""
    prompts = PromptSynthesizer(16)
    plan = planned(rate, seconds)
    runs = {
        "kvlens": lambda: kvlens_client(url, plan, prompts),
        "naive": lambda: asyncio.run(naive_client(url, plan, prompts)),
    }
    figures: dict[str, list[tuple[float, ...]]] = {name: [] for name in CLIENTS}
    for repeat in range(repeats):
        order = CLIENTS if repeat % 2 == 0 else CLIENTS[::-1]
        for name in order:
            if only is None or name == only:
                got = isolated(runs[name], patience(plan) + 10)
                if got is None:  # overstayed: as if infinitely late, nothing answered
                    figures[name].append((math.inf,) * 4 + (0.0,))
                else:
                    figures[name].append((*got[:4], 100 * got[4] / len(plan)))
    out = {
        name: [float(v) for v in np.median(np.array(rows), axis=0)] for name, rows in figures.items() if rows
    }
    if only is None:
        added = [
            np.array(k[2:4]) - np.array(n[2:4])
            for k, n in zip(figures["kvlens"], figures["naive"], strict=True)
        ]
        out["added"] = [float(v) for v in np.median(np.array(added), axis=0)]
    return out


def sweep(url: str, name: str, seconds: float, repeats: int) -> float:
    """The highest rate, doubling from 50/s, at which ``name``'s send lag p99 stays under 5 ms."""
    held, rate = 0.0, 50.0
    while rate <= 6400:
        lag99 = measure(url, rate, min(seconds, 2000 / rate), repeats, only=name)[name][1]
        if lag99 >= LAG_GOAL * 1000:
            break
        held, rate = rate, rate * 2
    return held


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="50,200,500")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sweep", action="store_true", help="double the rate until lag p99 > 5 ms")
    args = parser.parse_args()
    pinned = hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) >= 2
    if pinned:
        os.sched_setaffinity(0, {0})
    bench = _simulate_serve_bench()
    port = free_port()
    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "_sse_baseline.py").write_text(bench.BASELINE)  # type: ignore[attr-defined]
        command = [sys.executable, "-m", "uvicorn", "--app-dir", folder, "_sse_baseline:app"]
        command += ["--port", str(port), "--log-level", "warning", "--no-access-log"]
        server = bench.start(command, port, None)  # type: ignore[attr-defined]
        if pinned:
            os.sched_setaffinity(server.pid, {1})
        url = f"http://127.0.0.1:{port}"
        try:
            measure(url, 50, 1.0, 1)  # warm up both clients and the server
            print(
                f"{PROMPT_TOKENS}-token prompts, {OUTPUT_TOKENS} output tokens, {args.seconds:g} s per rate, "
                f"medians of {args.repeats} repeats; "
                + ("client on core 0, endpoint on core 1" if pinned else "not pinned")
            )
            headings = "".join(f"{h:>9}" for h in ("lag p50", "lag p99", "TTFT p50", "TTFT p99", "answered"))
            print(f"{'rate':>6} {'client':<7}{headings}  (ms)")
            for rate in [float(r) for r in args.rates.split(",")]:
                figures = measure(url, rate, args.seconds, args.repeats)
                for name in CLIENTS:
                    lag50, lag99, ttft50, ttft99, answered = figures[name]
                    print(
                        f"{rate:>6g} {name:<7} {lag50:8.2f} {lag99:8.2f} {ttft50:9.2f} {ttft99:9.2f}"
                        f" {answered:8.1f}%"
                    )
                added50, added99 = figures["added"]
                print(
                    f"{'':>6} client-added TTFT (kvlens - naive) p50 {added50:+.2f} ms, "
                    f"p99 {added99:+.2f} ms; "
                    f"lag p99 ratio kvlens/naive {figures['kvlens'][1] / figures['naive'][1]:.2f}; "
                    f"load average {os.getloadavg()[0]:.2f}",
                    flush=True,
                )
            if args.sweep:
                held = {name: sweep(url, name, args.seconds, args.repeats) for name in CLIENTS}
                rates_held = ", ".join(f"{name} {rate:g}/s" for name, rate in held.items())
                print(
                    f"highest rate with lag p99 < 5 ms: {rates_held} (load average {os.getloadavg()[0]:.2f})"
                )
        finally:
            server.terminate()
            server.wait(10)
    return 0


if __name__ == "__main__":
    started = time.perf_counter()
    code = main()
    print(f"({time.perf_counter() - started:.0f} s)")
    sys.exit(code)
