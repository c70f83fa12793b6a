"""Calibration against what an H200 measured (tests/fixtures/h200): the remaining-work model wins
over C(m) and linear-only, b/a lands near the reference, and what the fit says about the saved
fraction is reported beside the measurement. Bad tables get errors that name the line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from kvlens.analysis import calibration
from kvlens.cli import main
from kvlens.config import load_settings
from kvlens.errors import InputError

POINTS = Path(__file__).resolve().parent.parent / "fixtures" / "h200" / "prefill_h200.csv"
LAYERS = {"llama-3.1-8b-shape": 32, "qwen2.5-1.5b-shape": 28}
# gpu-measurements.md: relative-error NNLS of the per-layer points.
REFERENCE = {
    "llama-3.1-8b-shape": {"pairs_per_token": 13_700, "r2": 0.983, "suffix_r2": 0.897, "linear_r2": 0.812},
    "qwen2.5-1.5b-shape": {"pairs_per_token": 10_500, "r2": 0.963, "suffix_r2": 0.861, "linear_r2": 0.782},
}


def fits() -> dict[str, calibration.Fit]:
    return {p.name: calibration.fit_points(p) for p in calibration.read_points(POINTS, LAYERS.get)}


@pytest.mark.parametrize("shape", sorted(REFERENCE))
def test_the_shipped_points_pick_the_remaining_model_near_the_reference(shape: str) -> None:
    fit, reference = fits()[shape], REFERENCE[shape]
    assert fit.usable, fit.reason
    assert fit.requests == 42
    assert fit.a / fit.b == pytest.approx(reference["pairs_per_token"], rel=0.2)
    assert fit.r2 == pytest.approx(reference["r2"], abs=0.002)
    assert fit.alternatives["suffix_only"].r2 == pytest.approx(reference["suffix_r2"], abs=0.002)
    assert fit.alternatives["linear_only"].r2 == pytest.approx(reference["linear_r2"], abs=0.002)
    assert fit.cost_model().unit == "seconds"


def test_per_layer_times_are_scaled_by_the_layer_count() -> None:
    scaled = fits()["llama-3.1-8b-shape"]
    per_layer = {p.name: calibration.fit_points(p) for p in calibration.read_points(POINTS, lambda _: None)}
    unscaled = per_layer["llama-3.1-8b-shape"]
    assert unscaled.per_layer and not unscaled.usable and "layer count is unknown" in unscaled.reason
    assert scaled.a == pytest.approx(32 * unscaled.a, rel=1e-6)
    assert scaled.b == pytest.approx(32 * unscaled.b, rel=1e-6)
    assert calibration.cost_model_file([unscaled]) == {"cost_models": {}}


def test_saved_fraction_measured_below_flops_at_8192_4096() -> None:
    """The numbers of docs/definitions.md: time saved is below FLOPs saved for a request prefilled alone."""
    expected = {  # measured from the table; FLOPs from the shape; the calibrated cost model (no c)
        "llama-3.1-8b-shape": (0.389, 0.467, 0.442),
        "qwen2.5-1.5b-shape": (0.321, 0.447, 0.430),
    }
    for shape, (measured, flops, cost_model) in expected.items():
        (saved,) = [s for s in fits()[shape].saved if (s.n, s.h) == (8192, 4096)]
        assert saved.measured == pytest.approx(measured, abs=0.0005)
        assert saved.flops == pytest.approx(flops, abs=0.0005)
        assert saved.cost_model == pytest.approx(cost_model, abs=0.0005)
        assert saved.measured < saved.cost_model < saved.flops


def test_times_that_follow_c_of_m_are_refused() -> None:
    """A source whose cached tokens are not the engine's (prefill does not see the prefix)."""
    rng = np.random.default_rng(3)
    n = rng.integers(256, 16_384, 400)
    h = (rng.random(400) * n).astype(np.int64)
    m = (n - h).astype(np.float64)
    seconds = (2e-5 * m + 2e-9 * m * (m + 1) / 2 + 0.004) * (1 + 0.02 * rng.standard_normal(400))
    fit = calibration.fit("m", n, h, seconds)
    assert not fit.usable
    assert "suffix only model fits better" in fit.reason
    assert calibration.cost_model_file([fit]) == {"cost_models": {}}


def test_prefill_points_calibrate_a_cost_model_in_seconds_the_sidecar_accepts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "shapes.yaml"
    config.write_text(
        yaml.safe_dump(
            {"model_shapes": {"llama-3.1-8b-shape": {"layers": 32, "kv_heads": 8, "head_dim": 128}}}
        )
    )
    out = tmp_path / "cost.yaml"
    args = ["analyze", "--prefill-points", str(POINTS), "--config", str(config), "--calibrate", str(out)]
    assert main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    by_model = {fit["model"]: fit for fit in report["calibration"]}
    assert by_model["llama-3.1-8b-shape"]["usable"] and not by_model["qwen2.5-1.5b-shape"]["usable"]
    written = yaml.safe_load(out.read_text())["cost_models"]
    assert list(written) == ["llama-3.1-8b-shape"]
    cost = load_settings(out).cost_model_for("llama-3.1-8b-shape")
    assert cost.unit == "seconds"
    assert cost.a / cost.b == pytest.approx(13_700, rel=0.2)

    assert main(args[:3]) == 0  # the terminal report: no record sections, the comparison shown
    printed = capsys.readouterr().out
    assert "requests from" not in printed
    assert "vs suffix only: R^2 0.897" in printed
    assert "saved at n=8,192, h=4,096: measured 0.389" in printed


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ("shape,n,ms\nx,10,1\n", "lack the column(s) h"),
        ("model,n,h,ms\nx,10,11,1\n", "line 2: needs a name, 0 <= h <= n"),
        ("model,n,h,ms\nx,10,2,1\nx,10,2,-1\n", "line 3: needs"),
        ("model,n,h,ms\nx,10,2,nan\n", "line 2: needs"),
        ("model,n,h,m,ms\nx,10,2,7,1\n", "line 2: m = 7 is not n - h = 8"),
        ("model,n,h,ms\nx,ten,2,1\n", "line 2: invalid literal"),
    ],
)
def test_a_bad_points_table_names_the_line(tmp_path: Path, table: str, message: str) -> None:
    path = tmp_path / "points.csv"
    path.write_text(table)
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        calibration.read_points(path, lambda _: None)


def test_the_cli_reports_a_bad_table_and_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "points.csv"
    path.write_text("model,n,h\nx,10,2\n")
    assert main(["analyze", "--prefill-points", str(path)]) == 2
    assert "lack the column(s) a time" in capsys.readouterr().err
    assert main(["analyze"]) == 2


def test_too_few_points_are_not_used(tmp_path: Path) -> None:
    path = tmp_path / "points.csv"
    path.write_text("model,n,h,seconds\n" + "".join(f"x,{1000 * i},0,{0.01 * i}\n" for i in range(1, 5)))
    (points,) = calibration.read_points(path, lambda _: None)
    fit = calibration.fit_points(points)
    assert not fit.usable and "fewer than 6" in fit.reason
