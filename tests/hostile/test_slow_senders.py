"""Issue 26, item 8 (reliability requirement 2): ingest keeps answering while slow senders come and go.

Slow bodies were kept out of the ingest slots, but not out of the places for bodies arriving
(``max_arriving_bodies``): sockets that fill every place made each real POST answer 503, for the
first 5 s of an attack (until the pace rule closed them) when they trickle, and for as long as it
lasts when they keep just above the minimum pace and reconnect once their body is done. While
every place is taken, a new body now takes the place of the one furthest behind
``body_min_bytes_per_second_when_full`` since it started (that one gets 503 with Retry-After);
a real sender, which sends its body at once, is never that one.

The places are lowered to 32 (48 senders) to keep the load small; the defaults' figures, 1,000
and 300 senders against 256 places, are ``bench/slow_senders.py``'s.
"""

from __future__ import annotations

import socket
import time

import httpx
import orjson
import pytest

from tests.article import article_records
from tests.hostile.conftest import Serve
from tests.hostile.test_connections import closed_within
from tests.hostile.test_slow_clients import BURST_HEAD, SlowBodies, p99, post_until
from tests.live import raise_open_files_limit, total

pytestmark = pytest.mark.integration

PLACES = 32
SENDERS = 48
# A blank (empty NDJSON) body of 7,000 bytes, sent 700 bytes every 0.5 s: 1,400 bytes/s, above
# the 1,024 asked, done in 5 s, then sent again on a new connection.
PACED_HEAD = (
    b"POST /v1/records HTTP/1.1\r\nHost: kvlens\r\nContent-Type: application/x-ndjson\r\n"
    b"Content-Length: 7000\r\n\r\n"
)


@pytest.mark.timeout(120)
def test_real_posts_are_answered_from_the_moment_trickling_bodies_take_every_place(serve: Serve) -> None:
    raise_open_files_limit()
    sidecar = serve(KVLENS_MAX_ARRIVING_BODIES=str(PLACES))
    attack = SlowBodies(sidecar.port, SENDERS)  # a head, then 2 bytes/s, reopened when answered
    try:
        assert sidecar.wait_for("kvlens_ingest_in_flight", PLACES) == PLACES  # every place taken
        # Long before the pace rule's first window (5 s) closes any of them; on main every one of
        # these was answered 503 "too many request bodies arriving".
        batches = iter([False, False, True])  # 20 POSTs
        latencies = post_until(sidecar, lambda: next(batches), timeout=30)
        print(
            f"\n{SENDERS} trickling bodies: {len(latencies)} real POSTs, all 200, p99 {p99(latencies):.3f} s"
        )
        assert max(latencies) < 2.0  # a hang check; the p99 < 1 s figure is bench/slow_senders.py's
        assert sidecar.value("kvlens_requests_total") == 100 * len(latencies)
        # The first POST found every place taken; later ones may find the place it freed (the
        # sender it displaced reconnects at its own pace), so how many were displaced varies.
        assert sidecar.value("kvlens_ingest_refused_total", reason="displaced") >= 1
        assert sidecar.value("kvlens_ingest_refused_total", reason="busy") == 0
    finally:
        attack.close()


@pytest.mark.timeout(120)
def test_real_posts_are_answered_while_senders_just_above_the_pace_reconnect(serve: Serve) -> None:
    raise_open_files_limit()
    sidecar = serve(KVLENS_MAX_ARRIVING_BODIES=str(PLACES))
    attack = SlowBodies(sidecar.port, SENDERS, pace=0.5, head=PACED_HEAD, burst=700, piece=700)
    try:
        assert sidecar.wait_for("kvlens_ingest_in_flight", PLACES) == PLACES
        # Until the senders came back as many times as there are senders (their body answered,
        # or their place taken): real POSTs all the while, each answered 200.
        latencies = post_until(sidecar, lambda: attack.reopened >= SENDERS, timeout=60)
        print(f"\n{SENDERS} paced senders: {len(latencies)} real POSTs, all 200, p99 {p99(latencies):.3f} s")
        assert max(latencies) < 2.0  # a hang check only
        assert sidecar.value("kvlens_requests_total") == 100 * len(latencies)
    finally:
        attack.close()


def test_a_real_post_takes_the_bytes_a_stalled_body_holds(serve: Serve) -> None:
    sidecar = serve(KVLENS_MAX_ARRIVING_BODY_BYTES="100000")
    stalled = socket.create_connection(("127.0.0.1", sidecar.port))
    try:
        stalled.sendall(BURST_HEAD + b" " * 60_000)  # then nothing
        assert sidecar.wait_for("kvlens_ingest_arriving_bytes", 60_000) == 60_000
        time.sleep(1.0)  # the stalled sender's silence: 60,000 bytes are behind 64 KiB/s after 0.92 s
        padded = orjson.dumps(article_records()).ljust(50_000)  # 60,000 + 50,000 > 100,000
        answer = httpx.post(f"{sidecar.url}/v1/records", content=padded)
        assert answer.status_code == 200, answer.text  # on main: 503 "bodies arriving hold 100000 bytes"
        refused = stalled.recv(4096)
        assert refused.startswith(b"HTTP/1.1 503"), refused
        assert b"retry-after: 1" in refused and b"a new body took this one's place" in refused
        assert closed_within(stalled, 5)
        assert sidecar.value("kvlens_ingest_refused_total", reason="displaced") == 1
        assert sidecar.value("kvlens_ingest_arriving_bytes") == 0
        assert sidecar.value("kvlens_requests_total") == 100
    finally:
        stalled.close()


@pytest.mark.timeout(120)
def test_the_memory_of_bodies_giving_their_place_away_is_bounded(serve: Serve) -> None:
    # Two waves of 600 senders of 16,000 body bytes each, then nothing: past 0.25 s each is behind
    # 64 KiB/s, so each later one takes the place (and bytes) of an earlier one, which is read whole
    # first and then answered 503; never more than the caps are held at once.
    raise_open_files_limit()
    sidecar = serve(
        KVLENS_MAX_ARRIVING_BODY_BYTES=str(512 * 1024),
        KVLENS_MAX_ARRIVING_BODIES="64",
        KVLENS_HEADER_TIMEOUT_SECONDS="120",
        KVLENS_BODY_TIMEOUT_SECONDS="120",
    )
    memory = sidecar.memory()
    memory.reset()
    senders: list[socket.socket] = []
    try:
        for wave in (1, 2):
            for _ in range(600):
                sock = socket.create_connection(("127.0.0.1", sidecar.port))
                sock.sendall(BURST_HEAD + b" " * 16_000)
                senders.append(sock)
            deadline = time.monotonic() + 30
            while True:  # until each sender is still arriving, refused, or displaced
                samples = sidecar.samples()
                arriving = total(samples, "kvlens_ingest_in_flight")
                refused = total(samples, "kvlens_ingest_refused_total", reason="busy")
                displaced = total(samples, "kvlens_ingest_refused_total", reason="displaced")
                if arriving + refused + displaced == 600 * wave or time.monotonic() > deadline:
                    break
                time.sleep(0.05)  # polling the real process
            assert arriving + refused + displaced == 600 * wave
            assert arriving <= 64 and 0 < total(samples, "kvlens_ingest_arriving_bytes") <= 512 * 1024
        growth = memory.peak_growth_mib()
        print(f"\n1,200 bodies of 16,000 bytes, {displaced:.0f} displaced: peak growth {growth:.1f} MiB")
        # Measured 17 to 25 MiB (the caps alone, each sender refused before its body is read: 13
        # MiB for 600); it plateaus, where 1,200 bodies held whole would be about 50 MiB.
        assert displaced > 0
        assert growth < 35
    finally:
        for sock in senders:
            sock.close()
