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
    assert verdict.matched_requests == 4  # the four that decoded beside two others on both
    assert verdict.reasons[0] == (
        "ITL at a matched running batch: w4a16 0.70x bf16's over 4 matched requests "
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
    assert (
        "more ran at once: b 10 running (p95) against 4, a held there with a line in 10 samples "
        "(up to 6 waiting)" in verdict.reasons
    )


def test_a_line_seen_once_at_the_start_is_not_a_limit() -> None:
    """A burst sent at once queues behind the prefill lane for a moment: one sample with a line."""
    base = (
        decodes(0.010),
        [Sample(0.0, 5, 11, 0, 0.3)] + [Sample(float(t), 16, 0, 0, 0.3) for t in range(1, 10)],
    )
    cand = (decodes(0.010), samples(18, 0))
    assert attribute(base, cand).verdict == "neither"


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
    one_at_a_time = [Decode(2.0 * t, 2.0 * t + 1, 0.010) for t in range(6)]
    all_at_once = [Decode(0.0, 2.0, 0.005) for _ in range(6)]
    verdict = attribute((one_at_a_time, samples(2, 0)), (all_at_once, samples(2, 0)))
    assert verdict.verdict == "cannot tell"
    assert verdict.itl_ratio is None


def test_a_requests_batch_is_how_many_decoded_beside_it_on_average() -> None:
    windows = [Decode(0.0, 4.0, 0.01), Decode(1.0, 3.0, 0.01), Decode(2.0, 6.0, 0.01), Decode(7.0, 7.0, 0.01)]
    # the first: alone 1 s, with the second 1 s, with the second and third 1 s, with the third 1 s
    assert capacity.batches(windows) == [(1 + 2 + 3 + 2) / 4, (2 + 3) / 2, (3 + 2 + 1 + 1) / 4, 1.0]
    assert capacity.batches([]) == []


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


def test_the_sampler_reads_the_scheduler_gauges_by_vllms_names_summed_over_engines() -> None:
    from pathlib import Path

    from kvlens.experiment.engine_metrics import engine_values

    text = (Path(__file__).parent.parent / "fixtures" / "vllm-0.33-metrics.prom").read_text()
    values = engine_values(text)
    assert values["running"] == 5.0  # engines 0 and 1: 3 + 2
    exposition = (
        '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{engine="0"} 4.0\n'
        '# TYPE vllm:num_preemptions counter\nvllm:num_preemptions_total{engine="0"} 7.0\n'
        'vllm:num_preemptions_total{engine="1"} 2.0\n'
    )
    assert engine_values(exposition) == {"waiting": 4.0, "preemptions": 9.0}
    assert engine_values("# an engine with other names\nsglang:num_running_reqs 3\n") == {}


def test_an_engine_sample_comes_back_from_its_step_file_as_it_was() -> None:
    """A step's sample is kept in its .step.json and read back on resume or merge: the series as
    Samples again (as dicts or lists the capacity rule could not read them)."""
    import orjson

    from kvlens.experiment.engine_metrics import EngineSample

    sample = EngineSample(
        0.95, 10.0, 4.0, 3, [Sample(1.5, 2.0, 1.0, 0.0, 0.9), Sample(1.7, 3.0, None, 1.0, None)]
    )
    back = EngineSample.from_json(orjson.loads(orjson.dumps(sample.as_json())))
    assert back == sample and back.token_reuse == 0.4
    assert EngineSample.from_json(None) == EngineSample()
    for bad in ({"series": [[1.0]], "queries": 0, "hits": 0, "scrapes": 0}, {"queries": 0}, [1, 2]):
        with pytest.raises(ValueError, match="not an engine sample"):
            EngineSample.from_json(bad)


def test_the_byte_model_of_a_later_run_adds_to_the_one_kept_in_the_out_dir() -> None:
    """One endpoint at a time: the first run gives its weights and the GPU's figures, a later one
    its own weights; a flag given again replaces the kept value."""
    first = capacity.byte_model_from(["bf16=16GB"], "3TB/s", "128KiB", 1.5, ["bf16"])
    kept = capacity.byte_model_of(capacity.byte_model_json(first))
    assert kept == first
    later = capacity.byte_model_from(["w4a16=5GB"], None, None, None, ["bf16", "w4a16"], kept)
    assert later == capacity.ByteModel({"bf16": 16e9, "w4a16": 5e9}, 3e12, 131_072, 0.0015)
    again = capacity.byte_model_from(None, "4TB/s", None, 0.0, ["bf16", "w4a16"], later)
    assert again == capacity.ByteModel({"bf16": 16e9, "w4a16": 5e9}, 4e12, 131_072, 0.0)
    assert capacity.byte_model_from(None, None, None, None, ["bf16"]) is None
    with pytest.raises(ValueError, match="for an endpoint of this run or of --out-dir \\(bf16\\)"):
        capacity.byte_model_from(["fp8=8GB"], "3TB/s", "128KiB", None, ["bf16"])
    with pytest.raises(ValueError, match="needs --bandwidth and --kv-bytes-per-token"):
        capacity.byte_model_from(["bf16=16GB"], "3TB/s", None, None, ["bf16"])
    with pytest.raises(ValueError, match="not a byte model"):
        capacity.byte_model_of({"weight_bytes": {"bf16": -1}, "bandwidth_bytes_per_second": 1})
