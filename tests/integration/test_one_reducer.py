"""The same records give the same sums live and offline: a running ``kvlens serve`` (over real
HTTP) and ``kvlens analyze`` (a real process), one config with per-model cost models in every unit
and a label cap that folds models with their own cost model into ``other``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import orjson
import pytest
import yaml

from kvlens.simulate.demo import REPLAY_SHAPE
from tests.live import start_kvlens, total

pytestmark = pytest.mark.integration

CONFIG = {
    "max_models": 1,  # the first model seen keeps its label; the others become "other"
    "cost_models": {
        "own-model": {"a": 1.0, "b": 0.01},  # work units, but not the default's b
        "seconds-model": {"a": 7.3e-5, "b": 5.3e-9, "unit": "seconds"},
    },
    "model_shapes": {"flops-model": REPLAY_SHAPE},  # the Llama-3.1-8B shape
}
FAMILIES = {  # unit -> (prompt work family, reused work family)
    "work_units": ("kvlens_prompt_work_units_total", "kvlens_reused_work_units_total"),
    "flops": ("kvlens_prompt_flops_total", "kvlens_reused_flops_total"),
    "seconds": ("kvlens_modelled_prefill_seconds_total", "kvlens_saved_prefill_seconds_total"),
}


def records() -> list[dict[str, object]]:
    made: list[dict[str, object]] = []
    for model, count in (
        ("first-model", 20),
        ("own-model", 20),
        ("flops-model", 10),
        ("seconds-model", 10),
        (None, 5),
    ):
        for i in range(count):
            n = 64 + 997 * i
            record: dict[str, object] = {"prompt_tokens": n, "cached_tokens": (n // 2) if i % 3 else 0}
            if model is not None:
                record["model"] = model
            made.append(record)
    return made


def test_live_and_offline_sums_are_identical(tmp_path: Path) -> None:
    config = tmp_path / "kvlens.yaml"
    config.write_text(yaml.safe_dump(CONFIG))
    data = records()
    lines = tmp_path / "records.jsonl"
    lines.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in data))

    kvlens = start_kvlens("serve", "--config", str(config))
    try:
        assert httpx.post(f"{kvlens.url}/v1/records", content=lines.read_bytes()).status_code == 200
        assert kvlens.wait_for("kvlens_requests_total", len(data)) == len(data)
        samples = kvlens.samples()
    finally:
        kvlens.output()
    offline = json.loads(
        subprocess.run(
            [sys.executable, "-m", "kvlens.cli", "analyze", "--config", str(config), "--json", str(lines)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    )

    # Label capping happened: only the first model kept its label.
    assert {dict(labels).get("model") for name, labels in samples if name == "kvlens_requests_total"} == {
        "first-model",
        "other",
    }
    overall = offline["overall"]
    assert total(samples, "kvlens_requests_total") == overall["requests"] == len(data)
    assert total(samples, "kvlens_prompt_tokens_total") == overall["prompt_tokens"]
    assert total(samples, "kvlens_cached_tokens_total") == overall["cached_tokens"]
    assert total(samples, "kvlens_requests_total", cache="hit") == overall["hit_requests"]
    assert set(overall["work"]) == set(FAMILIES)
    assert overall["compute_saved_ratio"] is None  # three units: no single ratio
    for unit, (prompt, reused) in FAMILIES.items():
        assert total(samples, prompt) == pytest.approx(overall["work"][unit]["prompt"], rel=1e-12), unit
        assert total(samples, reused) == pytest.approx(overall["work"][unit]["reused"], rel=1e-12), unit

    # Per label: the folded models' sums land in "other", each still in its own unit.
    first = offline["models"]["first-model"]
    assert total(samples, "kvlens_prompt_work_units_total", model="first-model") == pytest.approx(
        first["work"]["work_units"]["prompt"], rel=1e-12
    )
    folded = [offline["models"][m] for m in ("own-model", "unknown")]
    assert total(samples, "kvlens_reused_work_units_total", model="other") == pytest.approx(
        sum(m["work"]["work_units"]["reused"] for m in folded), rel=1e-12
    )
    assert total(samples, "kvlens_reused_flops_total", model="first-model") == 0
