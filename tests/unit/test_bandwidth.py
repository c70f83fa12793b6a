"""Every article-2 golden value of DESIGN section 1, and the model-shape checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvlens import bandwidth as bw
from kvlens import limits
from kvlens.cli import main
from kvlens.shapes import ModelShape
from tests.unit.test_shapes import LLAMA_31_8B

GIB = 1024**3
TIB_PER_S = 1024**4


def test_quantized_weight_bytes() -> None:
    ratio = bw.quantized_weight_ratio(0.9, bits=4, group_size=128)
    assert f"{ratio:.3f}" == "0.332"
    assert f"{1 / ratio:.2f}" == "3.01"


def test_kv_bytes() -> None:
    per_token = ModelShape(num_hidden_layers=32, num_key_value_heads=8, head_dim=128).kv_bytes_per_token
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
    assert limits.parse_size("14GiB") == 14 * GIB
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


def test_the_article_example_as_a_reader_types_it(capsys: pytest.CaptureFixture[str]) -> None:
    """W16 = 14 GiB, W4 = 4 GiB, K = 1 GiB at 8192 tokens, 1 TiB/s (seed article 2)."""
    args = ["bandwidth", "--weight-bytes", "14GiB", "--quantized-weight-bytes", "4GiB",
            "--kv-bytes-per-sequence", "1GiB", "--bandwidth", "1TiB/s"]  # fmt: skip
    assert main([*args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [f"{row['speedup']:.2f}" for row in result["steps"]] == ["3.00", "1.83", "1.28"]
    assert f"{result['break_even_extra_seconds'] * 1000:.2f}" == "9.77"
    assert result["upper_bound"] is True
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "under 9.77 ms" in printed and "upper bound" in printed
    assert main([*args, "--context", "4096,8192"]) == 2
    assert "K at one --context" in capsys.readouterr().err


H200_DECODE = Path(__file__).resolve().parent.parent / "fixtures" / "h200" / "decode_h200.csv"


def test_the_fit_reproduces_the_h200_steps_and_blames_the_int4_kernel() -> None:
    fits = {fit.path: fit for fit in bw.fit_paths(bw.read_measured(H200_DECODE))}
    for fit in fits.values():
        for step in fit.steps:
            assert fit.seconds(step.batch, step.kv_bytes_per_sequence) == pytest.approx(
                step.seconds, rel=1e-9
            )
    assert fits["bf16"].bandwidth == pytest.approx(3.27e12, rel=0.01)
    assert fits["int4_g128"].bandwidth == pytest.approx(1.50e12, rel=0.01)
    result = bw.measured_comparison(list(fits.values()), batches=[32])
    assert result["baseline"] == "bf16"
    (comparison,) = result["comparisons"]
    rows = {row["batch"]: row for row in comparison["rows"]}
    assert f"{rows[1]['measured_speedup']:.2f}" == "1.36" and f"{rows[8]['measured_speedup']:.2f}" == "0.89"
    assert rows[1]["fitted_speedup"] == pytest.approx(rows[1]["measured_speedup"], rel=1e-9)
    assert f"{rows[1]['bytes_upper_bound']:.2f}" == "3.14" and f"{rows[8]['bytes_upper_bound']:.2f}" == "1.83"
    assert rows[32]["measured_speedup"] is None and rows[32]["fitted_speedup"] < 1
    # Article 2's break-even on the fitted numbers: pays at batch 1, not at 8.
    assert comparison["break_even_extra_seconds"] == pytest.approx(0.783e-3, rel=0.01)
    assert (rows[1]["pays"], rows[8]["pays"]) == (True, False)
    assert comparison["limited_by"] == "kernel"


def test_measured_cli_says_the_kernel_limits(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bandwidth", "--measured", str(H200_DECODE)]) == 0
    printed = capsys.readouterr().out
    assert "the int4_g128 kernel, not the bytes, limits the gain" in printed
    assert "1.36x" in printed and "3.14x" in printed


def test_a_kernel_as_fast_as_the_16_bit_one_is_limited_by_bytes(tmp_path: Path) -> None:
    rows = ["path,batch,context_tokens,weight_bytes,kv_bytes_per_sequence,step_ms"]
    for path, weights in (("bf16", 14 * GIB), ("w4", 4 * GIB)):
        for batch in (1, 8, 32):
            seconds = 0.0002 + (weights + batch * GIB) / TIB_PER_S
            rows.append(f"{path},{batch},8192,{weights},{GIB},{seconds * 1000}")
    (tmp_path / "steps.csv").write_text("\n".join(rows) + "\n")
    fits = bw.fit_paths(bw.read_measured(tmp_path / "steps.csv"))
    (comparison,) = bw.measured_comparison(fits)["comparisons"]
    assert comparison["limited_by"] == "bytes"
    assert comparison["bandwidth_share_of_16_bit"] == pytest.approx(1.0, rel=1e-6)
    assert comparison["break_even_extra_seconds"] == pytest.approx(10 * GIB / TIB_PER_S, rel=1e-6)
    assert all(row["pays"] for row in comparison["rows"])


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ("path,batch,context_tokens,weight_bytes,kv_bytes_per_sequence\n", "lack the column(s) step_ms"),
        ("path,batch,context_tokens,weight_bytes,kv_bytes_per_sequence,step_ms\nbf16,1,8192,10,1,0\n",
         "line 2: needs a path and positive"),
        ("path,batch,context_tokens,weight_bytes,kv_bytes_per_sequence,step_ms\nbf16,x,8192,10,1,1\n",
         "line 2: invalid literal"),
    ],
)  # fmt: skip
def test_bad_measured_tables_name_the_line(tmp_path: Path, table: str, message: str) -> None:
    (tmp_path / "steps.csv").write_text(table)
    with pytest.raises(bw.CannotFit, match=message.replace("(", r"\(").replace(")", r"\)")):
        bw.read_measured(tmp_path / "steps.csv")


def test_one_batch_size_cannot_fit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    header = "path,batch,context_tokens,weight_bytes,kv_bytes_per_sequence,step_ms\n"
    (tmp_path / "steps.csv").write_text(header + "bf16,1,8192,10,1,1\nbf16,1,8192,10,1,1.1\n")
    assert main(["bandwidth", "--measured", str(tmp_path / "steps.csv")]) == 2
    assert "two or more batch sizes" in capsys.readouterr().err
    (tmp_path / "steps.csv").write_text(header + "bf16,1,8192,10,1,1\nbf16,2,8192,10,1,1.1\n")
    assert main(["bandwidth", "--measured", str(tmp_path / "steps.csv")]) == 2
    assert "a 16-bit path and a quantized one" in capsys.readouterr().err
