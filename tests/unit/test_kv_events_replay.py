"""A replay answer's check and the replays' bounds, alone (the sockets: tests/hostile/
test_kv_event_replays.py)."""

from __future__ import annotations

from kvlens.fleet.replay import (
    MAX_REPLAY_BYTES,
    MAX_REPLAYS_PER_PERIOD,
    REPLAY_PERIOD_SECONDS,
    REPLAY_QUIET_TIMEOUTS,
    ReplayAnswer,
    ReplayBudget,
)


def frame(seq: int, payload: bytes = b"p") -> list[bytes]:
    return [seq.to_bytes(8, "big", signed=True), payload]


def test_an_answer_ends_as_soon_as_the_gap_is_filled() -> None:
    answer = ReplayAnswer(5, 8)
    assert [answer.take(frame(5)), answer.take(frame(6)), answer.take(frame(7))] == [None, None, True]
    assert [seq for seq, _ in answer.frames] == [5, 6, 7]


def test_one_wrong_frame_ends_the_answer() -> None:
    for wrong in (frame(5), frame(7), frame(1005), frame(-1), [b"\x00" * 7, b"p"], [b"only one"]):
        answer = ReplayAnswer(5, 8)
        assert answer.take(frame(5)) is None
        assert answer.take(wrong) is False


def test_an_answer_past_the_byte_cap_is_given_up() -> None:
    answer = ReplayAnswer(0, 3)
    assert answer.take(frame(0, b"x" * MAX_REPLAY_BYTES)) is None
    assert answer.take(frame(1, b"x")) is False


def test_replays_of_a_replica_are_bounded_per_period_and_after_a_failure() -> None:
    budget = ReplayBudget(timeout_seconds=2.0)
    for number in range(MAX_REPLAYS_PER_PERIOD):
        assert budget.allows(number)
        budget.asked(number)
    assert not budget.allows(REPLAY_PERIOD_SECONDS - 0.5)
    assert budget.allows(REPLAY_PERIOD_SECONDS)  # the first one left the period
    budget.failed(100.0)
    assert not budget.allows(100.0 + REPLAY_QUIET_TIMEOUTS * 2.0 - 0.5)
    assert budget.allows(100.0 + REPLAY_QUIET_TIMEOUTS * 2.0)
