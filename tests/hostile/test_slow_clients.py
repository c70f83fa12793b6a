"""Issue 15, defects 3, 7 and 8 (one item): clients that are slow or leave must cost little.

Requirements: a body that arrives under a documented pace (``body_min_bytes_per_second`` over each
``body_rate_window_seconds``) is closed after the first window, and takes no ingest slot before
all of it has arrived, so 4 or 64 such sockets (also ones that send 16.5 KiB at once, then keep
just above the pace) leave real POSTs answered 200 (p99 under 1 s: the figure is printed and kept
in the notes; the test bounds it only as a hang check); at most ``max_arriving_bodies`` bodies
arrive at once (one more is answered 503 before its body is read) holding at most
``max_arriving_body_bytes`` together; a TLS handshake is held to the header deadline and counts
against ``max_connections``; clients gone mid-body are counted exactly and logged as at most one
INFO line per 10 s, without a traceback.
"""

from __future__ import annotations

import select
import socket
import ssl
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import orjson
import pytest
import trustme

from tests.article import article_records
from tests.hostile.conftest import Serve
from tests.hostile.test_connections import closed_within
from tests.hostile.test_defaults import write_pair
from tests.live import (
    Running,
    Samples,
    in_thread,
    parse_samples,
    raise_open_files_limit,
    start_kvlens,
    total,
    until,
)

pytestmark = pytest.mark.integration

SLOW_HEAD = (
    b"POST /v1/records HTTP/1.1\r\nHost: kvlens\r\nContent-Type: application/json\r\n"
    b"Content-Length: 100000\r\n\r\n["
)


BURST_HEAD = (
    b"POST /v1/records HTTP/1.1\r\nHost: kvlens\r\nContent-Type: application/json\r\n"
    b"Content-Length: 8000000\r\n\r\n"
)


class SlowBodies:
    """``count`` sockets that each send a request head (and ``burst`` body bytes at once) and then
    ``piece`` body bytes every ``pace`` seconds (by default 2 bytes/s, far under the default 1024),
    reopened as soon as the sidecar answers or closes them, as an attacker keeps them up."""

    def __init__(
        self,
        port: int,
        count: int,
        pace: float = 0.5,
        head: bytes = SLOW_HEAD,
        burst: int = 0,
        piece: int = 1,
    ) -> None:
        self.port = port
        self.pace = pace
        self.head = head + b" " * burst
        self.piece = b" " * piece
        self.stop = threading.Event()
        self.reopened = 0
        self.sockets = [self._open() for _ in range(count)]
        self.thread = in_thread(self._run)

    def _open(self) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port))
        sock.sendall(self.head)
        return sock

    def _run(self) -> None:
        while not self.stop.wait(self.pace):  # the attacker's pace, not a wait for the sidecar
            answered, _, _ = select.select(self.sockets, [], [], 0)
            for i, sock in enumerate(self.sockets):
                try:
                    if sock in answered:
                        raise ConnectionResetError
                    sock.sendall(self.piece)
                except OSError:
                    sock.close()
                    self.sockets[i] = self._open()
                    self.reopened += 1

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        for sock in self.sockets:
            sock.close()


def post_until(sidecar: Running, done: Callable[[], bool], timeout: float = 60) -> list[float]:
    """Real POSTs of 100 records, 10 at a time until ``done()``; each must be answered 200.
    Returns their latencies (the figure kept in the notes; bounded here as a hang check only)."""
    body = orjson.dumps(article_records())
    latencies: list[float] = []
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=10) as client:
        while not done():
            assert time.monotonic() < deadline, "the slow bodies were never closed"
            for _ in range(10):
                started = time.monotonic()
                answer = client.post(f"{sidecar.url}/v1/records", content=body)
                latencies.append(time.monotonic() - started)
                assert answer.status_code == 200, (answer.status_code, answer.text)
    return latencies


def p99(latencies: list[float]) -> float:
    return sorted(latencies)[int(0.99 * len(latencies))]


@pytest.mark.parametrize("count", [4, 64])
def test_slow_bodies_leave_real_posts_served(serve: Serve, count: int) -> None:
    raise_open_files_limit()
    sidecar = serve()  # the defaults: 4 ingest slots, 1024 bytes/s over 5 s windows
    attack = SlowBodies(sidecar.port, count)
    try:
        assert sidecar.wait_for("kvlens_connections_open", count + 1) == count + 1  # + the scrape's
        # Until every slow socket was closed twice over: they were held, and reopened, meanwhile.
        latencies = post_until(
            sidecar, lambda: sidecar.value("kvlens_ingest_refused_total", reason="too_slow") >= 2 * count
        )
        assert attack.reopened >= count
        print(
            f"\n{count} slow bodies: {len(latencies)} real POSTs, all 200, p99 {p99(latencies) * 1000:.1f} ms"
        )
        assert (
            p99(latencies) < 5.0
        )  # a hang check; the p99 < 1 s figure is measured and noted, not timed here
        assert sidecar.value("kvlens_requests_total") == 100 * len(latencies)
        assert sidecar.value("kvlens_ingest_refused_total", reason="busy") == 0
    finally:
        attack.close()


@pytest.mark.parametrize("count", [4, 64])
def test_bodies_that_burst_then_keep_the_pace_hold_no_ingest_slot(serve: Serve, count: int) -> None:
    # The review's a_burst.py: 16.5 KiB at once (past the 16 KiB that used to win a slot), then
    # 1.4 KiB/s, above the pace, until the body deadline (5 s here, 30 s by default) closes them.
    raise_open_files_limit()
    sidecar = serve(KVLENS_BODY_TIMEOUT_SECONDS="5")
    attack = SlowBodies(sidecar.port, count, head=BURST_HEAD, burst=16_500, piece=700)
    try:
        assert sidecar.wait_for("kvlens_ingest_in_flight", count) == count
        latencies = post_until(
            sidecar, lambda: sidecar.value("kvlens_ingest_refused_total", reason="too_slow") >= count
        )
        figure = f"{len(latencies)} real POSTs, all 200, p99 {p99(latencies) * 1000:.1f} ms"
        print(f"\n{count} bursting bodies: {figure}")
        assert p99(latencies) < 5.0  # a hang check only
        assert sidecar.value("kvlens_requests_total") == 100 * len(latencies)
        assert sidecar.value("kvlens_ingest_refused_total", reason="busy") == 0
    finally:
        attack.close()


def test_past_max_arriving_bodies_a_post_is_refused_before_its_body_is_read(serve: Serve) -> None:
    raise_open_files_limit()
    # Long deadlines and no minimum pace: the 8 held bodies must outlast the test, however slowly
    # a loaded machine runs it, not be closed as stalled (the pace closes them after its 5 s window).
    sidecar = serve(
        KVLENS_MAX_ARRIVING_BODIES="8",
        KVLENS_HEADER_TIMEOUT_SECONDS="120",
        KVLENS_BODY_TIMEOUT_SECONDS="120",
        KVLENS_BODY_MIN_BYTES_PER_SECOND="0",
    )
    held = [socket.create_connection(("127.0.0.1", sidecar.port)) for _ in range(8)]
    try:
        for sock in held:
            sock.sendall(SLOW_HEAD)  # a head and one body byte: each body stays arriving
        assert sidecar.wait_for("kvlens_ingest_in_flight", 8) == 8
        refused = httpx.post(f"{sidecar.url}/v1/records", content=orjson.dumps(article_records()))
        assert refused.status_code == 503, refused.text
        assert refused.headers["retry-after"] == "1"
        assert refused.headers["connection"] == "close"
        assert refused.json() == {"error": "too many request bodies arriving"}
        # A head alone is answered: nothing of the body is waited for, and the connection closes.
        with socket.create_connection(("127.0.0.1", sidecar.port)) as head_only:
            head_only.sendall(BURST_HEAD)
            assert head_only.recv(4096).startswith(b"HTTP/1.1 503")
            assert closed_within(head_only, 5)
        # 300 more heads, each refused at once: health probes stay answered meanwhile.
        flood = SlowBodies(sidecar.port, 300, pace=0.05, head=BURST_HEAD)
        try:
            with httpx.Client(timeout=10) as client:
                for _ in range(20):
                    started = time.monotonic()
                    assert client.get(f"{sidecar.url}/healthz").status_code == 200
                    assert time.monotonic() - started < 2.0  # a hang check only (was 2.8-6.3 s)
            # each of the 300 answered (and reopened): the flood's pace, not the probes', decides
            # when (the probes took 0.1 s in a fresh-clone CI run, the flood had reopened 56 then)
            until(lambda: flood.reopened >= 300, timeout=30)
        finally:
            flood.close()
        assert sidecar.value("kvlens_ingest_in_flight") == 8
        assert sidecar.value("kvlens_requests_total") == 0
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 5
    while (answer := httpx.post(f"{sidecar.url}/v1/records", content=b"[]")).status_code == 503:
        assert time.monotonic() < deadline
        time.sleep(0.05)  # the closed requests leave their places as the server notices
    assert answer.status_code == 200


def test_past_max_arriving_body_bytes_a_body_is_refused_and_its_bytes_freed(serve: Serve) -> None:
    # The cap itself: no body gives its bytes away (else the first, silent, would give them to the
    # POST once behind 64 KiB/s, as tests/hostile/test_slow_senders.py checks).
    sidecar = serve(KVLENS_MAX_ARRIVING_BODY_BYTES="100000", KVLENS_BODY_MIN_BYTES_PER_SECOND_WHEN_FULL="0")
    first = socket.create_connection(("127.0.0.1", sidecar.port))
    padded = orjson.dumps(article_records()).ljust(50_000)
    try:
        first.sendall(BURST_HEAD + b" " * 60_000)
        assert sidecar.wait_for("kvlens_ingest_arriving_bytes", 60_000) == 60_000
        refused = httpx.post(f"{sidecar.url}/v1/records", content=padded)  # 60,000 + 50,000 > 100,000
        assert refused.status_code == 503, refused.text
        assert refused.headers["retry-after"] == "1"
        assert refused.headers["connection"] == "close"
        assert "bodies arriving hold 100000 bytes already" in refused.text
        assert sidecar.value("kvlens_ingest_arriving_bytes") == 60_000  # the refused body's are free
        assert sidecar.value("kvlens_ingest_refused_total", reason="busy") == 1
    finally:
        first.close()
    assert sidecar.wait_for("kvlens_ingest_refused_total", 1, reason="client_disconnected") == 1
    assert sidecar.value("kvlens_ingest_arriving_bytes") == 0
    assert httpx.post(f"{sidecar.url}/v1/records", content=padded).status_code == 200
    assert sidecar.value("kvlens_requests_total") == 100


def test_the_memory_of_arriving_bodies_is_bounded_by_their_caps(serve: Serve) -> None:
    # 600 senders of 16,000 body bytes each (under the 16 KiB that used to take a slot, so before
    # nothing capped them): about 32 fit in the 512 KiB budget, the others are answered 503 and
    # closed.
    raise_open_files_limit()
    sidecar = serve(
        KVLENS_MAX_ARRIVING_BODY_BYTES=str(512 * 1024),
        KVLENS_MAX_ARRIVING_BODIES="64",
        KVLENS_HEADER_TIMEOUT_SECONDS="120",
        KVLENS_BODY_TIMEOUT_SECONDS="120",
        # The caps alone: each sender let in or refused once (test_slow_senders.py measures the
        # churn of bodies that give their place to later ones)
        KVLENS_BODY_MIN_BYTES_PER_SECOND_WHEN_FULL="0",
    )
    memory = sidecar.memory()
    memory.reset()
    senders = []
    try:
        for _ in range(600):
            sock = socket.create_connection(("127.0.0.1", sidecar.port))
            sock.sendall(BURST_HEAD + b" " * 16_000)
            senders.append(sock)
        deadline = time.monotonic() + 30
        while True:  # until each sender was either let in (its body still arriving) or refused
            samples = sidecar.samples()
            arriving = total(samples, "kvlens_ingest_in_flight")
            refused = total(samples, "kvlens_ingest_refused_total", reason="busy")
            if arriving + refused == 600 or time.monotonic() > deadline:
                break
            time.sleep(0.05)  # polling the real process
        # Which bodies get in depends on how the kernel splits each 16,000 bytes into reads (a body
        # is let in while its bytes so far fit): the invariants are the caps, never crossed.
        assert arriving + refused == 600
        assert arriving <= 64 and refused >= 600 - 64
        assert 0 < total(samples, "kvlens_ingest_arriving_bytes") <= 512 * 1024
        growth = memory.peak_growth_mib()
        print(f"\n600 bodies of 16,000 bytes, {arriving:.0f} let in: peak growth {growth:.1f} MiB")
        # Measured 13 MiB: mostly what 568 refused requests left in the allocator (it plateaus);
        # before, all 600 were held at about 42 KiB each (25 MiB).
        assert growth < 20
    finally:
        for sock in senders:
            sock.close()


def test_clients_gone_mid_body_are_counted_exactly_and_logged_at_most_once_per_interval() -> None:
    sidecar = start_kvlens("serve", env={"KVLENS_LOG_LEVEL": "INFO"})
    try:
        for _ in range(30):
            with socket.create_connection(("127.0.0.1", sidecar.port)) as sock:
                sock.sendall(SLOW_HEAD + b'{"model": "m"')
        found = sidecar.wait_for("kvlens_ingest_refused_total", 30, timeout=10, reason="client_disconnected")
    finally:
        output = sidecar.output()
    assert found == 30
    assert "Traceback" not in output and "ERROR" not in output, output
    gone = [line for line in output.splitlines() if "went away" in line]
    # 30 in well under 10 s: the first is logged, the others counted only (a client decides how
    # many there are, so it must not decide the log volume)
    assert len(gone) == 1 and gone[0].split()[1] == "INFO", gone  # after the line's timestamp


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
