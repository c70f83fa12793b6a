"""The reorder window across replicas and the timestamp rule, on :class:`Consumer` alone with an
injected clock: one replica's timestamps (not a number, infinite, negative, far ahead of kvlens's
clock) or its flood of late batches never hold back another replica's batches past the window,
and a sequence jump no publisher could have made is one jump, not 2^62 missed batches."""

from __future__ import annotations

import math
import time
from typing import Any

import pytest

from kvlens.fleet.index import FleetIndex
from kvlens.fleet.ordering import MAX_SEQUENCE_GAP, Consumer, Publisher
from kvlens.fleet.reorder import MAX_TIMESTAMP_LEAD_SECONDS
from tests import vllm_kv_events as vllm
from tests.unit.test_kv_events_wire import FIRST, SECOND, stored

BASE = 1_764_600_000.0  # a batch's ts, as vLLM stamps it (time.time())


def at(ts: float, *events: Any) -> bytes:
    return vllm.encode(vllm.KVEventBatch(ts=ts, events=list(events), data_parallel_rank=0))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def windowed(clock: Clock, window: float = 0.5) -> Consumer:
    return Consumer(
        FleetIndex(),
        [Publisher("bad", "tcp://bad:5557"), Publisher("honest", "tcp://honest:5557")],
        reorder_seconds=window,
        clock=clock,
        wall_clock=lambda: BASE,
    )


@pytest.mark.parametrize("ts", [math.nan, math.inf, -math.inf, -1.0, BASE + MAX_TIMESTAMP_LEAD_SECONDS + 1])
def test_an_absurd_timestamp_never_holds_back_another_replica(ts: float) -> None:
    clock = Clock()
    c = windowed(clock)
    c.message("bad", 0, at(ts, stored([1], None, FIRST)), None)
    c.message("honest", 0, at(BASE, stored([2], None, FIRST)), None)
    c.message("honest", 1, at(BASE + 0.6, stored([3], None, SECOND)), None)  # 0.6 s newer
    assert c.status["honest"].batches == 1  # the first released by a newer batch, not idleness
    assert c.status["bad"].bad_timestamps == 1
    c.release(everything=True)
    assert (c.status["bad"].batches, c.status["bad"].events["BlockStored"]) == (1, 1)  # events used
    assert c.status["bad"].malformed_payloads == 0


def test_a_timestamp_far_ahead_does_not_release_the_others_early() -> None:
    """Before: one batch stamped an hour ahead became the newest, and every batch of every replica
    was released at once from then on (no reordering left, shards disagreeing)."""
    clock = Clock()
    c = windowed(clock)
    c.message("honest", 0, at(BASE, stored([2], None, FIRST)), None)
    c.message("bad", 0, at(BASE + 3600, stored([1], None, FIRST)), None)
    c.message("honest", 1, at(BASE + 0.1, stored([3], None, SECOND)), None)
    assert (c.status["honest"].batches, c.status["bad"].batches) == (0, 0)  # all within the window
    c.message("honest", 2, at(BASE + 0.55, stored([4], None, [5] * 4)), None)
    assert (c.status["honest"].batches, c.status["bad"].batches) == (1, 1)  # ordered as of BASE


def test_a_timestamp_within_the_lead_is_used() -> None:
    c = windowed(Clock())
    c.message("bad", 0, at(BASE + MAX_TIMESTAMP_LEAD_SECONDS, stored([1], None, FIRST)), None)
    assert c.status["bad"].bad_timestamps == 0


def test_a_flood_of_late_batches_never_holds_another_replicas_batch_past_the_window() -> None:
    """A replica whose batches are stamped far behind keeps the thread busy (never idle); the
    other replica's last batch, with nothing newer after it, is applied once it has waited the
    window by kvlens's clock. Before: only an idle moment released it."""
    clock = Clock()
    c = windowed(clock)
    c.message("honest", 0, at(BASE, stored([2], None, FIRST)), None)
    for seq in range(40):
        clock.now = seq * 0.0125
        c.message("bad", seq, at(BASE - 100, vllm.BlockRemoved([9], "GPU")), None)
    assert (c.status["honest"].batches, c.status["bad"].batches) == (0, 40)  # 0.4875 s waited
    clock.now = 0.5
    c.message("bad", 40, at(BASE - 100, vllm.BlockRemoved([9], "GPU")), None)
    assert c.status["honest"].batches == 1


def test_each_batch_waits_at_most_the_window_whatever_the_timestamps() -> None:
    clock = Clock()
    c = windowed(clock)
    for seq in range(100):
        clock.now = seq * 0.125  # binary fractions: exact sums
        # within the window of each other: no batch is ever newer enough to release another
        c.message("honest", seq, at(BASE + seq * 1e-3, vllm.BlockRemoved([8], "GPU")), None)
        c.message("bad", seq, at(math.nan, vllm.BlockRemoved([9], "GPU")), None)  # as of the above
        # everything read 0.5 s ago or earlier (four messages back) is applied
        assert c.status["honest"].batches == c.status["bad"].batches == max(0, seq - 3)


def test_a_replicas_batches_keep_their_order_through_a_restart() -> None:
    """A restart's clear waits in the replica's own queue: it can never be applied before that
    replica's batches read earlier (before: one heap by timestamp put a clear stamped earlier,
    after a clock step back at the restart, before them, and the old blocks came back)."""
    c = windowed(Clock())
    c.message("bad", 0, at(BASE + 5, stored([1], None, FIRST)), None)
    c.message("bad", 0, at(BASE, stored([2], None, SECOND)), None)  # restarted, clock stepped back
    c.release(everything=True)
    assert c.index.snapshot().held[("bad", "GPU")] == 1


def test_a_sequence_jump_no_publisher_makes_is_one_jump_not_missed_batches() -> None:
    c = Consumer(FleetIndex(), [Publisher("a", "tcp://a:5557")])
    c.message("a", 0, at(BASE), None)
    c.message("a", 1 + MAX_SEQUENCE_GAP, at(BASE), lambda first: [])  # the widest gap: missed
    c.message("a", 2**63 - 1, at(BASE), lambda first: [])  # as from a publisher's garbage
    status = c.status["a"]
    assert (status.gaps, status.missed, status.jumps, status.replays) == (1, MAX_SEQUENCE_GAP, 1, 0)
    assert status.batches == 3


def test_the_default_wall_clock_is_the_real_one() -> None:
    c = Consumer(FleetIndex(), [Publisher("a", "tcp://a:5557")])
    c.message("a", 0, at(time.time()), None)
    c.message("a", 1, at(time.time() + 3600), None)
    assert c.status["a"].bad_timestamps == 1
