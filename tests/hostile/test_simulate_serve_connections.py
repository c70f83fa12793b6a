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


def trickle(sock: socket.socket, pieces: int, every: float) -> bytes:
    """Send a head announcing 1,000 bytes, then ``pieces`` of 5 bytes ``every`` seconds apart (a
    sender's pace, never a pause past the head timeout); what the server answered meanwhile."""
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 1000\r\n\r\n{"prompt":'
    )
    sock.settimeout(every)
    answer = b""
    for _ in range(pieces):
        try:
            sock.sendall(b"     ")
            more = sock.recv(4096)  # waits `every` at most: the pace of the trickle
            if not more:
                break
            answer += more
            if b'"code":408' in answer:
                break
        except TimeoutError:
            continue
        except (BrokenPipeError, ConnectionResetError):
            break
    return answer


@pytest.mark.timeout(60)
def test_a_body_under_the_pace_is_answered_408_at_its_window() -> None:
    """simulate serve asks kvlens serve's minimum pace of a body (the same settings, the same
    reader): 5 bytes every 0.2 s against 1,000 bytes/s over 0.5 s windows is answered 408 at the
    end of its first window, saying why. Before: no pace here; the trickle held its place among
    the arriving bodies until the whole body's deadline (8 s)."""
    env = {
        "KVLENS_HEADER_TIMEOUT_SECONDS": "2",
        "KVLENS_BODY_TIMEOUT_SECONDS": "8",
        "KVLENS_BODY_MIN_BYTES_PER_SECOND": "1000",
        "KVLENS_BODY_RATE_WINDOW_SECONDS": "0.5",
    }
    running = start_kvlens("simulate", "serve", "--speed", "1000", env=env, ready="/health")
    try:
        with socket.create_connection(("127.0.0.1", running.port), timeout=20) as sock:
            started = time.monotonic()
            answer = trickle(sock, 60, 0.2)
            waited = time.monotonic() - started
        assert answer.startswith(b"HTTP/1.1 408 "), answer
        assert b'"the body arrived slower than 1000 bytes/s over 0.5 s"' in answer, answer
        assert waited < 3, waited  # the window (0.5 s, checked at the next piece), not the 8 s deadline
    finally:
        running.output()


@pytest.mark.timeout(60)
def test_trickling_bodies_in_every_place_do_not_keep_a_real_request_out() -> None:
    """Four bodies trickling in the four places for arriving bodies (each told 100 Continue): a
    real completion takes the place of the one furthest behind body_min_bytes_per_second_when_full,
    as in kvlens serve.
    Before: simulate serve asked no pace when full either; the completion was refused 503."""
    env = {
        "KVLENS_HEADER_TIMEOUT_SECONDS": "5",
        "KVLENS_BODY_TIMEOUT_SECONDS": "30",
        "KVLENS_MAX_ARRIVING_BODIES": "4",
    }
    running = start_kvlens("simulate", "serve", "--speed", "1000", env=env, ready="/health")
    sockets = []
    try:
        for _ in range(4):
            sock = socket.create_connection(("127.0.0.1", running.port), timeout=20)
            sockets.append(sock)
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Expect: 100-continue\r\nContent-Length: 1000\r\n\r\n"
            )
            # uvicorn says 100 Continue at the reader's first receive(), once the body has its place
            assert sock.recv(4096).startswith(b"HTTP/1.1 100 "), "no place for a trickling body"
            sock.sendall(b'{"prompt":')
        answer = httpx.post(f"{running.url}/v1/completions", json=COMPLETION, timeout=10)
        assert answer.status_code == 200, answer.text
    finally:
        for sock in sockets:
            sock.close()
        running.output()
