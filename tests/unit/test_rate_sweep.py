"""``kvlens experiment quantization --rate-sweep``: which rates the sweep runs and why it stops
(a step function stands in for the endpoints: the real-process run is in
tests/integration/test_replay.py), and the attainment plot it draws."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvlens.experiment import plot, quantization, quantization_report, quantization_text
from kvlens.experiment.protocol import ExperimentError

TARGETS = quantization_report.Targets(attainment=0.9)


def endpoints_holding(limits: dict[str, float]) -> tuple[Any, list[float]]:
    """A step function whose endpoint ``name`` meets the target up to ``limits[name]`` req/s (all
    its requests) and misses it above (half of them); and the rates it was called with."""
    called: list[float] = []

    def step(rate: float) -> dict[str, dict[str, Any]]:
        called.append(rate)
        return {
            name: {
                "rate": rate,
                "attainment": 1.0 if rate <= limit else 0.5,
                "goodput_rps": rate if rate <= limit else rate / 2,
                "ttft_p50_seconds": 0.1,
                "engine_kv_usage_max": 0.2,
                "engine_token_reuse": None,
            }
            for name, limit in limits.items()
        }

    return step, called


def test_doubles_until_every_endpoint_falls_under_then_bisects_each_limit_once() -> None:
    step, called = endpoints_holding({"bf16": 5, "w4a16": 30})
    load = quantization.rate_sweep(step, ["bf16", "w4a16"], start=1, targets=TARGETS)
    # 1..32 doubling (32: both under), then halfway at each endpoint's limit: 1.5 x 4, 1.5 x 16
    assert called == [1, 2, 4, 8, 16, 32, 6, 24]
    assert [s["rate"] for s in load["steps"]["bf16"]] == [1, 2, 4, 6, 8, 16, 24, 32]
    assert load["highest_rate"] == {"bf16": 4, "w4a16": 24}
    assert load["sweep"] == {
        "start": 1,
        "max_doublings": 6,
        "bisected": [6.0, 24.0],
        "stopped": "every endpoint fell under 90% at 32 req/s",
        "never_fell_under": [],
    }


def test_the_step_limit_bounds_the_sweep() -> None:
    step, called = endpoints_holding({"bf16": 3, "w4a16": 1000})
    load = quantization.rate_sweep(step, ["bf16", "w4a16"], start=2, targets=TARGETS, max_doublings=2)
    assert called == [2, 4, 8, 3]  # w4a16 never fell under: no halfway step for it
    assert load["highest_rate"] == {"bf16": 3, "w4a16": 8}
    assert load["sweep"]["stopped"] == "the step limit (2 doublings) was reached at 8 req/s"
    assert load["sweep"]["never_fell_under"] == ["w4a16"]
    report = quantization_report.report(None, load, TARGETS, "bf16")
    words = " ".join(quantization_text.text(report).split())  # the text is wrapped to 80 columns
    assert "w4a16: highest rate meeting the targets: 8 req/s (never fell under: a lower bound)" in words


def test_a_start_every_endpoint_misses_is_the_only_step() -> None:
    step, called = endpoints_holding({"bf16": 1, "w4a16": 1})
    load = quantization.rate_sweep(step, ["bf16", "w4a16"], start=4, targets=TARGETS)
    assert called == [4]
    assert load["highest_rate"] == {"bf16": None, "w4a16": None}
    assert load["sweep"]["stopped"] == "every endpoint fell under 90% at 4 req/s"


@pytest.mark.parametrize(
    ("start", "doublings"), [(0.0, 6), (-1.0, 6), (float("nan"), 6), (1.0, -1), (1.0, 21)]
)
def test_bad_sweep_settings_are_refused(start: float, doublings: int) -> None:
    with pytest.raises(ExperimentError, match=r"--rate-sweep|--sweep-doublings"):
        quantization.check_sweep(start, doublings)


def result_of(steps: dict[str, list[tuple[float, float]]]) -> dict[str, Any]:
    return {
        "targets": {"attainment": 0.9},
        "rising_load": {"steps": {n: [{"rate": r, "attainment": a} for r, a in s] for n, s in steps.items()}},
    }


def test_the_svg_has_one_series_per_endpoint_with_its_points() -> None:
    result = result_of({"bf16": [(2, 0.5), (1, 1.0), (4, 0.25)], "w4a16": [(1, 1.0), (2, 0.95), (4, 0.6)]})
    from tests.unit.test_html_report import parse

    tree = parse(plot.svg(result))
    (svg,) = tree.find("svg")
    assert svg.attrs["role"] == "img" and "Attainment against request rate" in svg.attrs["aria-label"]
    groups = tree.find("g", **{"class": "series"})
    assert [g.attrs["data-endpoint"] for g in groups] == ["bf16", "w4a16"]
    points = {
        g.attrs["data-endpoint"]: [
            (c.attrs["data-rate"], c.attrs["data-attainment"]) for c in g.find("circle")
        ]
        for g in groups
    }
    assert points == {
        "bf16": [("1", "1"), ("2", "0.5"), ("4", "0.25")],
        "w4a16": [("1", "1"), ("2", "0.95"), ("4", "0.6")],
    }
    for group in groups:  # the line goes through the dots, left to right
        (line,) = group.find("polyline")
        dots = [f"{c.attrs['cx']},{c.attrs['cy']}" for c in group.find("circle")]
        assert line.attrs["points"].split() == dots
        xs = [float(d.split(",")[0]) for d in dots]
        assert xs == sorted(xs)
    (target,) = tree.find("line", **{"class": "target"})
    # y runs from 30 (100 %) to 320 (0 %): 90 % is 29 pixels below the top
    assert float(target.attrs["y1"]) == pytest.approx(320 - 0.9 * 290)
    assert "target 90 %" in tree.all_text()


def test_a_plot_needs_experiment_two_and_a_known_suffix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--rates or --rate-sweep"):
        plot.write_plot({"targets": {"attainment": 0.9}, "rising_load": None}, tmp_path / "p.svg")
    with pytest.raises(ExperimentError, match=r"\.svg or \.png"):
        plot.write_plot(result_of({"a": [(1, 1.0)]}), tmp_path / "p.pdf")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--rates", "1", "--plot", "p.pdf"], "--plot writes .svg or .png, not 'p.pdf'"),
        (["--plot", "p.svg"], "--plot draws experiment 2: give --rates or --rate-sweep"),
        (["--rate-sweep", "0"], "--rate-sweep takes a positive start rate"),
    ],
)
def test_the_command_refuses_a_bad_plot_or_sweep_before_any_request(
    flags: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvlens.cli import main

    # nothing listens on port 9: a request sent before the check would fail with another message
    endpoints = ["--endpoint", "a=http://127.0.0.1:9", "--endpoint", "b=http://127.0.0.1:9"]
    args = ["experiment", "quantization", "shared-prefix", "--model", "m", "--out-dir", str(tmp_path / "out")]
    assert main([*args, *endpoints, *flags]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
