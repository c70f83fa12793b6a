"""``kvlens simulate serve`` against sockets that hold a connection and send nothing useful: the
same rules as ``kvlens serve`` (its settings, KVLENS_*): a request head within
``header_timeout_seconds``, at most ``max_connections`` open (the oldest idle one closed), a
body within ``body_timeout_seconds`` and no pause over ``header_timeout_seconds``."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.live import Running, start_kvlens

pytestmark = pytest.mark.integration
COMPLETION = {"model": "simulated", "prompt": "hello", "max_tokens": 2}


@pytest.fixture
def server() -> Iterator[Running]:
    env = {
        "KVLENS_HEADER_TIMEOUT_SECONDS": "1",
        "KVLENS_MAX_CONNECTIONS": "16",
        "KVLENS_BODY_TIMEOUT_SECONDS": "2",
    }
    running = start_kvlens("simulate", "serve", "--speed", "1000", env=env, ready="/health")
    yield running
    running.output()


def closed_by_the_server(sock: socket.socket, timeout: float) -> bool:
    """Whether the server closes ``sock`` within ``timeout`` seconds (it sends nothing first)."""
    sock.settimeout(timeout)
    try:
        return sock.recv(4096) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_idle_sockets_are_closed_past_the_head_timeout_and_the_cap(server: Running) -> None:
    """24 sockets, half silent, half stopped inside their headers, against a cap of 16 and a head
    timeout of 1 s: a completion is answered, and every one of them is closed (the oldest 8 to
    make room, the rest at their head timeout). Before: uvicorn's defaults, no timer before a head
    and no cap: all 24 stayed open for good (each held a file and a socket)."""
    sockets = []
    try:
        for i in range(24):
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            if i % 2:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
            sockets.append(sock)
        answer = httpx.post(f"{server.url}/v1/completions", json=COMPLETION, timeout=10)
        assert answer.status_code == 200
        started = time.monotonic()
        closed = [closed_by_the_server(sock, 10) for sock in sockets]
        assert closed == [True] * 24
        assert time.monotonic() - started < 5  # the 1 s head timeout, not the 10 s waited at most
    finally:
        for sock in sockets:
            sock.close()


def test_a_body_that_stops_is_answered_408(server: Running) -> None:
    """A head that announces 1,000 bytes of body, then 10 bytes and silence: 408 once it has paused
    past the head timeout (1 s). Before: no deadline inside a body; the request waited for good."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"prompt":'
        )
        answer = b""
        try:
            while b"\r\n\r\n" not in answer:
                more = sock.recv(4096)
                if not more:
                    break
                answer += more
        except TimeoutError:
            pass
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert httpx.post(f"{server.url}/v1/completions", json=COMPLETION, timeout=10).status_code == 200


def test_a_body_under_kvlens_serves_pace_is_held_to_the_pause_deadline_only() -> None:
    """simulate serve reads its bodies with kvlens serve's reader but asks no minimum pace (the
    README's limits): a body that sends 10 of its 1,000 bytes and waits is answered 408 at its
    pause deadline (2 s), not at the end of a pace window (0.5 s), with the message it had."""
    env = {
        "KVLENS_HEADER_TIMEOUT_SECONDS": "2",
        "KVLENS_BODY_MIN_BYTES_PER_SECOND": "1000",
        "KVLENS_BODY_RATE_WINDOW_SECONDS": "0.5",
    }
    running = start_kvlens("simulate", "serve", "--speed", "1000", env=env, ready="/health")
    try:
        with socket.create_connection(("127.0.0.1", running.port), timeout=20) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Content-Length: 1000\r\n\r\n{"prompt":'
            )
            started = time.monotonic()
            answer = b""
            while b'"code":408' not in answer:
                more = sock.recv(4096)
                if not more:
                    break
                answer += more
            waited = time.monotonic() - started
        assert answer.startswith(b"HTTP/1.1 408 "), answer
        assert b'"the body did not arrive within 30 s or paused over 2 s"' in answer, answer
        assert 1.9 < waited < 10, waited
    finally:
        running.output()
