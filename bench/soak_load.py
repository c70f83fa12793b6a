"""The soak's load: the clients that send kvlens its traffic (push, OTLP, a tailed file, an engine's
/metrics) and the abuse and attacks (bench/soak.py's docstring lists each, its rate and what it
must get back), counted in a :class:`Tally` that the soak's checks read. The checks, the scrapes
that watch the counters and the run itself are in bench/soak.py; the KV events and experiment
attacks, with their own checks, in bench/soak_kv_events.py and bench/soak_experiment.py.
"""

from __future__ import annotations

import contextlib
import gzip
import itertools
import os
import select
import socket
import threading
import time
import uuid
import zlib
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import orjson
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from kvlens.sources.otlp import length_delimited

INGEST_SLOTS = 4  # the default max_concurrent_ingest
SLOW_BODY_EVERY_SECONDS = 30.0
SLOW_BODY_BYTE_SECONDS = 2.0
FIFO_EVERY_SECONDS = 30.0
BOMB_EVERY_SCRAPES = 30  # one bomb every 30 s at the soak's 1 s scrape interval
BOMB_INFLATED_BYTES = 2**30
NESTING_DEPTH = 100_000


class Tally:
    """What the clients did and saw, shared by the worker threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sent = {"push": 0, "otlp": 0, "tail": 0}  # and "fifo-glob" with the fifo attack
        self.server_errors: list[str] = []
        self.scrape_seconds: list[float] = []
        self.health_seconds: list[float] = []
        self.resets = 0
        self.abuse = 0
        self.attacks: Counter[str] = Counter()  # the new attacks, by name

    def add(self, source: str, count: int) -> None:
        with self.lock:
            self.sent[source] = self.sent.get(source, 0) + count

    def attacked(self, name: str) -> None:
        with self.lock:
            self.attacks[name] += 1

    def answered(self, what: str, status: int) -> None:
        if status >= 500:
            with self.lock:
                self.server_errors.append(f"{what}: {status}")


def record(i: int) -> dict[str, object]:
    long = i % 10 == 0
    return {
        "request_id": f"soak-{i}",
        "model": "soak",
        "prompt_tokens": 8192 if long else 128,
        "cached_tokens": 0 if long else 16,
        "queue_seconds": 0.02,
        "prefill_seconds": 0.8 if long else 0.01,
        "ttft_seconds": 0.85 if long else 0.035,
    }


def pusher(url: str, tally: Tally, stop: threading.Event) -> None:
    numbers = itertools.count()
    with httpx.Client(timeout=30) as client:
        for batch_number in itertools.count():
            if stop.wait(0.05):
                return
            body = b"\n".join(orjson.dumps(record(next(numbers))) for _ in range(100))
            headers = {"kvlens-batch-id": uuid.uuid4().hex}
            if batch_number % 3 == 0:
                body, headers["content-encoding"] = gzip.compress(body), "gzip"
            for attempt in range(2 if batch_number % 10 == 0 else 1):  # a retry after a lost answer
                answer = client.post(f"{url}/v1/records", content=body, headers=headers)
                tally.answered("push", answer.status_code)
                if answer.status_code == 200 and attempt == 0:
                    tally.add("push", answer.json()["accepted"])


def otlp_export(count: int) -> bytes:
    request = ExportTraceServiceRequest()
    scope = request.resource_spans.add().scope_spans.add()
    for i in range(count):
        span = scope.spans.add(name="llm_request")
        attributes = {
            "gen_ai.usage.input_tokens": 2048,
            "gen_ai.usage.cached_tokens": 1024 if i % 2 else 0,
            "gen_ai.response.model": "soak",
            "gen_ai.latency.time_to_first_token": 0.08,
        }
        for key, value in attributes.items():
            any_value = AnyValue(int_value=value) if isinstance(value, int) else AnyValue()
            if isinstance(value, float):
                any_value = AnyValue(double_value=value)
            elif isinstance(value, str):
                any_value = AnyValue(string_value=value)
            span.attributes.append(KeyValue(key=key, value=any_value))
    return bytes(request.SerializeToString())


def otlp_sender(url: str, tally: Tally, stop: threading.Event) -> None:
    body = otlp_export(20)
    with httpx.Client(timeout=30) as client:
        while not stop.wait(0.2):
            answer = client.post(
                f"{url}/v1/traces", content=body, headers={"content-type": "application/x-protobuf"}
            )
            tally.answered("otlp", answer.status_code)
            if answer.status_code == 200:
                tally.add("otlp", 20)


def tail_writer(log: Path, tally: Tally, stop: threading.Event) -> None:
    numbers = itertools.count(10**9)
    rotated = time.monotonic()
    while not stop.wait(0.1):
        lines = b"".join(orjson.dumps(record(next(numbers))) + b"\n" for _ in range(50))
        with log.open("ab") as out:
            out.write(lines)
        tally.add("tail", 50)
        if time.monotonic() - rotated > 15:
            log.rename(log.with_name(log.name + f".{int(time.time())}"))
            rotated = time.monotonic()


def abuser(url: str, port: int, tally: Tally, stop: threading.Event, deep_nesting: bool) -> None:
    """One attack every two seconds, in turn; each must be answered 4xx (or the socket closed)."""
    zeros = gzip.compress(b"[" + b"0," * 4_000_000 + b"0]", 9)
    members = gzip.compress(b"") * 100_000
    empty_spans = b"\x0a\x06\x12\x04\x12\x02\x12\x00" * 10  # short, then a span bomb below
    span_bomb = length_delimited(1, length_delimited(2, b"\x12\x00" * 1_000_000))
    attacks: list[Callable[[httpx.Client], int]] = [
        lambda c: (
            c.post(f"{url}/v1/records", content=zeros, headers={"content-encoding": "gzip"}).status_code
        ),
        lambda c: c.post(f"{url}/v1/records", content=b"[" + b"{}," * 200_000 + b"{}]").status_code,
        lambda c: (
            c.post(f"{url}/v1/traces", content=members, headers={"content-encoding": "gzip"}).status_code
        ),
        lambda c: (
            c.post(
                f"{url}/v1/traces", content=span_bomb, headers={"content-type": "application/x-protobuf"}
            ).status_code
        ),
        lambda c: c.post(f"{url}/v1/records", content=b"{}", headers={"content-encoding": "br"}).status_code,
        lambda c: (
            c.post(f"{url}/v1/traces", content=empty_spans, headers={"content-type": "text/csv"}).status_code
        ),
        lambda c: _raw(port, b"POST /v1/records HTTP/1.1\r\nHost: k\r\nkvlens-dropped: \xc2\xb2\r\n"),
        lambda c: _raw(port, b"POST /v1/records HTTP/1.1\r\nHost: k\r\nContent-Length: 100\r\n", body=b"[{"),
    ]
    if deep_nesting:
        attacks.extend(deep_nesting_attacks(url, tally))
    idle: list[socket.socket] = []
    with httpx.Client(timeout=60) as client:
        for attack in itertools.cycle(attacks):
            if stop.wait(2.0):
                break
            tally.answered("abuse", attack(client))
            tally.abuse += 1
            idle = [sock for sock in idle if sock.fileno() >= 0][-200:]
            idle.extend(socket.create_connection(("127.0.0.1", port)) for _ in range(20))
    for sock in idle:
        sock.close()


def deep_nesting_attacks(url: str, tally: Tally) -> list[Callable[[httpx.Client], int]]:
    """A pushed record whose unknown field nests NESTING_DEPTH levels (200 KB), and an OTLP JSON
    export with a span nested as deep. The record is otherwise valid, for a model the soak does
    not count, so that it changes no total even if a decoder were to ignore the field."""
    nested = b"[" * NESTING_DEPTH + b"]" * NESTING_DEPTH
    pushed = orjson.dumps({**record(0), "request_id": "soak-deep", "model": "soak-abuse"})
    pushed = pushed[:-1] + b',"soak_nested":' + nested + b"}"
    spans = b'{"resourceSpans":[{"scopeSpans":[{"spans":[{"name":"llm_request","nested":'
    otlp = spans + nested + b"}]}]}]}"

    # A connection of their own: a server that fails them may close it under the next attack.
    def push(_: httpx.Client) -> int:
        tally.attacked("deep-nesting")
        return httpx.post(f"{url}/v1/records", content=pushed, timeout=60).status_code

    def export(_: httpx.Client) -> int:
        tally.attacked("deep-nesting")
        headers = {"content-type": "application/json"}
        return httpx.post(f"{url}/v1/traces", content=otlp, headers=headers, timeout=60).status_code

    return [push, export]


def slow_bodies(port: int, tally: Tally, stop: threading.Event) -> None:
    """Every SLOW_BODY_EVERY_SECONDS, INGEST_SLOTS bodies at once that arrive one byte at a time:
    enough to hold every ingest slot if a slot is taken before the body arrives."""
    while not stop.wait(SLOW_BODY_EVERY_SECONDS):
        senders = [
            threading.Thread(target=slow_body, args=(port, tally, stop), daemon=True)
            for _ in range(INGEST_SLOTS)
        ]
        for sender in senders:
            sender.start()
        for sender in senders:
            sender.join()


def slow_body(port: int, tally: Tally, stop: threading.Event) -> None:
    """Headers for a 10,000-byte body, then one byte every SLOW_BODY_BYTE_SECONDS until kvlens
    answers or hangs up (the body would take hours to finish, so it never counts)."""
    tally.attacked("slow-body")
    head = b"POST /v1/records HTTP/1.1\r\nHost: k\r\nContent-Length: 10000\r\n\r\n"
    answer = b""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head)
        for _ in range(60):  # gives up after 120 s, far past any deadline of the soak's sidecar
            if select.select([sock], [], [], 0)[0]:
                answer = sock.recv(4096)
                break
            if stop.wait(SLOW_BODY_BYTE_SECONDS):
                return
            try:
                sock.sendall(b" ")
            except OSError:  # hung up without an answer
                return
    if answer:
        tally.answered("slow-body", int(answer.split(b" ", 2)[1]))


def fifo_glob_writer(directory: Path, tally: Tally, stop: threading.Event) -> None:
    """The second tailed glob: 10 lines every 0.5 s to a regular file (counted as sent), and a
    FIFO matching the glob every FIFO_EVERY_SECONDS (the last three are kept)."""
    numbers = itertools.count(2 * 10**9)
    log = directory / "app.log"
    fifos: list[Path] = []
    made = time.monotonic()
    while not stop.wait(0.5):
        lines = b"".join(orjson.dumps(record(next(numbers))) + b"\n" for _ in range(10))
        with log.open("ab") as out:
            out.write(lines)
        tally.add("fifo-glob", 10)
        if time.monotonic() - made > FIFO_EVERY_SECONDS:
            fifos.append(directory / f"pipe-{len(fifos)}-{int(time.time())}.log")
            os.mkfifo(fifos[-1])
            tally.attacked("fifo")
            made = time.monotonic()
            if len(fifos) > 3:
                fifos[-4].unlink()


def gzip_bomb(inflated: int) -> bytes:
    """A gzip member of about inflated/1000 bytes that inflates to ``inflated`` zero bytes: one
    compressed MiB repeated (each ends in a full flush, so none refers back to another)."""
    chunk = bytes(2**20)
    compressor = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    block = compressor.compress(chunk) + compressor.flush(zlib.Z_FULL_FLUSH)
    crc = 0
    for _ in range(inflated // len(chunk)):
        crc = zlib.crc32(chunk, crc)
    end = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS).flush()
    header = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"  # gzip, deflate, no name, no time
    trailer = crc.to_bytes(4, "little") + (inflated % 2**32).to_bytes(4, "little")
    return header + block * (inflated // len(chunk)) + end + trailer


class GzipUpstream:
    """A scrape target that answers gzip (as vLLM does when asked, and httpx always asks); one
    answer in BOMB_EVERY_SCRAPES is a bomb of BOMB_INFLATED_BYTES."""

    def __init__(self, tally: Tally) -> None:
        bomb = gzip_bomb(BOMB_INFLATED_BYTES)
        small = gzip.compress(
            b"# TYPE vllm:prompt_tokens_total counter\n"
            b'vllm:prompt_tokens_total{model_name="soak-upstream"} 1\n'
        )
        scrapes = itertools.count(1)

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = bomb if next(scrapes) % BOMB_EVERY_SCRAPES == 0 else small
                if body is bomb:
                    tally.attacked("gzip-upstream")
                self.send_response(200)
                self.send_header("content-type", "text/plain; version=0.0.4")
                self.send_header("content-encoding", "gzip")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                with contextlib.suppress(OSError):  # kvlens hung up once it had read enough
                    self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _raw(port: int, head: bytes, body: bytes = b"[]") -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        length = b"" if b"Content-Length" in head else f"Content-Length: {len(body)}\r\n".encode()
        sock.sendall(head + length + b"\r\n" + body)
        answer = sock.recv(4096)
    return int(answer.split(b" ", 2)[1]) if answer else 400


def engine_exposition(started: float) -> Callable[[int], str | None]:
    """A vLLM /metrics that restarts every 20 s: its counter falls to 0 and it is down for 2 s."""

    def exposition(scrape: int) -> str | None:
        age = (time.monotonic() - started) % 20
        if age < 2:
            return None
        return (
            "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.\n"
            "# TYPE vllm:prompt_tokens_total counter\n"
            f'vllm:prompt_tokens_total{{model_name="soak"}} {int(age * 1000)}\n'
        )

    return exposition
