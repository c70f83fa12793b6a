"""Every ``--json`` output names its schema (``kvlens.<output>/v<N>``), and real outputs of each
command validate against the JSON Schema file of that name shipped in the package; ``bandwidth``
gives counts as integers; ``analyze --json`` runs without the ``analyze`` extra."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import orjson
import pytest

from kvlens.cli import main
from kvlens.outputs import json_schema, schema_file_name
from kvlens.simulate.trace import BUNDLED
from tests.json_outputs import validate

H200 = Path(__file__).resolve().parent.parent / "fixtures" / "h200"
SCHEMAS = sorted(
    p.name for p in (Path(__file__).resolve().parents[2] / "service/kvlens/schemas").glob("*.json")
)


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


@pytest.fixture
def records(tmp_path: Path) -> Path:
    rows = [
        {"model": "m" if i % 2 else "n", "prompt_tokens": 300 * 2 ** (i % 6), "cached_tokens": 128 * (i % 3),
         "ttft_seconds": 0.1 + 0.01 * i, "queue_seconds": 0.02, "prefill_seconds": 0.001 * (i + 1)}
        for i in range(40)
    ]  # fmt: skip
    path = tmp_path / "records.jsonl"
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows) + b"not json\n")
    return path


def test_the_shipped_schemas_are_json_schemas_named_by_their_key() -> None:
    assert SCHEMAS == ["analyze.v1.json", "bandwidth.measured.v1.json", "bandwidth.v1.json",
                       "compare.v1.json", "quantization.v1.json", "simulate.v1.json"]  # fmt: skip
    for name in SCHEMAS:
        key = "kvlens." + name.removesuffix(".json").rsplit(".", 1)[0] + "/" + name.split(".")[-2]
        schema = json_schema(key)
        jsonschema.Draft202012Validator.check_schema(schema)
        assert schema["properties"]["schema"] == {"const": key} and schema_file_name(key) == name


def test_analyze(records: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = run_json(capsys, "analyze", str(records), "--json")
    assert (
        report["schema"] == "kvlens.analyze/v1"
        and report["calibration"]
        and report["input"]["skipped_total"] == 1
    )
    validate(report)
    validate(run_json(capsys, "analyze", "--prefill-points", str(H200 / "prefill_h200.csv"), "--json"))


def test_a_document_that_does_not_fit_is_refused(records: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = run_json(capsys, "analyze", str(records), "--json")
    del report["groups"][0]["requests"]
    with pytest.raises(jsonschema.ValidationError, match="'requests' is a required property"):
        validate(report)
    report = run_json(capsys, "analyze", str(records), "--json")
    report["overall"]["token_reuse_ratio"] = "7 %"
    with pytest.raises(jsonschema.ValidationError, match="'7 %' is not of type 'number', 'null'"):
        validate(report)


def test_simulate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "trace.jsonl"
    with gzip.open(BUNDLED, "rt") as bundled:
        trace.write_text("".join(line for _, line in zip(range(200), bundled, strict=False)))
    result = run_json(capsys, "simulate", str(trace), "--capacity-blocks", "0,unbounded", "--json")
    assert result["schema"] == "kvlens.simulate/v1"
    validate(result)
    validate(run_json(capsys, "simulate", str(trace), "--no-guard", "--policy", "cost_aware", "--json"))


def test_compare(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = [
        {"arm": arm, "prompt_tokens": 500 + 100 * (i % 4), "cached_tokens": 256 * (arm == "warm"),
         "ttft_seconds": 0.5 - 0.2 * (arm == "warm") + 0.01 * i}
        for arm in ("cold", "warm") for i in range(30)
    ]  # fmt: skip
    path = tmp_path / "arms.jsonl"
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    result = run_json(
        capsys, "compare", "--arm", f"cold={path}", "--arm", f"warm={path}", "--warmup", "4", "--json"
    )
    assert result["schema"] == "kvlens.compare/v1"
    validate(result)


BANDWIDTH = ["bandwidth", "--params", "8B", "--layers", "32", "--kv-heads", "8", "--head-dim", "128",
             "--bandwidth", "4.8TB/s"]  # fmt: skip


def test_bandwidth_counts_are_integers_and_the_rest_rounded(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*BANDWIDTH, "--json"]) == 0
    printed = capsys.readouterr().out
    result = json.loads(printed)
    assert result["schema"] == "kvlens.bandwidth/v1"
    validate(result)
    # 8B x 2 bytes x 0.332 (W4, groups of 128, 90 % quantized) is 5312499999.999999 in floats
    assert result["weight_bytes_quantized"] == 5312500000 and result["weight_bytes_16"] == 16000000000
    assert result["bandwidth_bytes_per_second"] == 4800000000000 and result["kv_bytes_per_token"] == 131072
    assert [(s["batch"], s["context_tokens"]) for s in result["steps"]] == [(1, 8192), (8, 8192), (32, 8192)]
    assert ".0," not in printed and ".999" not in printed  # no count printed as a float
    assert result["steps"][0]["step_seconds_16"] == 0.00355703  # 6 significant digits
    assert result["weight_ratio"] == 0.332031


def test_bandwidth_measured(capsys: pytest.CaptureFixture[str]) -> None:
    result = run_json(
        capsys, "bandwidth", "--measured", str(H200 / "decode_h200.csv"), "--batch", "1,32", "--json"
    )
    assert result["schema"] == "kvlens.bandwidth.measured/v1"
    validate(result)
    assert all(
        type(p["weight_bytes"]) is int and type(p["bandwidth_bytes_per_second"]) is int
        for p in result["paths"]
    )


def test_analyze_json_needs_nothing_beyond_the_serve_extra(records: Path) -> None:
    """The sidecar's install (the ``serve`` extra) has neither rich nor scipy: hide them (and the
    other extras' packages) and ``analyze --json`` still reports, calibration included."""
    hide = (
        "import sys\nfor name in ('rich', 'scipy', 'duckdb', 'matplotlib', 'zmq'): sys.modules[name] = None\n"
    )
    code = hide + f"from kvlens.cli import main\nsys.exit(main(['analyze', {str(records)!r}, '--json']))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    validate(report)
    assert report["overall"]["requests"] == 40 and report["calibration"][0]["requests"] == 20
