"""The bounded pieces an ingest request goes through, and the runtime guards, one by one."""

from __future__ import annotations

import asyncio
import threading
import tracemalloc
from dataclasses import dataclass

import pytest
from prometheus_client import CollectorRegistry
from starlette.requests import Request
from starlette.types import Message

from kvlens.errors import ArrivingBytesFull, BodyDisplaced, BodyTooSlow, ClientDisconnected, PayloadTooLarge
from kvlens.exporter.ingest import BatchLedger, LogThrottle, RecentRecords
from kvlens.exporter.runtime import LoopLag, ScrapeRenderer
from kvlens.exporter.settings import BATCH_ID_BYTES
from kvlens.http.bodies import ArrivingBodies, BodyLimits, BodyReader, IngestGate
from kvlens.http.server import ConnectionGuard
from kvlens.records import batch_from_objects


def test_batch_ids_are_compared_whole() -> None:
    ledger = BatchLedger(10)
    first, second = BatchLedger.key("p" * 64 + "-1"), BatchLedger.key("p" * 64 + "-2")
    assert ledger.begin(first) == BatchLedger.NEW
    assert ledger.begin(second) == BatchLedger.NEW
    assert ledger.begin(first) == BatchLedger.IN_PROGRESS
    ledger.commit(first, (100, 0, 0, 0))
    assert ledger.begin(first) == (100, 0, 0, 0)
    ledger.abandon(second)  # failed: the same batch may come again
    assert ledger.begin(second) == BatchLedger.NEW


def test_the_ledger_forgets_the_oldest_past_its_window() -> None:
    ledger = BatchLedger(2)
    keys = [BatchLedger.key(str(i)) for i in range(3)]
    for key in keys:
        ledger.begin(key)
        ledger.commit(key, (1, 0, 0, 0))
    assert ledger.begin(keys[0]) == BatchLedger.NEW
    assert ledger.begin(keys[2]) == (1, 0, 0, 0)


def test_ten_thousand_committed_ids_hold_under_5_mib() -> None:
    ledger = BatchLedger(10_000)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i in range(10_000):
        key = BatchLedger.key(f"{i:040d}")
        ledger.begin(key)
        ledger.commit(key, (1000 + i, 100, 3, 0))
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert used < 5 * 1024 * 1024
    assert used / 10_000 <= BATCH_ID_BYTES  # bytes per id: the bound of batch_id_window


def test_recent_records_drop_replays_and_keep_children_that_measured_differently() -> None:
    recent = RecentRecords(capacity=100)
    parent = {"request_id": "r", "prompt_tokens": 500, "cached_tokens": 0, "e2e_seconds": 0.5}
    child = {**parent, "cached_tokens": 496, "e2e_seconds": 0.51}
    anonymous = {"prompt_tokens": 10, "cached_tokens": 0}  # no id: never a duplicate
    batch = batch_from_objects([parent, child, anonymous]).batch
    assert recent.fresh(batch).tolist() == [True, True, True]
    assert recent.fresh(batch).tolist() == [False, False, True]  # absent durations (NaN) match too


def test_recent_records_forget_past_their_window() -> None:
    recent = RecentRecords(capacity=2)
    records = [{"request_id": str(i), "prompt_tokens": 1, "cached_tokens": 0} for i in range(3)]
    recent.fresh(batch_from_objects(records).batch)
    assert recent.fresh(batch_from_objects(records[:1]).batch).tolist() == [True]


def test_the_gate_admits_up_to_its_capacity() -> None:
    async def scenario() -> list[bool]:
        gate = IngestGate(2)
        admitted = []
        async with gate.slot() as one, gate.slot() as two, gate.slot() as three:
            admitted = [one, two, three]
        assert gate.in_flight == 0 and gate.refused == 1
        return admitted

    assert asyncio.run(scenario()) == [True, True, False]


def test_concurrent_scrapes_share_renders() -> None:
    renders = []
    started, release = threading.Event(), threading.Event()

    def encoder(registry: CollectorRegistry) -> bytes:
        renders.append(1)
        started.set()
        release.wait(5)
        return f"render {len(renders)}".encode()

    async def scenario() -> list[bytes]:
        renderer = ScrapeRenderer(CollectorRegistry())
        first = asyncio.create_task(renderer.render(encoder, "text/plain"))
        await asyncio.to_thread(started.wait, 5)  # the first render runs; now the others arrive
        later = [asyncio.create_task(renderer.render(encoder, "text/plain")) for _ in range(5)]
        for _ in range(3):
            await asyncio.sleep(0)  # each reaches its await
        release.set()
        return await asyncio.gather(first, *later)

    answers = asyncio.run(scenario())
    assert answers == [b"render 1"] + [b"render 2"] * 5  # fresher than their arrival, rendered once
    assert len(renders) == 2


@dataclass
class FakeConnection:
    waiting_for_head: bool
    closed: bool = False

    def close_idle(self) -> None:
        self.closed = True

    def __hash__(self) -> int:
        return id(self)


def test_past_the_connection_cap_the_oldest_idle_one_goes() -> None:
    guard = ConnectionGuard(max_connections=3, header_timeout=10)
    busy, idle, other = FakeConnection(False), FakeConnection(True), FakeConnection(True)
    for connection in (busy, idle, other):
        assert guard.admit(connection)
    newcomer = FakeConnection(True)
    assert guard.admit(newcomer)
    assert idle.closed and not busy.closed and not other.closed
    assert guard.open == 3 and guard.closed["over_capacity"] == 1


def test_when_every_connection_is_busy_a_new_one_is_refused() -> None:
    guard = ConnectionGuard(max_connections=1, header_timeout=10)
    assert guard.admit(FakeConnection(False))
    assert not guard.admit(FakeConnection(True))


def test_loop_lag_buckets_are_cumulative() -> None:
    lag = LoopLag()
    for value in (0.0005, 0.02, 0.02, 7.0):
        lag.observe(value)
    counts, total = lag.snapshot()
    assert counts[0] == 1 and counts[-1] == 4 and counts == sorted(counts)
    assert total == 0.0005 + 0.02 + 0.02 + 7.0


PACE = BodyLimits(
    max_bytes=1 << 20, deadline_seconds=30, stall_seconds=10, min_bytes_per_second=1000, window_seconds=1
)


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def arriving(pieces: list[tuple[float, bytes | None]], clock: Clock) -> Request:
    """A request whose body pieces arrive at the given times of ``clock`` (None: the client
    leaves); the last piece ends the body."""
    queue = iter(enumerate(pieces))

    async def receive() -> Message:
        index, (at, body) = next(queue)
        clock.now = at
        if body is None:
            return {"type": "http.disconnect"}
        return {"type": "http.request", "body": body, "more_body": index < len(pieces) - 1}

    return Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive)


def read_all(
    pieces: list[tuple[float, bytes | None]],
    limits: BodyLimits = PACE,
    budget: ArrivingBodies | None = None,
) -> bytes:
    async def run() -> bytes:
        clock = Clock()
        reader = BodyReader.of(arriving(pieces, clock), limits, budget or ArrivingBodies(1, 1 << 30), clock)
        return await reader.body()

    return asyncio.run(run())


def test_a_body_above_the_pace_in_every_window_is_read_whole() -> None:
    pieces: list[tuple[float, bytes | None]] = [(0.4, b"a" * 600), (0.8, b"b" * 600), (1.6, b"c" * 1200)]
    assert read_all([*pieces, (2.2, b"d" * 600)]) == b"a" * 600 + b"b" * 600 + b"c" * 1200 + b"d" * 600


def test_a_window_under_the_pace_ends_the_body_at_its_end() -> None:
    with pytest.raises(BodyTooSlow, match="slower than 1000 bytes/s over 1 s"):
        read_all([(0.5, b"a" * 500), (1.5, b"b" * 500), (1.6, b"")])


def test_a_sender_that_bursts_then_trickles_is_closed_at_the_end_of_the_window_it_slowed_in() -> None:
    async def run() -> float:
        clock = Clock()
        pieces: list[tuple[float, bytes | None]] = [(0.1, b" " * 20_000), (1.5, b" " * 10), (2.5, b" " * 10)]
        reader = BodyReader.of(
            arriving([*pieces, (2.6, b"")], clock), PACE, ArrivingBodies(1, 1 << 30), clock
        )
        with pytest.raises(BodyTooSlow):
            await reader.body()
        return clock.now

    assert asyncio.run(run()) == 2.5  # window [1, 2) brought 10 bytes


def test_a_short_body_arrives_whole_before_admission_and_the_pace_can_be_turned_off() -> None:
    off = BodyLimits(1 << 20, 30, 10, 0, 1)
    assert read_all([(0.5, b"x"), (3.5, b"y")], off) == b"xy"
    with pytest.raises(BodyTooSlow):
        read_all([(0.5, b"x"), (3.5, b"y")])


def test_a_client_gone_mid_body_is_its_own_error() -> None:
    with pytest.raises(ClientDisconnected):
        read_all([(0.1, b"[{"), (0.2, None)])


def test_the_arriving_bodies_are_capped_in_number_and_bytes() -> None:
    arriving = ArrivingBodies(max_bodies=2, max_bytes=1000)
    with arriving.admit() as one, arriving.admit() as two, arriving.admit() as three:
        assert one is not None and two is not None and three is None
        assert arriving.bodies == 2
    assert arriving.bodies == 0
    assert arriving.take(600) and not arriving.take(401) and arriving.take(400)
    assert arriving.bytes == 1000
    arriving.give_back(1000)
    assert arriving.bytes == 0


def test_a_body_that_would_cross_the_arriving_bytes_is_refused_and_gives_its_bytes_back() -> None:
    budget = ArrivingBodies(max_bodies=4, max_bytes=2000)
    assert budget.take(500)  # another body, still arriving, holds 500
    with pytest.raises(ArrivingBytesFull, match="hold 2000 bytes already"):
        read_all([(0.1, b"a" * 1000), (0.2, b"b" * 1000), (0.3, b"")], budget=budget)
    assert budget.bytes == 500  # what the refused body held is free again
    assert read_all([(0.1, b"a" * 1000), (0.2, b"b" * 500), (0.3, b"")], budget=budget) == (
        b"a" * 1000 + b"b" * 500
    )
    assert budget.bytes == 500  # a body that arrived leaves the budget: it is no longer arriving


def test_while_every_place_is_taken_a_new_body_takes_the_place_of_the_one_furthest_behind() -> None:
    clock = Clock()
    arriving = ArrivingBodies(max_bodies=2, max_bytes=1 << 20, min_pace_when_full=1000, clock=clock)
    told: list[str] = []
    with arriving.admit() as slow, arriving.admit() as fast:
        assert slow is not None and fast is not None
        slow.on_displaced = lambda: told.append("slow")
        assert arriving.take(100, slow) and arriving.take(5000, fast)
        clock.now = 2.0  # slow: 1,900 bytes behind 1,000 bytes/s; fast: 3,000 ahead
        with arriving.admit() as new:
            assert new is not None
            assert slow.displaced and not fast.displaced and told == ["slow"]
            assert (arriving.bodies, arriving.bytes) == (2, 5000)
            with arriving.admit() as refused:  # fast is ahead, new has just started: none behind
                assert refused is None
    assert (arriving.bodies, arriving.bytes) == (0, 0)  # slow's bytes were not given back twice


def test_bytes_held_by_a_body_behind_the_pace_go_to_a_body_that_needs_them() -> None:
    clock = Clock()
    arriving = ArrivingBodies(max_bodies=4, max_bytes=1000, min_pace_when_full=100, clock=clock)
    with arriving.admit() as slow:
        assert slow is not None and arriving.take(800, slow)
        clock.now = 1.0  # a burst buys time: 800 bytes are 8 s at 100 bytes/s
        with arriving.admit() as early:
            assert not arriving.take(300, early) and not slow.displaced
        clock.now = 9.0  # slow is 100 bytes behind
        assert not arriving.take(300)  # a caller that holds no place never takes one's bytes
        with arriving.admit() as greedy:  # more than slow holds: slow keeps its place
            assert not arriving.take(1001, greedy) and not slow.displaced
        with arriving.admit() as late:
            assert arriving.take(300, late) and slow.displaced
            assert (arriving.bodies, arriving.bytes) == (1, 300)
    assert (arriving.bodies, arriving.bytes) == (0, 0)


def test_without_a_pace_when_full_the_newcomer_is_refused() -> None:
    clock = Clock()
    arriving = ArrivingBodies(max_bodies=1, max_bytes=1000, clock=clock)
    with arriving.admit() as first:
        clock.now = 100.0
        with arriving.admit() as second:
            assert first is not None and not first.displaced and second is None


def test_a_body_that_loses_its_place_is_refused_at_once_and_its_bytes_are_free() -> None:
    async def run() -> None:
        clock = Clock()
        budget = ArrivingBodies(max_bodies=1, max_bytes=1 << 20, min_pace_when_full=1000, clock=clock)
        never = asyncio.Event()
        pieces = iter([b"[" * 100])

        async def receive() -> Message:
            piece = next(pieces, None)
            if piece is None:
                await never.wait()  # the rest of the body never comes
            return {"type": "http.request", "body": piece or b"", "more_body": True}

        request = Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive)
        patient = BodyLimits(
            1 << 20, deadline_seconds=60, stall_seconds=30, min_bytes_per_second=1000, window_seconds=30
        )
        reader = asyncio.ensure_future(BodyReader.of(request, patient, budget, clock).body())
        while budget.bytes < 100:
            await asyncio.sleep(0)  # until the reader has its first piece
        clock.now = 0.5  # 400 bytes behind 1,000 bytes/s; its next deadline is 29.5 s away
        with budget.admit() as newcomer:
            assert newcomer is not None
            with pytest.raises(BodyDisplaced, match="a new body took this one's place"):
                await asyncio.wait_for(reader, 5)  # woken at once, not at its next deadline
            assert (budget.bodies, budget.bytes) == (1, 0)

    asyncio.run(run())


def test_a_body_that_fails_gives_its_bytes_back() -> None:
    budget = ArrivingBodies(max_bodies=4, max_bytes=1 << 20)
    with pytest.raises(ClientDisconnected):
        read_all([(0.1, b"[{" * 100), (0.2, None)], budget=budget)
    with pytest.raises(BodyTooSlow):
        read_all([(0.5, b"a" * 500), (1.5, b"b" * 500), (1.6, b"")], budget=budget)
    assert budget.bytes == 0


def test_the_log_throttle_lets_one_line_per_interval_and_counts_the_others() -> None:
    clock = Clock()
    throttle = LogThrottle(10, clock)
    assert throttle.allow() == 0
    clock.now = 9.9
    assert [throttle.allow() for _ in range(5)] == [None] * 5
    clock.now = 10.0
    assert throttle.allow() == 5  # the line that goes out says how many were held back
    clock.now = 30.0
    assert throttle.allow() == 0


def test_a_declared_body_over_the_size_is_refused_before_it_asks_for_a_place() -> None:
    """413 (a retry would be refused again), not 503 (retry), while every place is taken; as
    simulate serve answered before both servers shared the reader."""

    async def run() -> None:
        budget = ArrivingBodies(max_bodies=1, max_bytes=1 << 20)

        async def receive() -> Message:
            raise AssertionError("nothing of the body is read")

        headers = [(b"content-length", str(PACE.max_bytes + 1).encode())]
        request = Request({"type": "http", "method": "POST", "path": "/", "headers": headers}, receive)
        with budget.admit() as taken:
            assert taken is not None
            with pytest.raises(PayloadTooLarge):
                await BodyReader.of(request, PACE, budget).body()

    asyncio.run(run())
