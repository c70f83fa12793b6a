"""``kvlens audit isolation`` against an endpoint that answers its model list and then never
answers a probe: the audit gives up after a few failed requests in a row instead of waiting
``--timeout`` for each of its 40, and says inconclusive (never pass)."""

from __future__ import annotations

import json
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvlens.cli import main
from tests.live import in_thread

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


class Silent(BaseHTTPRequestHandler):
    """Serves /v1/models; takes a completion's body and says nothing until the client leaves."""

    def do_GET(self) -> None:
        body = b'{"object": "list", "data": [{"id": "m"}]}'
        self.send_response(200 if self.path == "/v1/models" else 404)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["content-length"]))
        self.connection.settimeout(30)
        self.connection.recv(1)  # until the client closes (or 30 s)

    def log_message(self, *args: object) -> None:
        pass


def test_an_endpoint_that_never_answers_ends_the_audit_early(capsys: pytest.CaptureFixture[str]) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Silent)
    server.daemon_threads = True
    in_thread(server.serve_forever)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    started = time.monotonic()
    try:
        code = main(
            ["audit", "isolation", "--endpoint", url, "--model", "m", "--block-size", "16",
             "--timeout", "0.5", "--rate", "100", "--json"]
        )  # fmt: skip
    finally:
        server.shutdown()
        server.server_close()
    elapsed = time.monotonic() - started
    report = json.loads(capsys.readouterr().out)
    assert (code, report["verdict"]) == (3, "inconclusive")
    # three requests of 0.5 s, not forty (20 s)
    assert elapsed < 5, elapsed
    same = {case["case"]: case for case in report["cases"]}["same_salt"]
    assert same["measured"] == 0
    assert same["note"] == (
        "only 0 of 5 pairs answered (first error: timeout); "
        "the audit stopped after 3 failed requests in a row"
    )


class Impossible(Silent):
    """Answers every completion at once, its usage claiming more cached tokens than the prompt."""

    def do_POST(self) -> None:
        prompt = json.loads(self.rfile.read(int(self.headers["content-length"])))["prompt"]
        usage = {"prompt_tokens": len(prompt), "completion_tokens": 1}
        usage["prompt_tokens_details"] = {"cached_tokens": 10 * len(prompt)}
        chunks = [{"choices": [{"index": 0, "text": "x"}]}, {"choices": [], "usage": usage}]
        body = b"".join(b"data: " + json.dumps(chunk).encode() + b"\n\n" for chunk in chunks)
        body += b"data: [DONE]\n\n"
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_counts_that_cannot_be_are_failed_requests_not_a_leak(capsys: pytest.CaptureFixture[str]) -> None:
    """A usage claiming more cached tokens than the prompt is read by the one usage reader and
    refused (``invalid_usage``), as the replay refuses it: no verdict rests on it."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), Impossible)
    server.daemon_threads = True
    in_thread(server.serve_forever)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        code = main(
            ["audit", "isolation", "--endpoint", url, "--model", "m", "--block-size", "16",
             "--rate", "100", "--json"]
        )  # fmt: skip
    finally:
        server.shutdown()
        server.server_close()
    report = json.loads(capsys.readouterr().out)
    assert (code, report["verdict"]) == (3, "inconclusive")
    different = {case["case"]: case for case in report["cases"]}["different_salt"]
    assert different["note"].startswith("only 0 of 5 pairs answered")
