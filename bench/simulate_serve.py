"""``kvlens simulate serve`` under streaming load, beside a minimal SSE endpoint in the same run.

    .venv/bin/python bench/simulate_serve.py [--rates 100,200,500,1000,2000] [--seconds 5]

Both servers run as their own process (pinned to one core with ``taskset`` when it exists): the
simulated fleet (``--speed 1000``: a 64-token prefill takes microseconds, 64 decode steps about
0.4 ms, so the model is not the limit) and the baseline, a FastAPI/uvicorn endpoint that streams
64 SSE chunks of the same size and nothing else. The load generator (this process) sends
streaming completions of 64 output tokens on keep-alive connections, open loop at each rate
(evenly spaced), then closed loop (64 clients back to back) for the most each server serves.

Figures: requests/s served; TTFT p50/p99 (request sent to first ``data:`` received); for the
simulated server, server-added TTFT = TTFT minus the modelled TTFT (the prefill of the prompt at
``--speed``; nothing queues at these rates). Goals (issue 16): 1,000 requests/s or more on one
core, at least half the baseline's rate, server-added TTFT p99 under 5 ms at 200 requests/s.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from kvlens.simulate.replica import DEFAULT_SERVICE

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.live import free_port  # noqa: E402

OUTPUT_TOKENS = 64
PROMPT_TOKENS = 64
SPEED = 1000.0
MAX_CONNECTIONS = 256

BASELINE = textwrap.dedent(
    """
    import time, uuid, orjson
    from fastapi import FastAPI, Request
    from fastapi.responses import StreamingResponse

    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        head = {"id": "cmpl-" + uuid.uuid4().hex, "object": "text_completion",
                "created": int(time.time()), "model": "simulated"}

        async def chunks():
            for _ in range(body.get("max_tokens", 16)):
                choice = {"index": 0, "text": "x", "logprobs": None, "finish_reason": None,
                          "stop_reason": None}
                yield b"data: " + orjson.dumps({**head, "choices": [choice]}) + b"\\n\\n"
            yield b"data: [DONE]\\n\\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    @app.get("/health")
    async def health():
        return {}
    """
)


@dataclass
class Result:
    sent: int = 0
    done: int = 0
    errors: int = 0
    ttft: list[float] = field(default_factory=list)
    seconds: float = 0.0
    cpu_seconds: float = 0.0  # the server's user + system CPU time over the run


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process (Linux): robust on a shared machine, where wall-clock rates
    depend on what else runs; requests per CPU-second is what one core would serve."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measured(pid: int, run: Callable[[], Coroutine[Any, Any, Result]]) -> Result:
    before = cpu_seconds(pid)
    result = asyncio.run(run())
    result.cpu_seconds = cpu_seconds(pid) - before
    return result


class Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer


async def request(connection: Connection, port: int, body: bytes) -> float:
    """One streaming completion on a kept-alive connection: seconds to the first token."""
    head = (
        f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode()
    started = time.perf_counter()
    connection.writer.write(head + body)
    reader = connection.reader
    await reader.readuntil(b"\r\n\r\n")  # status line and headers (chunked)
    first = None
    buffer = b""
    while True:
        size_line = await reader.readuntil(b"\r\n")
        size = int(size_line.strip(), 16)
        if size == 0:
            await reader.readexactly(2)
            break
        data = await reader.readexactly(size + 2)
        if first is None and b"data: " in data:
            first = time.perf_counter() - started
        buffer = (buffer + data)[-64:]
    if first is None or b"[DONE]" not in buffer:
        raise RuntimeError("the stream did not end with [DONE]")
    return first


def body(index: int) -> bytes:
    # Distinct token prompts: nothing cached, so the modelled TTFT is the whole prefill.
    prompt = [259 + (index * 7 + i) % 30_000 for i in range(PROMPT_TOKENS)]
    return orjson.dumps(
        {
            "model": "simulated",
            "prompt": prompt,
            "max_tokens": OUTPUT_TOKENS,
            "stream": True,
            "ignore_eos": True,
        }
    )


async def open_loop(port: int, rate: float, seconds: float) -> Result:
    result = Result()
    idle: list[Connection] = []

    # At most MAX_CONNECTIONS requests in flight: past what a server serves, the rest wait here
    # (their TTFT counts the wait) instead of opening thousands of sockets.
    room = asyncio.Semaphore(MAX_CONNECTIONS)

    async def one(index: int) -> None:
        sent = time.perf_counter()
        async with room:
            connection = idle.pop() if idle else Connection(*await asyncio.open_connection("127.0.0.1", port))
            try:
                waited = time.perf_counter() - sent
                result.ttft.append(waited + await request(connection, port, body(index)))
                result.done += 1
                idle.append(connection)
            except (OSError, RuntimeError, asyncio.IncompleteReadError, ValueError):
                result.errors += 1
                connection.writer.close()

    tasks = []
    count = int(rate * seconds)
    start = time.perf_counter()
    for index in range(count):
        delay = start + index / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(index)))
        result.sent += 1
    await asyncio.gather(*tasks)
    result.seconds = time.perf_counter() - start
    for connection in idle:
        connection.writer.close()
    return result


async def closed_loop(port: int, clients: int, seconds: float) -> Result:
    result = Result()
    deadline = time.perf_counter() + seconds

    async def client(number: int) -> None:
        connection = Connection(*await asyncio.open_connection("127.0.0.1", port))
        index = number * 1_000_000
        while time.perf_counter() < deadline:
            try:
                result.ttft.append(await request(connection, port, body(index)))
                result.done += 1
            except (OSError, RuntimeError, asyncio.IncompleteReadError, ValueError):
                result.errors += 1
                connection = Connection(*await asyncio.open_connection("127.0.0.1", port))
            index += 1
        connection.writer.close()

    start = time.perf_counter()
    await asyncio.gather(*(client(n) for n in range(clients)))
    result.seconds = time.perf_counter() - start
    return result


def start(command: list[str], port: int, core: int | None) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if core is not None and shutil.which("taskset"):  # pin the server itself, not a wrapper
        subprocess.run(["taskset", "-p", "-c", str(core), str(process.pid)], check=True, capture_output=True)
    import httpx

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"{command} did not start")


def line(name: str, result: Result, modelled: float) -> str:
    ttft = np.array(result.ttft) * 1000
    served = result.done / result.seconds if result.seconds else 0.0
    per_cpu = result.done / result.cpu_seconds if result.cpu_seconds else 0.0
    text = f"{name:<44} {served:6.0f} req/s {per_cpu:6.0f} req/CPU-s  errors {result.errors:3d}"
    if len(ttft):
        p50, p99 = np.percentile(ttft, [50, 99])
        text += f"  TTFT p50 {p50:6.2f} ms p99 {p99:7.2f} ms"
        if modelled:
            added = ttft - modelled * 1000
            a50, a99 = np.percentile(added, [50, 99])
            text += f"  server-added p50 {a50:6.2f} ms p99 {a99:7.2f} ms"
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="100,200,500,1000,2000")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--core", type=int, default=1, help="pin each server to this core (-1: do not)")
    args = parser.parse_args()
    core = None if args.core < 0 else args.core
    rates = [float(r) for r in args.rates.split(",")]
    modelled = DEFAULT_SERVICE.prefill.remaining_work_of(PROMPT_TOKENS, 0) / SPEED

    sim_port, base_port = free_port(), free_port()
    scratch = tempfile.mkdtemp(prefix="kvlens-bench-")
    baseline_file = os.path.join(scratch, "_sse_baseline.py")
    with open(baseline_file, "w") as out:
        out.write(BASELINE)
    simulated = [sys.executable, "-m", "kvlens.cli", "simulate", "serve", "--speed", str(SPEED)]
    baseline = [sys.executable, "-m", "uvicorn", "--app-dir", os.path.dirname(baseline_file)]
    servers = {
        "kvlens simulate serve": (
            [*simulated, "--port", str(sim_port), "--capacity-blocks", "100000"],
            sim_port,
            modelled,
        ),
        "minimal FastAPI SSE (baseline)": (
            [
                *baseline,
                "_sse_baseline:app",
                "--port",
                str(base_port),
                "--log-level",
                "warning",
                "--no-access-log",
            ],
            base_port,
            0.0,
        ),
    }
    print(f"streaming completions: {PROMPT_TOKENS} prompt, {OUTPUT_TOKENS} output tokens; --speed {SPEED:g}")
    try:
        for name, (command, port, model_ttft) in servers.items():
            process = start(command, port, core)
            try:
                asyncio.run(closed_loop(port, 8, 1.0))  # warm up
                for rate in rates:
                    result = measured(process.pid, lambda r=rate, p=port: open_loop(p, r, args.seconds))
                    print(line(f"{name} @ {rate:g}/s", result, model_ttft), flush=True)
                result = measured(process.pid, lambda p=port: closed_loop(p, args.clients, args.seconds))
                print(line(f"{name} closed loop x{args.clients}", result, model_ttft), flush=True)
            finally:
                process.terminate()
                process.wait(10)
    finally:
        shutil.rmtree(scratch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
