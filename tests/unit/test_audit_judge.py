"""The isolation audit's judgement of made pairs: a hit across scopes is a leak whatever its
control; a miss passes only beside a hit of its control; failures and silence are inconclusive."""

from __future__ import annotations

import asyncio

import pytest

from kvlens.audit.isolation import Pacer, Plan, Sent, judge
from kvlens.errors import InputError

PLAN = Plan(block_size=16, repeats=3)
FIVE = Plan(block_size=16, repeats=5)
MISS, HIT = Sent(0.030, 0), Sent(0.002, 64)


def verdicts(pairs: dict[str, list[tuple[Sent, Sent]]], plan: Plan = PLAN) -> dict[str, str]:
    return {result.case: result.verdict for result in judge(plan, pairs)}


def test_a_hit_across_salts_is_a_leak_even_without_its_control() -> None:
    got = verdicts(
        {"same_salt": [(MISS, MISS)] * 3, "different_salt": [(MISS, MISS), (MISS, HIT), (MISS, MISS)]}
    )
    assert got == {"same_salt": "inconclusive", "different_salt": "leak", "timing": "inconclusive"}


def test_failed_pairs_and_missing_counts_are_inconclusive() -> None:
    failed = Sent(None, None, "http_500")
    silent = Sent(0.002, None)  # no cached_tokens in the usage
    got = verdicts(
        {"same_salt": [(MISS, HIT), (MISS, failed), (failed, HIT)], "no_salt": [(MISS, silent)] * 3}
    )
    assert got == {"same_salt": "inconclusive", "no_salt": "inconclusive"}
    (same, _) = judge(PLAN, {"same_salt": [(MISS, HIT), (MISS, failed), (failed, HIT)], "no_salt": []})
    assert same.note == "only 1 of 3 pairs answered (first error: http_500)"


def test_the_same_salt_must_hit_in_most_repeats() -> None:
    assert verdicts({"same_salt": [(MISS, HIT), (MISS, HIT), (MISS, MISS)]})["same_salt"] == "pass"
    assert verdicts({"same_salt": [(MISS, HIT), (MISS, MISS), (MISS, MISS)]})["same_salt"] == "inconclusive"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"repeats": 0}, "--repeats must be 1 to 30"),
        ({"repeats": 31}, "--repeats must be 1 to 30"),
        ({"rate": float("nan")}, "--rate must be a positive number"),
        ({"salt_field": "prompt"}, "--salt-field must name a field of its own"),
        ({"salt_field": ""}, "--salt-field must name a field of its own"),
        ({"block_size": 0}, "the block size must be 1 to 32,768 tokens"),
    ],
)
def test_plans_that_cannot_probe_are_refused(changes: dict[str, object], message: str) -> None:
    with pytest.raises(InputError, match=message):
        Plan(**{"block_size": 16, **changes})  # type: ignore[arg-type]


def test_a_canary_is_at_least_four_whole_blocks_and_a_token() -> None:
    assert Plan(block_size=512, canary_tokens=100).prompt_tokens == 4 * 512 + 1
    assert Plan(block_size=16, canary_tokens=1000).prompt_tokens == 63 * 16 + 1


def test_the_pacer_spaces_request_starts_by_the_rate() -> None:
    now = [0.0]
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    async def three() -> None:
        pacer = Pacer(4.0, clock=lambda: now[0], sleep=sleep)
        for _ in range(3):
            await pacer.wait()

    asyncio.run(three())
    assert slept == [0.25, 0.25]


def timed(ms: float, cached: int = 0) -> Sent:
    return Sent(ms / 1000, cached)


def timing_of(suspects: list[float]) -> tuple[str, int]:
    """The timing verdict when hits take ~1 ms and misses ~50 ms, the different salt's second
    requests taking ``suspects`` ms and reporting no cached token."""
    misses = [50.0, 51.0, 52.0, 53.0, 54.0]
    pairs = {
        "same_salt": [(timed(m), timed(1.0 + i / 10, 64)) for i, m in enumerate(misses)],
        "different_salt": [(timed(m), timed(s)) for m, s in zip(misses, suspects, strict=True)],
        "salt_vs_none": [(timed(m), timed(m)) for m in misses],
    }
    (timing,) = [result for result in judge(FIVE, pairs) if result.case == "timing"]
    return timing.verdict, timing.hits


def test_timing_sees_a_hidden_hit_through_a_loaded_hosts_delays() -> None:
    """Two of five suspects delayed to a miss's time (a loaded host) still leave a leak: the
    rank test alone (p = 0.026 against 15 misses) would have called it a pass."""
    assert timing_of([1.1, 1.2, 1.3, 1.4, 1.5]) == ("leak", 5)
    assert timing_of([1.1, 52.5, 1.3, 53.5, 1.5]) == ("leak", 3)
    assert timing_of([50.5, 52.5, 1.3, 53.5, 51.5]) == ("pass", 1)  # one fast one is no majority
    assert timing_of([50.5, 52.5, 51.3, 53.5, 51.5]) == ("pass", 0)


def test_timing_is_inconclusive_when_a_hit_is_not_faster() -> None:
    misses = [50.0, 51.0, 52.0, 53.0, 54.0]
    pairs = {
        "same_salt": [(timed(m), timed(m + 0.5, 64)) for m in misses],
        "different_salt": [(timed(m), timed(1.0)) for m in misses],
    }
    (timing,) = [result for result in judge(FIVE, pairs) if result.case == "timing"]
    assert timing.verdict == "inconclusive" and timing.note.startswith("a hit is not measurably faster")
    assert timing.hits == 0  # no gap: no suspect is like a hit rather than a miss


def test_timing_without_a_cached_hit_is_inconclusive_never_pass() -> None:
    # prefix caching off, on a loaded host: the same salt's second requests are misses by their
    # cached tokens, yet faster than the first ones (a warm connection, a quieter moment); timed
    # against those as if they were hits, honest-looking suspects read "pass" (seen in CI)
    warm_miss = Sent(0.010, 0)
    pairs = {
        "same_salt": [(Sent(0.030 + i / 1000, 0), warm_miss) for i in range(5)],
        "different_salt": [(Sent(0.031 + i / 1000, 0), Sent(0.029 + i / 1000, 0)) for i in range(5)],
        "salt_vs_none": [(Sent(0.032 + i / 1000, 0), Sent(0.030, 0)) for i in range(5)],
    }
    got = verdicts(pairs, FIVE)
    assert got["same_salt"] == "inconclusive"
    assert got["timing"] == "inconclusive"
