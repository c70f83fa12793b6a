"""Every article-2 golden value of DESIGN section 1, and the model-shape checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvlens import bandwidth as bw
from kvlens.cli import main
from tests.unit.test_shapes import LLAMA_31_8B

GIB = 1024**3
TIB_PER_S = 1024**4


def test_quantized_weight_bytes() -> None:
    ratio = bw.quantized_weight_ratio(0.9, bits=4, group_size=128)
    assert f"{ratio:.3f}" == "0.332"
    assert f"{1 / ratio:.2f}" == "3.01"


def test_kv_bytes() -> None:
    per_token = bw.kv_bytes_per_token(32, 8, 128, 2)
    assert per_token == 128 * 1024
    assert bw.kv_bytes_per_sequence(8192, per_token) == GIB


@pytest.mark.parametrize(
    ("batch", "ms_16", "ms_4", "speedup"),
    [(1, "14.65", "4.88", "3.00"), (8, "21.48", "11.72", "1.83"), (32, "44.92", "35.16", "1.28")],
)
def test_decode_step_table(batch: int, ms_16: str, ms_4: str, speedup: str) -> None:
    step = bw.compare_step(
        weight_bytes_16=14 * GIB,
        weight_bytes_q=4 * GIB,
        kv_bytes_per_token_=128 * 1024,
        batch=batch,
        context_tokens=8192,
        bandwidth=TIB_PER_S,
    )
    assert (f"{step.seconds_16 * 1000:.2f}", f"{step.seconds_q * 1000:.2f}", f"{step.speedup:.2f}") == (
        ms_16,
        ms_4,
        speedup,
    )
    assert step.throughput_16 == pytest.approx(batch / step.seconds_16)


def test_break_even_extra_time_and_compute_floor() -> None:
    assert f"{bw.break_even_extra_seconds(14 * GIB, 4 * GIB, TIB_PER_S) * 1000:.2f}" == "9.77"
    common = dict(weight_bytes_16=14 * GIB, weight_bytes_q=4 * GIB, kv_bytes_per_token_=128 * 1024,
                  batch=1, context_tokens=8192, bandwidth=TIB_PER_S)  # fmt: skip
    assert f"{bw.compare_step(**common, extra_q=0.012).speedup:.3f}" == "0.868"
    assert bw.compare_step(**common, compute_floor=0.050).speedup == pytest.approx(1.0)


def test_weight_share() -> None:
    assert bw.weight_share(14 * GIB, 1, GIB) == pytest.approx(14 / 15)
    assert bw.weight_share(14 * GIB, 32, GIB) == pytest.approx(14 / 46)


@pytest.mark.parametrize(
    ("text", "value"),
    [("4.8TB/s", 4.8e12), ("1TiB/s", 2.0**40), ("900 GB/s", 9e11)],
)
def test_bandwidth_units(text: str, value: float) -> None:
    assert bw.parse_bandwidth(text) == pytest.approx(value)


def test_bad_units_are_refused() -> None:
    for bad in ("fast", "4.8TB", "-1GB/s"):
        with pytest.raises(ValueError):
            bw.parse_bandwidth(bad)
    assert bw.parse_bytes("14GiB") == 14 * GIB
    assert bw.parse_count("8B") == 8e9


def test_cli_table_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA_31_8B))
    args = ["bandwidth", "--config-json", str(config), "--weight-bytes", "14GiB", "--bandwidth", "1TiB/s",
            "--batch", "1,8,32", "--context", "8192", "--quantized-fraction", "0.9"]  # fmt: skip
    assert main([*args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    rows = {row["batch"]: row for row in result["steps"]}
    assert f"{rows[1]['speedup']:.2f}" == "2.66"  # W4 from the ratio: 14 GiB x 0.332 = 4.65 GiB
    assert result["kv_bytes_per_token"] == 128 * 1024
    assert f"{result['weight_ratio']:.3f}" == "0.332"
    assert main(args) == 0
    assert "speedup" in capsys.readouterr().out
    config.write_text(json.dumps({**LLAMA_31_8B, "kv_lora_rank": 512}))
    assert main(args) == 2
    assert "latent attention" in capsys.readouterr().err
