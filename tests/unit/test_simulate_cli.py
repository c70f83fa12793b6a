"""`kvlens simulate` on the bundled Mooncake trace: the report, the gap split, the curve, and
records that `analyze` and `compare` read back to the same numbers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvlens.cli import main
from tests.json_outputs import validate


def run_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["simulate", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


def test_reachable_pooled_and_delivered_reuse_split_the_gap(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plot = tmp_path / "curve.svg"
    result = run_json(
        capsys, "--capacity-blocks", "1000,10000", "--policy", "round_robin", "--policy", "prefix_affinity",
        "--plot", str(plot),
    )  # fmt: skip
    assert result["schema"] == "kvlens.simulate/v1"
    assert result["trace"]["requests"] == 3993 and result["trace"]["block_size"] == 512
    reachable = result["reachable"]["token_reuse_ratio"]
    assert reachable == pytest.approx(0.6504, abs=0.0001)
    for block in result["capacities"]:
        pooled = block["pooled"]["token_reuse_ratio"]
        assert pooled <= reachable + 1e-12
        for run in block["policies"]:
            gap = run["token_reuse_gap"]
            assert gap["workload"] + gap["capacity"] + gap["routing"] + run[
                "token_reuse_ratio"
            ] == pytest.approx(1)
            assert set(run["ttft_seconds"]) == {"count", "p50", "p95", "p99"}
            assert sum(run["requests_per_replica"]) == 3993
    small, large = ({r["policy"]: r for r in block["policies"]} for block in result["capacities"])
    # Routing matters once the cache is big enough to hold what affinity keeps together.
    assert large["prefix_affinity"]["token_reuse_ratio"] > 1.5 * large["round_robin"]["token_reuse_ratio"]
    assert small["round_robin"]["token_reuse_ratio"] < large["round_robin"]["token_reuse_ratio"]
    assert plot.read_text().startswith("<svg") and "prefix_affinity" in plot.read_text()


def test_each_policy_reports_the_live_funnel_in_tokens_and_in_work(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The funnel of the replicas' KV events through the fleet index: what was computed before is
    the reachable reuse (one unbounded cache), in tokens and in work; what was reused is the
    delivered reuse; each stage between them adds its lost cause."""
    result = run_json(capsys, "--replicas", "3", "--capacity-blocks", "2000", "--policy", "round_robin")
    validate(result)
    reachable = result["reachable"]
    (run,) = result["capacities"][0]["policies"]
    funnel = run["funnel"]
    stages, tokens, work = funnel["stages"], funnel["recomputed_tokens"], funnel["recomputed_work"]
    assert funnel["unit"] == "seconds" and funnel["depth_unknown_tokens"] == 0
    prompt = stages["prompt"]
    assert prompt["tokens"] == result["trace"]["prompt_tokens"]
    before = stages["computed_before"]
    assert before["tokens"] / prompt["tokens"] == pytest.approx(reachable["token_reuse_ratio"], rel=1e-12)
    assert before["work"] / prompt["work"] == pytest.approx(reachable["compute_saved_ratio"], rel=1e-9)
    reused = stages["reused"]
    assert reused["tokens"] / prompt["tokens"] == pytest.approx(run["token_reuse_ratio"], rel=1e-12)
    assert reused["work"] / prompt["work"] == pytest.approx(run["compute_saved_ratio"], rel=1e-9)
    lost = ("held_elsewhere", "evicted_here", "evicted_elsewhere")
    assert before["tokens"] == reused["tokens"] + sum(tokens.get(c, 0) for c in lost)
    reach = stages["reachable_on_some_replica"]
    assert reach["tokens"] == reused["tokens"] + tokens["held_elsewhere"]
    assert reach["work"] == pytest.approx(reused["work"] + work["held_elsewhere"], rel=1e-12)
    assert all(tokens[c] > 0 for c in lost)
    assert main(["simulate", "--replicas", "3", "--capacity-blocks", "2000", "--policy", "round_robin"]) == 0
    assert "round_robin funnel (tokens / seconds): computed before" in capsys.readouterr().out


def test_the_text_report_and_the_curve(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--capacity-blocks", "100,unbounded", "--policy", "cost_aware"]) == 0
    printed = capsys.readouterr().out
    assert "reachable (one unbounded cache): token reuse 65.0 %" in printed
    assert "capacity unbounded blocks per replica" in printed
    assert "token reuse vs capacity" in printed and "lost: capacity/routing" in printed


def test_emitted_records_read_back_to_the_same_numbers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No second formula: the records `simulate` writes give `analyze` the simulator's ratios."""
    records = tmp_path / "sim.jsonl"
    result = run_json(capsys, "--policy", "cost_aware", "--emit-records", str(records))
    (run,) = result["capacities"][0]["policies"]
    config = tmp_path / "cost.yaml"
    cost = result["fleet"]["prefill_cost_model"]
    config.write_text(yaml.safe_dump({"cost_models": {"simulated": cost}}))
    assert main(["analyze", str(records), "--config", str(config), "--json"]) == 0
    overall = json.loads(capsys.readouterr().out)["overall"]
    assert overall["requests"] == run["requests"] == 3993
    for ratio in ("request_hit_ratio", "token_reuse_ratio", "compute_saved_ratio"):
        assert overall[ratio] == pytest.approx(run[ratio], rel=1e-12), ratio


def test_compare_reads_the_arms_of_one_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    records = tmp_path / "sim.jsonl"
    run_json(capsys, "--policy", "round_robin", "--policy", "cost_aware", "--emit-records", str(records))
    assert (
        main(["compare", "--arm", f"round_robin={records}", "--arm", f"cost_aware={records}", "--json"]) == 0
    )
    compared = json.loads(capsys.readouterr().out)
    assert compared["requests"] == 3993 and compared["arms"] == ["round_robin", "cost_aware"]
    assert main(["compare", "--arm", f"round_robin={records}", "--arm", f"nope={records}"]) == 2
    assert "no records of arm 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--capacity-blocks", "lots"], "invalid literal"),
        (["--block-size", "16"], "the trace's blocks are 512 tokens, not --block-size 16"),
        (["--plot", "curve.txt"], "--plot writes .svg or .png"),
        (["--replicas", "0"], "--replicas must be >= 1"),
    ],
)
def test_bad_arguments_exit_2(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    args: list[str],
    message: str,
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["simulate", "--policy", "round_robin", *args]) == 2
    assert message in capsys.readouterr().err


def test_a_bad_trace_line_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}\n'
        '{"timestamp": 1, "input_length": 600, "output_length": 1, "hash_ids": [1, 2, 3, 4]}\n'
    )
    assert main(["simulate", str(trace)]) == 2
    assert "line 2: hash_ids has 4 blocks" in capsys.readouterr().err


def test_a_cost_model_that_is_not_in_seconds_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"cost_models": {"m": {"a": 1, "b": 0.001}}}))
    assert main(["simulate", "--config", str(config), "--model", "m"]) == 2
    assert "a cost model in seconds, not work_units" in capsys.readouterr().err


def test_simulate_run_is_the_explicit_form_of_simulate_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvlens simulate` is a group (`run`, `serve`); `kvlens simulate [TRACE]` stays `run`'s."""
    small = tmp_path / "small.jsonl"
    small.write_text(
        "".join(
            json.dumps(
                {"timestamp": i * 100, "input_length": 1500, "output_length": 8, "hash_ids": [1, 2, i]}
            )
            + "\n"
            for i in range(40)
        )
    )
    flags = [str(small), "--capacity-blocks", "4,unbounded", "--policy", "prefix_affinity"]
    implicit = run_json(capsys, *flags)
    explicit = run_json(capsys, "run", *flags)
    assert explicit == implicit and implicit["trace"]["requests"] == 40
    with pytest.raises(SystemExit) as exit:
        main(["simulate", "run", "--nope"])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: kvlens simulate run ") and "unrecognized arguments: --nope" in err
