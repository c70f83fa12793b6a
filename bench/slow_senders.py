"""Real POSTs while slow senders come and go (reliability requirement 2), beside the same POSTs
with no attack, measured in the same run on a fresh ``kvlens serve`` per scenario.

    .venv/bin/python bench/slow_senders.py [--seconds 20] [--scenarios burst,paced]

- ``burst``: 1,000 sockets opened at once, each a POST head (Content-Length 100,000) then one
  body byte every 0.5 s (2 bytes/s, far under the minimum pace); not reopened.
- ``paced``: 300 senders, each a body of 30,000 bytes (blank: a valid empty NDJSON body) sent
  at 1,200 bytes/s (600 bytes every 0.5 s, just above the default minimum of 1,024), reopened as
  soon as it is answered or closed.

Meanwhile a real POST of 100 records every 100 ms (one client, kept alive as the vLLM plugin's):
printed are the share answered 200, the latency p50/p99/max of all of them, and the 503 window
(from the attack's start to the last POST not answered 200). The attackers run in a process of
their own, so their sends do not hold the measuring thread's GIL.
"""

from __future__ import annotations

import argparse
import multiprocessing
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from multiprocessing.synchronize import Event
from pathlib import Path

import httpx
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.article import article_records  # noqa: E402
from tests.live import Running, raise_open_files_limit, start_kvlens  # noqa: E402

POST_EVERY_SECONDS = 0.1


@dataclass(frozen=True)
class Attack:
    """``count`` sockets, each a head and ``first`` body bytes, then ``piece`` bytes every
    ``pace`` seconds up to ``length`` body bytes; reopened once answered or closed if ``reopen``."""

    name: str
    count: int
    length: int
    first: int
    piece: int
    pace: float
    reopen: bool

    def head(self) -> bytes:
        return (
            b"POST /v1/records HTTP/1.1\r\nHost: kvlens\r\nContent-Type: application/x-ndjson\r\n"
            b"Content-Length: %d\r\n\r\n" % self.length
        )


SCENARIOS = {
    "burst": Attack("burst", count=1000, length=100_000, first=1, piece=1, pace=0.5, reopen=False),
    "paced": Attack("paced", count=300, length=28_000, first=700, piece=700, pace=0.5, reopen=True),
}


def run_attack(attack: Attack, port: int, started: Event, stop: Event) -> None:
    """The attacker's process: one thread pacing every socket (sends of at most 600 bytes never
    block on a socket the sidecar reads)."""
    head = attack.head()

    def opened() -> tuple[socket.socket, int] | None:
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            sock.sendall(head + b" " * attack.first)
        except OSError:
            return None
        return sock, attack.first

    senders = [opened() for _ in range(attack.count)]
    started.set()
    tick = time.monotonic()
    while not stop.is_set():
        tick += attack.pace
        stop.wait(max(0.0, tick - time.monotonic()))  # the attacker's pace
        for i, sender in enumerate(senders):
            if sender is None:
                if attack.reopen:
                    senders[i] = opened()
                continue
            sock, sent = sender
            try:
                answered = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) is not None
            except BlockingIOError:
                answered = False
            except OSError:
                answered = True
            if not answered and sent < attack.length:
                try:
                    piece = min(attack.piece, attack.length - sent)
                    sock.sendall(b" " * piece)
                    senders[i] = (sock, sent + piece)
                    continue
                except OSError:
                    pass
            elif not answered:
                continue  # the whole body is sent: its answer is on its way
            sock.close()
            senders[i] = opened() if attack.reopen else None
    for sender in senders:
        if sender is not None:
            sender[0].close()


@dataclass(frozen=True)
class Posts:
    statuses: list[int]  # 0: no answer (a transport error)
    latencies: list[float]
    sent_at: list[float]  # seconds from the start

    def line(self) -> str:
        ok = sum(status == 200 for status in self.statuses)
        latencies = sorted(self.latencies)
        p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
        failed = [t for t, status in zip(self.sent_at, self.statuses, strict=True) if status != 200]
        window = f"{failed[-1]:.1f} s" if failed else "none"
        others = {
            status: self.statuses.count(status) for status in sorted(set(self.statuses)) if status != 200
        }
        return (
            f"{len(self.statuses)} POSTs, {100 * ok / len(self.statuses):.1f} % answered 200"
            f"{f' (others: {others})' if others else ''}; latency p50 "
            f"{statistics.median(latencies) * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms, "
            f"max {latencies[-1] * 1000:.1f} ms; last failure at {window}"
        )


def real_posts(sidecar: Running, seconds: float) -> Posts:
    body = orjson.dumps(article_records())
    statuses: list[int] = []
    latencies: list[float] = []
    sent_at: list[float] = []
    start = time.monotonic()
    tick = start
    with httpx.Client(timeout=10) as client:
        while (now := time.monotonic()) < start + seconds:
            try:
                status = client.post(f"{sidecar.url}/v1/records", content=body).status_code
            except httpx.TransportError:
                status = 0
            statuses.append(status)
            latencies.append(time.monotonic() - now)
            sent_at.append(now - start)
            tick = max(tick + POST_EVERY_SECONDS, time.monotonic())
            time.sleep(max(0.0, tick - time.monotonic()))  # the sender's own pace
    return Posts(statuses, latencies, sent_at)


def scenario(attack: Attack, seconds: float) -> None:
    sidecar = start_kvlens("serve")
    try:
        baseline = real_posts(sidecar, min(seconds, 5.0))
        started, stop = multiprocessing.Event(), multiprocessing.Event()
        attacker = multiprocessing.Process(target=run_attack, args=(attack, sidecar.port, started, stop))
        attacker.start()
        started.wait(60)
        attacked = real_posts(sidecar, seconds)
        stop.set()
        attacker.join(30)
        again = "reopened" if attack.reopen else "not reopened"
        pace = attack.piece / attack.pace
        print(
            f"{attack.name}: {attack.count} senders, {attack.length:,}-byte bodies, "
            f"{pace:,.0f} bytes/s, {again}"
        )
        print(f"  no attack      {baseline.line()}")
        print(f"  under attack   {attacked.line()}")
        refused = {
            dict(labels)["reason"]: value
            for (name, labels), value in sidecar.samples().items()
            if name == "kvlens_ingest_refused_total" and value
        }
        print(f"  refused by the sidecar: {refused}")
    finally:
        sidecar.output()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="of real POSTs under each attack")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated: burst, paced")
    args = parser.parse_args()
    raise_open_files_limit(8192)
    for name in args.scenarios.split(","):
        scenario(SCENARIOS[name], args.seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
