"""A request whose client leaves (the real-time server's abort): waiting, it leaves the line;
decoding, it frees its blocks at once (they stay cached); prefilling, it ends with its first
token. And the reset of the prefix cache keeps what running requests hold."""

from __future__ import annotations

import pytest

from kvlens.definitions import CostModel
from kvlens.simulate.cache import PrefixCache
from kvlens.simulate.replica import Job, Replica, ServiceModel
from kvlens.simulate.trace import TraceRequest

BLOCK = 1000
LINEAR = ServiceModel(prefill=CostModel(a=4e-5, b=0.0, unit="seconds"))  # 1000 tokens: 40 ms


def job(index: int, blocks: tuple[object, ...], output: int = 100, tokens: int = 2000) -> Job:
    return Job(TraceRequest(index, 0.0, tokens, output, blocks), index, BLOCK)


def test_abort_while_waiting_leaves_the_line_and_its_expected_wait() -> None:
    done: list[Job] = []
    replica = Replica(0, None, BLOCK, LINEAR, done)
    first, second = job(0, ("a", "b")), job(1, ("c", "d"))
    second.estimate = 0.08
    replica.enqueue(first, 0.0)
    replica.enqueue(second, 0.0)
    assert replica.expected_wait(0.0) == pytest.approx(0.08 + 0.08)
    replica.abort(second, 0.01)
    assert done == [second] and second.finish == 0.01 and not replica.waiting
    assert replica.expected_wait(0.01) == pytest.approx(0.07)
    assert "c" not in replica.cache  # it never held anything


def test_abort_while_decoding_frees_its_blocks_now_and_they_stay_cached() -> None:
    done: list[Job] = []
    replica = Replica(0, 2, BLOCK, LINEAR, done)
    running = job(0, ("a", "b"), output=10_000)
    replica.enqueue(running, 0.0)
    replica.advance(0.1)  # prefill ended at 0.08; decoding for many seconds
    assert running.first_token == pytest.approx(0.08) and running.finish > 10
    assert replica.cache.held_blocks == 2
    replica.abort(running, 0.1)
    assert done == [running] and running.finish == 0.1
    assert replica.cache.held_blocks == 0 and "a" in replica.cache and "b" in replica.cache
    assert replica.context_tokens == 0 and replica.running == 0
    # The next request with that prefix finds it (a full cache of 2 blocks, both evictable).
    again = job(1, ("a", "b", "c"), tokens=3000)
    replica.enqueue(again, 0.2)
    assert again.cached_tokens == 2 * BLOCK


def test_abort_while_prefilling_ends_with_the_first_token() -> None:
    done: list[Job] = []
    replica = Replica(0, None, BLOCK, LINEAR, done)
    prefilling = job(0, ("a", "b"), output=500)
    replica.enqueue(prefilling, 0.0)
    replica.abort(prefilling, 0.01)
    assert done == []  # the prefill runs to its end
    replica.advance(1.0)
    assert done == [prefilling] and prefilling.finish == pytest.approx(0.08)
    assert prefilling.output_tokens == 1 and replica.context_tokens == 0


def test_drop_free_keeps_held_blocks() -> None:
    cache = PrefixCache(None)
    _, held = cache.acquire(("a", "b"), 2)
    cache.release(("a", "b"), held)
    cache.acquire(("c",), 1)
    assert cache.drop_free() == 2
    assert "a" not in cache and "c" in cache and cache.held_blocks == 1


def test_departures_from_a_long_line_keep_the_others_order_and_counts() -> None:
    # a departure marks its job and the line drops it when it comes to the front (or when most
    # of the line has gone): no scan of the line per departure
    done: list[Job] = []
    replica = Replica(0, None, BLOCK, ServiceModel(prefill=LINEAR.prefill, max_running=1), done)
    jobs = [job(i, (f"b{i}",), output=1) for i in range(10)]
    for each in jobs:
        each.estimate = 0.04
        replica.enqueue(each, 0.0)
    assert (replica.queued, replica.outstanding) == (9, 10)  # job 0 is prefilling
    for leaving in (9, 5, 3, 6):
        replica.abort(jobs[leaving], 0.01)
    assert (replica.queued, replica.outstanding) == (5, 6)
    assert replica.expected_wait(0.01) == pytest.approx(0.07 + 5 * 0.04)  # 2000 tokens: 80 ms
    replica.advance(10.0)
    served = [j.order for j in done if j.order not in (9, 5, 3, 6)]
    assert served == [0, 1, 2, 4, 7, 8]  # first come, first served, the departed skipped
    assert [j.order for j in done[:4]] == [9, 5, 3, 6]  # the departed finished as they left
    assert all(jobs[i].start == jobs[i].finish == 0.01 for i in (9, 5, 3, 6))
    assert (replica.queued, replica.outstanding, len(replica.waiting)) == (0, 0, 0)


def test_a_line_mostly_departed_is_rebuilt_to_its_size() -> None:
    done: list[Job] = []
    replica = Replica(0, None, BLOCK, ServiceModel(prefill=LINEAR.prefill, max_running=1), done)
    jobs = [job(i, (f"b{i}",)) for i in range(9)]  # job 0 runs, eight wait
    for each in jobs:
        replica.enqueue(each, 0.0)
    for leaving in jobs[1:5]:
        replica.abort(leaving, 0.01)
    assert len(replica.waiting) == 8  # half the line departed: kept, marked
    replica.abort(jobs[5], 0.01)
    assert [j.order for j in replica.waiting] == [6, 7, 8]
    assert replica.queued == 3
