"""`kvlens audit isolation` over real HTTP: against `kvlens simulate serve` honouring salts (pass),
with `--leak-salt` (leak), with prefix caching off (inconclusive, never pass), and against a test
double that serves a salted prefix to another salt but hides it from `cached_tokens` (a leak seen
by timing alone)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import pytest

from kvlens.cli import main
from tests.live import Running, in_thread, start_kvlens

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
B = 16
FAST = ("--repeats", "5", "--rate", "200", "--canary-tokens", "512")


def fleet(*flags: str) -> Running:
    # speed 0.5: a 513-token miss takes ~30 ms against ~1 ms for a hit, far above a loaded
    # machine's jitter, so the timing case's verdict does not hang on the host
    return start_kvlens(
        "simulate", "serve", "--block-size", str(B), "--speed", "0.5", *flags, ready="/health"
    )


def audit(url: str, capsys: pytest.CaptureFixture[str], *flags: str) -> tuple[int, dict[str, Any]]:
    code = main(["audit", "isolation", "--endpoint", url, "--model", "simulated", *FAST, *flags, "--json"])
    return code, json.loads(capsys.readouterr().out)


def verdicts(report: dict[str, Any]) -> dict[str, str]:
    return {case["case"]: case["verdict"] for case in report["cases"]}


@pytest.fixture
def honest() -> Iterator[Running]:
    running = fleet("--lora-modules", "sql=/adapters/sql")
    yield running
    running.output()


def test_an_honest_fleet_passes(honest: Running, capsys: pytest.CaptureFixture[str]) -> None:
    code, report = audit(honest.url, capsys, "--lora", "sql")
    assert (code, report["verdict"]) == (0, "pass")
    assert verdicts(report) == {
        "same_salt": "pass",
        "different_salt": "pass",
        "salt_vs_none": "pass",
        "no_salt": "shared",
        "timing": "pass",
        "lora_same": "pass",
        "lora_vs_base": "pass",
    }
    cases = {case["case"]: case for case in report["cases"]}
    # the block size read from the endpoint's /metrics; 512 tokens are 32 blocks, plus one token
    assert (report["block_size"], report["block_size_from"], report["prompt_tokens"]) == (B, "endpoint", 513)
    assert (
        cases["same_salt"]["cached_tokens"] == [512] * 5
        and cases["different_salt"]["cached_tokens"] == [0] * 5
    )
    assert 'cache_salt": "kvlens-audit' not in json.dumps(report)  # the salts are never shown


def test_a_fleet_that_drops_the_salt_leaks(capsys: pytest.CaptureFixture[str]) -> None:
    running = fleet("--leak-salt")
    try:
        code, report = audit(running.url, capsys)
        assert (code, report["verdict"]) == (1, "leak")
        assert verdicts(report) == {
            "same_salt": "pass",
            "different_salt": "leak",
            "salt_vs_none": "leak",
            "no_salt": "shared",
            "timing": "leak",
        }
        assert main(["audit", "isolation", "--endpoint", running.url, "--model", "simulated", *FAST]) == 1
        table = capsys.readouterr().out
        assert "different_salt  leak     5/5   512" in table and table.endswith("verdict: leak\n")
    finally:
        running.output()


def test_prefix_caching_off_is_inconclusive_never_pass(capsys: pytest.CaptureFixture[str]) -> None:
    running = fleet("--no-prefix-caching")
    try:
        code, report = audit(running.url, capsys)
        assert (code, report["verdict"]) == (3, "inconclusive")
        assert verdicts(report) == {
            "same_salt": "inconclusive",
            "different_salt": "inconclusive",  # a miss without its control proves nothing
            "salt_vs_none": "inconclusive",
            "no_salt": "not_shared",
            "timing": "inconclusive",
        }
    finally:
        running.output()


class HiddenHit(BaseHTTPRequestHandler):
    """A server whose cache ignores the salt but whose usage hides a hit across salts: the
    cached tokens it reports are those the request's own salt stored; a hit is fast whatever."""

    protocol_version = "HTTP/1.1"
    stored: ClassVar[dict[tuple[int, ...], str | None]] = {}
    lock = threading.Lock()
    MISS_SECONDS = 0.04

    def setup(self) -> None:
        super().setup()
        # the head and the body go out in two writes: without this, Nagle's algorithm and the
        # client's delayed ACK add 40 ms to every answer, a hit's as a miss's
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._send(200, b'{"object": "list", "data": [{"id": "simulated"}]}', "application/json")
        else:
            self._send(404, b"{}", "application/json")

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        prompt, salt = tuple(body["prompt"]), body.get("cache_salt")
        with self.lock:
            hit = prompt in self.stored
            owner = self.stored.setdefault(prompt, salt)
        if not hit:
            time.sleep(self.MISS_SECONDS)
        cached = (len(prompt) - 1) // B * B if hit and owner == salt else 0
        usage = {"prompt_tokens": len(prompt), "completion_tokens": 1, "total_tokens": len(prompt) + 1}
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
        chunks = [{"choices": [{"index": 0, "text": "x"}]}, {"choices": [], "usage": usage}]
        events = b"".join(b"data: " + json.dumps(chunk).encode() + b"\n\n" for chunk in chunks)
        self._send(200, events + b"data: [DONE]\n\n", "text/event-stream")

    def _send(self, status: int, body: bytes, kind: str) -> None:
        self.send_response(status)
        self.send_header("content-type", kind)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_a_hit_hidden_from_cached_tokens_is_a_leak_by_timing(capsys: pytest.CaptureFixture[str]) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), HiddenHit)
    in_thread(server.serve_forever)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        code = main(
            [
                "audit",
                "isolation",
                "--endpoint",
                url,
                "--model",
                "simulated",
                "--block-size",
                str(B),
                *FAST,
                "--json",
            ]
        )
        report = json.loads(capsys.readouterr().out)
    finally:
        server.shutdown()
        server.server_close()
    assert (code, report["verdict"]) == (1, "leak")
    cases = {case["case"]: case for case in report["cases"]}
    # by its counts alone the double is isolated; by its clock it is not
    assert [cases[name]["verdict"] for name in ("same_salt", "different_salt", "salt_vs_none")] == [
        "pass"
    ] * 3
    assert cases["different_salt"]["cached_tokens"] == [0] * 5
    # all five suspects as fast as a hit: below each of the 15 known misses (p = 1 / C(20, 5))
    assert (cases["timing"]["verdict"], cases["timing"]["hits"]) == ("leak", 5)
    assert cases["timing"]["p_value"] == pytest.approx(1 / 15_504)


def test_the_sidecar_probes_in_the_background_and_exports_the_verdicts() -> None:
    """`kvlens serve --isolation-probe`: an honest and a leaking fleet, each audited in the
    background; /metrics answers meanwhile and carries each case's verdict."""
    honest, leaking = fleet(), fleet("--leak-salt")
    sidecar = None
    try:
        sidecar = start_kvlens(
            "serve",
            "--isolation-probe",
            f"honest={honest.url}#simulated",
            "--isolation-probe",
            f"leaking={leaking.url}",  # the model: the one it serves
            "--isolation-every",
            "1",
        )
        deadline = time.monotonic() + 60
        name = "kvlens_isolation_probe_last_success_timestamp_seconds"
        while time.monotonic() < deadline:
            started = time.monotonic()
            samples = sidecar.samples()
            assert time.monotonic() - started < 5  # a probe in flight never holds /metrics
            if {keys for found, keys in samples if found == name} == {
                frozenset({("target", "honest")}),
                frozenset({("target", "leaking")}),
            }:
                break
            time.sleep(0.2)
        results = {
            (dict(keys)["target"], dict(keys)["case"]): value
            for (found, keys), value in samples.items()
            if found == "kvlens_isolation_probe_result"
        }
        assert results == {
            **{("honest", case): 1.0 for case in ("same_salt", "different_salt", "salt_vs_none", "timing")},
            ("leaking", "same_salt"): 1.0,
            **{("leaking", case): 0.0 for case in ("different_salt", "salt_vs_none", "timing")},
        }
    finally:
        if sidecar is not None:
            sidecar.output()
        honest.output()
        leaking.output()
