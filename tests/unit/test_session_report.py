"""Reuse per session and the theoretical reuse beside the delivered one (analysis/sessions.py):
exact figures of a small hand-made run."""

from __future__ import annotations

from kvlens.analysis.sessions import arm_lines, session_report
from kvlens.records import batch_from_objects


def record(session: str | None, n: int, h: int, reusable: int | None = None) -> dict[str, object]:
    out: dict[str, object] = {"prompt_tokens": n, "cached_tokens": h}
    if session is not None:
        out["session_id"] = session
    if reusable is not None:
        out["trace_reusable_tokens"] = reusable
    return out


def test_per_session_ratios_distribution_and_the_worst() -> None:
    batch = batch_from_objects(
        [
            record("a", 100, 0, 0),
            record("a", 200, 100, 100),  # a: 100 / 300 delivered of 100 theoretical
            record("b", 100, 0, 0),
            record("b", 100, 0, 60),  # b: nothing delivered of 60
            record("c", 400, 300, 300),  # c: all delivered
        ]
    ).batch
    report = session_report(batch)
    assert report is not None
    assert report["run"] == {
        "requests": 5,
        "prompt_tokens": 900,
        "cached_tokens": 400,
        "request_hit_ratio": 2 / 5,
        "token_reuse_ratio": 400 / 900,
        "theoretical_token_reuse_ratio": 460 / 900,
        "delivered_of_theoretical": 400 / 460,
    }
    assert report["sessions"] == 3
    assert [w["session_id"] for w in report["worst"]] == ["b", "a", "c"]
    assert [w["token_reuse_ratio"] for w in report["worst"]] == [0.0, 100 / 300, 300 / 400]
    assert report["worst"][0]["theoretical_token_reuse_ratio"] == 60 / 200
    assert report["token_reuse_ratio"]["min"] == 0.0 and report["token_reuse_ratio"]["p50"] == 100 / 300
    assert arm_lines({"x": report})[0] == (
        "x: Token reuse delivered 44.4 % of a theoretical 51.1 % (unbounded cache, the trace's hash ids; "
        "87.0 % of it delivered)"
    )


def test_records_without_sessions_or_theoretical_say_nothing() -> None:
    assert session_report(batch_from_objects([record(None, 10, 5)]).batch) is None
    only_theoretical = session_report(batch_from_objects([record(None, 10, 5, 8)]).batch)
    assert only_theoretical is not None and only_theoretical["sessions"] == 0
    assert only_theoretical["run"]["theoretical_token_reuse_ratio"] == 0.8
