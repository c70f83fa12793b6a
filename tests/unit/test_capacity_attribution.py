"""The rule that says whether a gain came from faster steps or from more KV (article 2), on
hand-made samples of ``/metrics`` and hand-made decodes, one case per verdict."""

from __future__ import annotations

import pytest

from kvlens.experiment import capacity
from kvlens.experiment.capacity import Decode, Sample, attribute


def samples(
    running: float, waiting: float, usage: float | None = 0.5, preempted: float = 0.0
) -> list[Sample]:
    """Ten scrapes, one a second from t=0, the preemption counter rising to ``preempted``."""
    return [Sample(float(t), running, waiting, preempted * t / 9, usage) for t in range(10)]


def decodes(itl: float, count: int = 6, start: float = 0.0) -> list[Decode]:
    return [Decode(start + t, start + t + 2, itl) for t in range(count)]


def test_lower_itl_at_the_same_running_batch_is_faster_steps() -> None:
    verdict = attribute((decodes(0.010), samples(4, 0)), (decodes(0.007), samples(4, 0)), ("bf16", "w4a16"))
    assert verdict.verdict == "faster steps"
    assert verdict.itl_ratio == pytest.approx(0.7)
    assert verdict.matched_requests == 6
    assert verdict.reasons[0] == (
        "ITL at a matched running batch: w4a16 0.70x bf16's over 6 matched requests "
        "(lower beyond the 5% noise floor)"
    )


def test_a_gain_within_the_noise_floor_is_not_faster_steps() -> None:
    verdict = attribute((decodes(0.010), samples(4, 0)), (decodes(0.0096), samples(4, 0)))
    assert verdict.verdict == "neither"


def test_more_running_at_once_while_the_baseline_queued_is_capacity_not_faster_steps() -> None:
    """The issue's case: the same weights and a higher concurrency limit. The candidate's ITL is
    higher (it runs a larger batch), and at the batch both ran it is the same."""
    base = (decodes(0.010), samples(4, 6, usage=0.3))
    cand_samples = samples(4, 0)[:5] + [Sample(float(t), 10, 0, 0.0, 0.5) for t in range(5, 10)]
    cand = (decodes(0.010, start=0.0)[:3] + decodes(0.013, count=3, start=6.0), cand_samples)
    verdict = attribute(base, cand, ("a", "b"))
    assert verdict.verdict == "more capacity"
    assert "more ran at once: b 10 running (p95) against 4 while up to 6 waited on a" in verdict.reasons


def test_fewer_preemptions_and_fewer_waiting_for_memory_are_capacity() -> None:
    base = (decodes(0.010), samples(6, 3, usage=0.97, preempted=5))
    cand = (decodes(0.0099), samples(6, 1, usage=0.6, preempted=0))
    verdict = attribute(base, cand)
    assert verdict.verdict == "more capacity"
    assert "fewer preempted: 0 against 5 on baseline" in verdict.reasons
    assert any(
        reason.startswith("fewer waited for memory: 1.0 waiting on average against 3.0")
        for reason in verdict.reasons
    )


def test_fewer_waiting_without_a_full_cache_is_not_capacity() -> None:
    """Faster steps empty a line too: the baseline's line was not for memory."""
    verdict = attribute(
        (decodes(0.010), samples(6, 3, usage=0.4)), (decodes(0.006), samples(6, 0, usage=0.4))
    )
    assert verdict.verdict == "faster steps"


def test_faster_steps_and_more_capacity_are_both() -> None:
    base = (decodes(0.010), samples(6, 3, usage=0.95, preempted=4))
    cand = (decodes(0.006), samples(6, 0, usage=0.7))
    assert attribute(base, cand).verdict == "both"


@pytest.mark.parametrize("missing", ["baseline", "candidate"])
def test_missing_metrics_cannot_tell(missing: str) -> None:
    blank = [Sample(float(t), None, None, None, None) for t in range(10)]
    base = (decodes(0.010), blank if missing == "baseline" else samples(4, 0))
    cand = (decodes(0.005), blank if missing == "candidate" else samples(4, 0))
    verdict = attribute(base, cand)
    assert verdict.verdict == "cannot tell"
    assert verdict.reasons == [f"{missing} reported no num_requests_running / num_requests_waiting"]
    assert attribute((decodes(0.01), []), (decodes(0.005), [])).verdict == "cannot tell"


def test_no_matched_batch_and_no_capacity_sign_cannot_tell() -> None:
    verdict = attribute((decodes(0.010), samples(2, 0)), (decodes(0.005), samples(8, 0)))
    assert verdict.verdict == "cannot tell"
    assert verdict.itl_ratio is None


def test_a_request_without_a_sample_inside_takes_the_nearest_within_the_gap() -> None:
    only = [Sample(10.0, 5, 0, 0, 0.1)]
    assert capacity.batch_during(Decode(10.2, 10.4, 0.01), only) == 5
    assert capacity.batch_during(Decode(12.0, 12.2, 0.01), only) is None
    assert capacity.batch_during(Decode(9.0, 11.0, 0.01), [*only, Sample(10.5, 7, 0, 0, 0.1)]) == 6


def test_output_tokens_per_second_spans_first_arrival_to_last_end() -> None:
    records = [
        {"arrival_time": 100.0, "e2e_seconds": 2.0, "output_tokens": 10},
        {"arrival_time": 101.0, "e2e_seconds": 3.0, "output_tokens": 30},
        {"arrival_time": 101.0, "error": "http_500"},
    ]
    assert capacity.output_tokens_per_second(records) == 10.0
    assert capacity.output_tokens_per_second([]) is None


def test_the_byte_model_step_is_bandwidths() -> None:
    """Article 2's golden values: W16 14 GiB, W4 4 GiB, K 1 GiB (8192 tokens of 128 KiB), 1 TiB/s."""
    gib = 1024**3
    model = capacity.ByteModel({"bf16": 14 * gib, "w4a16": 4 * gib}, 1024 * gib, 128 * 1024)
    assert model.step_seconds("bf16", 8, 8192) == pytest.approx(0.02148, abs=1e-5)
    assert model.step_seconds("w4a16", 8, 8192) == pytest.approx(0.01172, abs=1e-5)
    assert model.step_seconds("other", 8, 8192) is None
