"""Defect 6: no client input yields a 5xx, and nothing a client sent is echoed back or logged.

Requirement (reliability.md 5.10, 5.13): client errors never produce a 5xx; 4xx bodies and logs
never echo header or record values; an unsupported OTLP content type gets 415; the redirect of
``/metrics/`` must not reflect the Host header.
"""

from __future__ import annotations

import socket

import orjson
import pytest

from tests.hostile.conftest import Serve

pytestmark = pytest.mark.integration
CANARY = "CANARY-5f1e"


def exchange(port: int, head: bytes, body: bytes = b"") -> tuple[int, bytes]:
    """Send a raw request (any bytes in the head) and return the status and the whole answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return int(answer.split(b" ", 2)[1]), answer


def span(attributes: dict[str, dict[str, object]]) -> bytes:
    values = [{"key": key, "value": value} for key, value in attributes.items()]
    return orjson.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [{"attributes": values}]}]}]})


CASES = {
    "non-ASCII dropped count": (
        b"POST /v1/records HTTP/1.1\r\nHost: k\r\nkvlens-dropped: \xc2\xb2" + CANARY.encode() + b"\r\n",
        orjson.dumps({"prompt_tokens": 1, "cached_tokens": 0}),
    ),
    "unknown Content-Encoding": (
        b"POST /v1/records HTTP/1.1\r\nHost: k\r\nContent-Encoding: " + CANARY.encode() + b"\r\n",
        b"{}",
    ),
    "OTLP intValue superscript": (
        b"POST /v1/traces HTTP/1.1\r\nHost: k\r\nContent-Type: application/json\r\n",
        span({"gen_ai.usage.input_tokens": {"intValue": "\u00b2"}, CANARY: {"intValue": "\u00b3"}}),
    ),
    "OTLP intValue of 5000 digits": (
        b"POST /v1/traces HTTP/1.1\r\nHost: k\r\nContent-Type: application/json\r\n",
        span(
            {
                "gen_ai.usage.input_tokens": {"intValue": "9" * 5000},
                "gen_ai.usage.cached_tokens": {"intValue": "1"},
            }
        ),
    ),
    "OTLP unknown content type": (
        b"POST /v1/traces HTTP/1.1\r\nHost: k\r\nContent-Type: application/" + CANARY.encode() + b"\r\n",
        b"{}",
    ),
    "OTLP unknown Content-Encoding": (
        b"POST /v1/traces HTTP/1.1\r\nHost: k\r\nContent-Type: application/json\r\nContent-Encoding: "
        + CANARY.encode()
        + b"\r\n",
        b"{}",
    ),
    "wrong types in a record": (
        b"POST /v1/records HTTP/1.1\r\nHost: k\r\n",
        orjson.dumps({"prompt_tokens": CANARY, "cached_tokens": [CANARY], "model": {"x": CANARY}}),
    ),
    "bearer header on an open sidecar": (
        b"POST /v1/records HTTP/1.1\r\nHost: k\r\nAuthorization: Bearer " + CANARY.encode() + b"\xff\r\n",
        b"[]",
    ),
    "header of invalid UTF-8": (
        b"POST /v1/records HTTP/1.1\r\nHost: k\r\nkvlens-batch-id: \xff\xfe" + CANARY.encode() + b"\r\n",
        b"[]",
    ),
    "batch id header too long": (
        b"POST /v1/records HTTP/1.1\r\nHost: k\r\nkvlens-batch-id: " + b"x" * 8000 + b"\r\n",
        b"[]",
    ),
}


def test_no_client_input_yields_a_5xx_or_comes_back(serve: Serve) -> None:
    sidecar = serve()
    statuses = {}
    for name, (head, body) in CASES.items():
        status, answer = exchange(sidecar.port, head, body)
        statuses[name] = status
        assert status < 500, (name, answer[:300])
        assert CANARY.encode() not in answer, name
    assert statuses["OTLP unknown content type"] == 415
    assert statuses["unknown Content-Encoding"] in (400, 415)
    output = sidecar.output()
    assert CANARY not in output, output


def test_a_trailing_slash_never_redirects_to_the_host_header(serve: Serve) -> None:
    sidecar = serve()
    status, answer = exchange(sidecar.port, b"GET /metrics/ HTTP/1.1\r\nHost: evil.example\r\n")
    assert b"evil.example" not in answer
    assert status in (200, 404)
