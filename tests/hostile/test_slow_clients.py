"""Issue 15, defects 3, 7 and 8 (one item): clients that are slow or leave must cost little.

Requirements: a body that arrives under a documented pace (``body_min_bytes_per_second`` over each
``body_rate_window_seconds``) is closed after the first window, and takes no ingest slot before
it has arrived or proved its pace, so 4 or 64 such sockets leave real POSTs answered 200 (p99 under
1 s: the figure is printed and kept in the notes; the test bounds it only as a hang check); a TLS
handshake is held to the header deadline and counts against ``max_connections``; a client gone
mid-body is counted and logged as one INFO line, without a traceback.
"""

from __future__ import annotations

import select
import socket
import ssl
import threading
import time
from pathlib import Path

import httpx
import orjson
import pytest
import trustme

from tests.article import article_records
from tests.hostile.conftest import Serve
from tests.hostile.test_connections import closed_within
from tests.hostile.test_defaults import write_pair
from tests.live import Running, Samples, in_thread, parse_samples, raise_open_files_limit, start_kvlens, total

pytestmark = pytest.mark.integration

SLOW_HEAD = (
    b"POST /v1/records HTTP/1.1\r\nHost: kvlens\r\nContent-Type: application/json\r\n"
    b"Content-Length: 100000\r\n\r\n["
)


class SlowBodies:
    """``count`` sockets that each send a request head and then one body byte every ``pace``
    seconds (2 bytes/s, far under the default 1024), reopened as soon as the sidecar answers or
    closes them, as an attacker keeps them up."""

    def __init__(self, port: int, count: int, pace: float = 0.5) -> None:
        self.port = port
        self.pace = pace
        self.stop = threading.Event()
        self.reopened = 0
        self.sockets = [self._open() for _ in range(count)]
        self.thread = in_thread(self._run)

    def _open(self) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port))
        sock.sendall(SLOW_HEAD)
        return sock

    def _run(self) -> None:
        while not self.stop.wait(self.pace):  # the attacker's pace, not a wait for the sidecar
            answered, _, _ = select.select(self.sockets, [], [], 0)
            for i, sock in enumerate(self.sockets):
                try:
                    if sock in answered:
                        raise ConnectionResetError
                    sock.sendall(b" ")
                except OSError:
                    sock.close()
                    self.sockets[i] = self._open()
                    self.reopened += 1

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        for sock in self.sockets:
            sock.close()


@pytest.mark.parametrize("count", [4, 64])
def test_slow_bodies_leave_real_posts_served(serve: Serve, count: int) -> None:
    raise_open_files_limit()
    sidecar = serve()  # the defaults: 4 ingest slots, 1024 bytes/s over 5 s windows
    attack = SlowBodies(sidecar.port, count)
    try:
        assert sidecar.wait_for("kvlens_connections_open", count + 1) == count + 1  # + the scrape's
        body = orjson.dumps(article_records())
        latencies: list[float] = []
        deadline = time.monotonic() + 60
        with httpx.Client(timeout=10) as client:
            # Until every slow socket was closed twice over: they were held, and reopened, meanwhile.
            while sidecar.value("kvlens_ingest_refused_total", reason="too_slow") < 2 * count:
                assert time.monotonic() < deadline, "the slow bodies were never closed"
                for _ in range(10):
                    started = time.monotonic()
                    answer = client.post(f"{sidecar.url}/v1/records", content=body)
                    latencies.append(time.monotonic() - started)
                    assert answer.status_code == 200, (answer.status_code, answer.text)
        assert attack.reopened >= count
        p99 = sorted(latencies)[int(0.99 * len(latencies))]
        print(f"\n{count} slow bodies: {len(latencies)} real POSTs, all 200, p99 {p99 * 1000:.1f} ms")
        assert p99 < 5.0  # a hang check; the p99 < 1 s figure is measured and noted, not timed here
        assert sidecar.value("kvlens_requests_total") == 100 * len(latencies)
        assert sidecar.value("kvlens_ingest_refused_total", reason="busy") == 0
    finally:
        attack.close()


def test_a_body_under_the_pace_is_closed_after_one_window_and_one_above_it_is_taken(
    serve: Serve,
) -> None:
    sidecar = serve(KVLENS_BODY_RATE_WINDOW_SECONDS="1", KVLENS_BODY_MIN_BYTES_PER_SECOND="1000")
    slow = socket.create_connection(("127.0.0.1", sidecar.port))
    slow.sendall(SLOW_HEAD)
    started = time.monotonic()
    answer = b""
    try:
        while not answer.endswith(b"}") and time.monotonic() - started < 8:
            slow.sendall(b" ")  # 2 bytes/s, under 1000
            ready, _, _ = select.select([slow], [], [], 0.5)  # the sender's pace
            if ready:
                answer += slow.recv(4096)
        assert answer.startswith(b"HTTP/1.1 408"), answer[:40]
        assert b"slower than 1000 bytes/s over 1 s" in answer
        assert closed_within(slow, 3)  # and the rest of the body is not waited for
        assert time.monotonic() - started < 5  # well before the 10 s stall and the 30 s body deadlines
    finally:
        slow.close()
    assert sidecar.value("kvlens_ingest_refused_total", reason="too_slow") == 1

    # A body paced above the minimum (about 4 KB/s in pieces every 0.1 s, over 3 windows) is taken.
    body = orjson.dumps(article_records())
    head = (
        b"POST /v1/records HTTP/1.1\r\nHost: kvlens\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    )
    paced = socket.create_connection(("127.0.0.1", sidecar.port))
    try:
        paced.sendall(head)
        piece = max(1, len(body) // 30)
        for offset in range(0, len(body), piece):
            paced.sendall(body[offset : offset + piece])
            time.sleep(0.1)  # the sender's pace
        paced.settimeout(10)
        reply = paced.recv(65536)
    finally:
        paced.close()
    assert reply.startswith(b"HTTP/1.1 200"), reply[:40]
    assert sidecar.value("kvlens_requests_total") == 100
    assert sidecar.value("kvlens_ingest_refused_total", reason="too_slow") == 1


def test_a_client_gone_mid_body_is_counted_and_logged_in_one_info_line() -> None:
    sidecar = start_kvlens("serve", env={"KVLENS_LOG_LEVEL": "INFO"})
    try:
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", sidecar.port)) as sock:
                sock.sendall(SLOW_HEAD + b'{"model": "m"')
        found = sidecar.wait_for("kvlens_ingest_refused_total", 3, timeout=10, reason="client_disconnected")
    finally:
        output = sidecar.output()
    assert found == 3
    assert "Traceback" not in output and "ERROR" not in output, output
    gone = [line for line in output.splitlines() if "went away" in line]
    assert len(gone) == 3 and all(line.startswith("INFO ") for line in gone), gone


def client_hello() -> bytes:
    """The first flight of a real TLS client, to stop half-way through."""
    outgoing = ssl.MemoryBIO()
    tls = ssl.create_default_context().wrap_bio(ssl.MemoryBIO(), outgoing, server_hostname="localhost")
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def https_samples(ca: trustme.CA, sidecar: Running) -> Samples:
    context = ssl.create_default_context()
    ca.configure_trust(context)
    return parse_samples(httpx.get(f"{sidecar.url}/metrics", verify=context, timeout=10).text)


def start_tls(ca: trustme.CA, directory: Path, wait: bool = True, **env: str) -> Running:
    chain, key = write_pair(ca, directory)
    env = {"KVLENS_TLS_CERT_FILE": str(chain), "KVLENS_TLS_KEY_FILE": str(key), **env}
    return start_kvlens("serve", env=env, scheme="https", wait=wait)


def first_connection(sidecar: Running) -> socket.socket:
    """The first connection the sidecar ever accepts, made as soon as it listens."""
    deadline = time.monotonic() + 20
    while True:
        try:
            return socket.create_connection(("127.0.0.1", sidecar.port))
        except ConnectionRefusedError:
            assert sidecar.process.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)  # waiting for a process to bind, not for time to pass


def test_a_stalled_tls_handshake_is_closed_at_the_header_deadline(tmp_path: Path) -> None:
    ca = trustme.CA()
    sidecar = start_tls(ca, tmp_path, KVLENS_HEADER_TIMEOUT_SECONDS="1")
    silent = socket.create_connection(("127.0.0.1", sidecar.port))  # TCP, then no ClientHello
    partial = socket.create_connection(("127.0.0.1", sidecar.port))
    hello = client_hello()
    partial.sendall(hello[: len(hello) // 2])
    started = time.monotonic()
    try:
        assert closed_within(silent, 10)
        assert closed_within(partial, 10)
        assert time.monotonic() - started < 5  # asyncio's own handshake limit is 60 s
        samples = https_samples(ca, sidecar)
        assert total(samples, "kvlens_connections_closed_total", reason="header_timeout") == 2
    finally:
        silent.close()
        partial.close()
        sidecar.output()


def test_stalled_tls_handshakes_count_against_the_connection_cap(tmp_path: Path) -> None:
    ca = trustme.CA()
    sidecar = start_tls(ca, tmp_path, wait=False, KVLENS_MAX_CONNECTIONS="16")
    stalled = [first_connection(sidecar)]  # no readiness probe: every connection here is counted
    stalled += [socket.create_connection(("127.0.0.1", sidecar.port)) for _ in range(15)]
    try:
        # The scrape is the 17th connection: the oldest stalled handshake makes room for it.
        samples = https_samples(ca, sidecar)
        assert total(samples, "kvlens_connections_open") == 16
        assert total(samples, "kvlens_connections_closed_total", reason="over_capacity") == 1
        assert closed_within(stalled[0], 5)
        still_open, _, _ = select.select(stalled[1:], [], [], 0)
        assert still_open == []  # none of the others was answered or closed
    finally:
        for sock in stalled:
            sock.close()
        sidecar.output()
