"""The help of the sequence counters says what increments them (kvlens.fleet.ordering.gap_or_jump,
the one rule of a ZeroMQ publisher's sequence and TensorRT-LLM's event_id): each claim of the help
beside the behaviour that makes it true. The help of kvlens_kv_sequence_jumps_total spoke of
"jumps wider than 2^32" (of what, from where, counted when?) and named no TensorRT-LLM event; the
gaps' help called gaps "jumps"; the missed counter counts TensorRT-LLM's events, not batches."""

from __future__ import annotations

from kvlens.exporter.metrics import KV_GAPS, KV_JUMPS, KV_MISSED
from kvlens.fleet.index import FleetIndex
from kvlens.fleet.ordering import MAX_SEQUENCE_GAP, Consumer, Publisher, PublisherStatus, gap_or_jump
from tests.unit.test_kv_events_reorder import BASE, at
from tests.unit.test_kv_events_wire import FIRST, stored


def test_the_jumps_help_says_what_counts_one() -> None:
    assert MAX_SEQUENCE_GAP == 2**32
    assert KV_JUMPS.help == (
        "Messages (TensorRT-LLM: events) whose sequence number (event_id) is more than 2^32 past the "
        "one due next (the last seen + 1; 0 in a new SGLang epoch), one each: counted neither as a gap "
        "nor as missed, no replay asked, the replica's blocks kept; its numbering goes on from there."
    )
    # more than 2^32 past the one due next: a jump; exactly 2^32 skipped is a gap (all missed)
    status = PublisherStatus()
    assert gap_or_jump(status, 1, 1 + MAX_SEQUENCE_GAP) is True
    assert gap_or_jump(status, 1, 2 + MAX_SEQUENCE_GAP) is False
    assert (status.gaps, status.jumps) == (1, 1)
    c = Consumer(FleetIndex(), [Publisher("a", "tcp://a:5557")])
    asked: list[int] = []
    c.message("a", 2**63 - 1, at(BASE, stored([1], None, FIRST)), asked.append)  # the first: none due
    assert c.status["a"].jumps == 0
    c.message("a", 5, at(BASE), None, epoch=b"e1")  # a restart: its own sequence
    c.message("a", 1 + MAX_SEQUENCE_GAP + 6, at(BASE), lambda first: asked.append(first) or [])
    status = c.status["a"]
    assert (status.jumps, status.gaps, status.missed, asked) == (1, 0, 0, [])
    c.message("a", 2 + MAX_SEQUENCE_GAP + 6, at(BASE), None)  # from there: the next one
    assert (status.jumps, status.gaps, status.missed) == (1, 0, 0)
    c.message("a", 2**40, at(BASE), None, epoch=b"e2")  # a new epoch numbers from 0
    assert (status.jumps, status.restarts) == (2, 2)


def test_the_gaps_and_missed_help_say_what_counts_them() -> None:
    assert KV_GAPS.help == (
        "Messages (TensorRT-LLM: events) whose sequence number (event_id) skipped 1 to 2^32 numbers "
        "past the one due next, one each (more is a jump: kvlens_kv_sequence_jumps_total)."
    )
    assert KV_MISSED.help == (
        "Batches (TensorRT-LLM: events) lost in gaps: every number a gap skipped, unless a replay "
        "brought all of them back."
    )
    c = Consumer(FleetIndex(), [Publisher("a", "tcp://a:5557")])
    c.message("a", 0, at(BASE), None)
    c.message("a", 4, at(BASE), lambda first: [])  # 1, 2, 3 skipped, the replay brought none
    status = c.status["a"]
    assert (status.gaps, status.missed, status.jumps) == (1, 3, 0)
