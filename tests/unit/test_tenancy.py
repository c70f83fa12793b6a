"""The passive isolation check (:mod:`kvlens.tenancy`) and per-tenant accounting, hand-computed."""

from __future__ import annotations

import gc
import json
import tracemalloc
from pathlib import Path
from typing import Any

import orjson
import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvlens.accounting import TENANT_BLOCK_BYTES
from kvlens.analysis.tenants import cross_tenant
from kvlens.cli import main
from kvlens.config import load_settings
from kvlens.errors import SettingsError
from kvlens.exporter.aggregator import Aggregator
from kvlens.exporter.app import create_app
from kvlens.exporter.collector import KVLensCollector
from kvlens.records import Validated, batch_from_objects
from kvlens.sources import formats
from kvlens.tenancy import BlockStorers, CrossTenantHit, tenant_key
from tests.json_outputs import validate
from tests.tenants import CROSS_TENANT_TOKENS, PAIRS, scenario


def batch_of(records: list[dict[str, Any]]) -> Validated:
    validated = batch_from_objects(records)
    assert len(validated.rejections) == 0
    return validated


def count(aggregator: Aggregator, validated: Validated) -> None:
    """As the sidecar counts a batch: the sums, then the tenants' block storers."""
    aggregator.add(validated, "push")
    aggregator.tenants.store(validated.batch, validated.batch.prefix_keys())


def test_cross_tenant_tokens_by_hand() -> None:
    storers = BlockStorers(capacity=100)
    hits = storers.add(batch_of(scenario()).batch)
    a, b = tenant_key("A"), tenant_key("B")
    assert hits == [
        CrossTenantHit(1, a, 48),
        CrossTenantHit(2, a, 32),
        CrossTenantHit(3, b, 16),
        CrossTenantHit(5, a, 16),
        CrossTenantHit(8, a, 16),
    ]
    assert len(storers) == 7 and storers.forgotten == 0  # blocks 1..7


def test_the_least_recently_seen_block_is_forgotten_first() -> None:
    storers = BlockStorers(capacity=2)
    first = [
        {"tenant": "A", "prompt_tokens": 32, "cached_tokens": 0, "prefix_hashes": [1, 2]},
        {"tenant": "A", "prompt_tokens": 16, "cached_tokens": 16, "prefix_hashes": [1]},  # 1 seen again
        {"tenant": "A", "prompt_tokens": 16, "cached_tokens": 0, "prefix_hashes": [3]},  # 2 forgotten
    ]
    assert storers.add(batch_of(first).batch) == []
    assert (len(storers), storers.forgotten) == (2, 1)
    later = [
        {"tenant": "B", "prompt_tokens": 16, "cached_tokens": 16, "prefix_hashes": [1]},  # A's: 16
        {"tenant": "B", "prompt_tokens": 16, "cached_tokens": 16, "prefix_hashes": [2]},  # stored anew by B
    ]
    assert storers.add(batch_of(later).batch) == [CrossTenantHit(0, tenant_key("A"), 16)]
    assert (len(storers), storers.forgotten) == (2, 2)


def test_memory_per_remembered_block() -> None:
    blocks = 200_000
    records = [
        {
            "tenant": f"t{i % 50}",
            "prompt_tokens": 1600,
            "cached_tokens": 0,
            # 64-bit hashes as engines send them (an int past 2**60 takes 36 bytes)
            "prefix_hashes": [(j * 0x9E3779B97F4A7C15) % 2**64 for j in range(i, i + 100)],
        }
        for i in range(0, blocks, 100)
    ]
    batch = batch_of(records).batch
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        storers = BlockStorers(capacity=blocks)
        storers.add(batch)
        per_block = (tracemalloc.get_traced_memory()[0] - before) / len(storers)
    finally:
        tracemalloc.stop()
    print(f"memory per remembered block: {per_block:.0f} bytes")
    assert len(storers) == blocks
    assert per_block <= TENANT_BLOCK_BYTES


def families(aggregator: Aggregator) -> dict[str, list[Any]]:
    registry = CollectorRegistry()
    registry.register(KVLensCollector(aggregator))
    text = generate_latest(registry).decode()
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def value(found: dict[str, list[Any]], family: str, **labels: str) -> float:
    matching = [
        s.value
        for s in found[family]
        if all(s.labels.get(k) == v for k, v in labels.items()) and not s.name.endswith("_created")
    ]
    assert len(matching) == 1, (family, labels, matching)
    return float(matching[0])


def test_per_tenant_accounting_and_cross_tenant_tokens_are_exported() -> None:
    aggregator = Aggregator(load_settings(tenant_remember_blocks=100))
    count(aggregator, batch_of(scenario()))
    found = families(aggregator)
    for tenant, tokens in CROSS_TENANT_TOKENS.items():
        assert value(found, "kvlens_cross_tenant_cached_tokens", tenant=tenant) == tokens
    assert value(found, "kvlens_tenant_requests", tenant="B", cache="hit") == 4
    assert value(found, "kvlens_tenant_requests", tenant="A", cache="miss") == 1
    assert value(found, "kvlens_tenant_prompt_tokens", tenant="B") == 80 + 40 + 32 + 64
    assert value(found, "kvlens_tenant_cached_tokens", tenant="D") == 64
    # the article's cost model (a = 1, b = 1/1024): C(64) = 64 + 64*65/2048
    assert value(found, "kvlens_tenant_reused_work", tenant="D", unit="work_units") == pytest.approx(
        64 + 64 * 65 / 2048
    )
    assert value(found, "kvlens_tenant_overflow") == 0
    assert value(found, "kvlens_tenant_remembered_blocks") == 7
    # the record without a tenant is in the existing families, which have no tenant label
    assert value(found, "kvlens_requests", model="unknown", prompt_len="0-511", cache="hit") == 7
    assert all("tenant" not in sample.labels for sample in found["kvlens_requests"])


def test_no_tenant_families_without_tenants() -> None:
    aggregator = Aggregator(load_settings())
    aggregator.add(batch_of([{"prompt_tokens": 10, "cached_tokens": 0}]), "push")
    assert not {name for name in families(aggregator) if "tenant" in name}


@pytest.mark.timeout(120)
def test_the_tenant_label_cap_holds_under_100k_tenants() -> None:
    aggregator = Aggregator(load_settings(max_tenants=5, tenant_remember_blocks=1000))
    records = [
        {"tenant": f"tenant-{i}", "prompt_tokens": 32, "cached_tokens": 16, "prefix_hashes": [i % 7, i]}
        for i in range(100_000)
    ]
    count(aggregator, batch_of(records))
    found = families(aggregator)
    tenants = {s.labels["tenant"] for name, samples in found.items() for s in samples if "tenant" in s.labels}
    assert tenants == {"tenant-0", "tenant-1", "tenant-2", "tenant-3", "tenant-4", "other"}
    series = sum(len(samples) for name, samples in found.items() if "tenant" in name)
    # 6 tenants: requests x2 caches, prompt, cached, two work units, cross; overflow, remembered, forgotten
    assert series == 6 * 7 + 3
    assert value(found, "kvlens_tenant_overflow") == 100_000 - 5
    assert value(found, "kvlens_tenant_requests", tenant="other", cache="hit") == 100_000 - 5
    assert value(found, "kvlens_tenant_remembered_blocks") == 1000


def test_the_allow_list_exports_its_tenants_from_the_start_and_folds_the_rest() -> None:
    aggregator = Aggregator(load_settings(tenants=["A", "B"]))
    assert value(families(aggregator), "kvlens_tenant_requests", tenant="B", cache="hit") == 0
    aggregator.add(batch_of([{"tenant": "Z", "prompt_tokens": 4, "cached_tokens": 0}]), "push")
    found = families(aggregator)
    assert value(found, "kvlens_tenant_requests", tenant="other", cache="miss") == 1
    assert value(found, "kvlens_tenant_overflow") == 1


@pytest.mark.parametrize("bad", [["other"], [""], ["a\nb"], ["x" * 129]])
def test_a_bad_tenant_allow_list_is_a_settings_error(bad: list[str]) -> None:
    with pytest.raises(SettingsError, match="tenant names must be non-empty printable UTF-8 of at most 128"):
        load_settings(tenants=bad)


@pytest.mark.parametrize("fast", [True, False])
def test_bad_tenants_are_rejected_by_field_and_the_records_beside_them_count(fast: bool) -> None:
    app = create_app(load_settings(), CollectorRegistry())
    good = {"tenant": "A", "prompt_tokens": 8, "cached_tokens": 0}
    bad = [
        {"tenant": "line\nbreak", "prompt_tokens": 8, "cached_tokens": 0},
        {"tenant": "x" * 129, "prompt_tokens": 8, "cached_tokens": 0},
        {"tenant": 7, "prompt_tokens": 8, "cached_tokens": 0},
    ]
    body = [good, *bad, good] if fast else [good, *bad, {**good, "unknown": 1}]
    with TestClient(app) as client:
        answer = client.post("/v1/records", json=body).json()
        metrics = client.get("/metrics").text
    assert answer["accepted"] == 2
    assert [(r["index"], r["field"], r["reason"]) for r in answer["rejected"]] == [
        (1, "tenant", "invalid_label"),
        (2, "tenant", "invalid_label"),
        (3, "tenant", "not_a_string"),
    ]
    assert answer["rejected"][0]["message"] == "must be printable UTF-8 of at most 128 bytes"
    assert "line" not in str(answer)  # the value is never echoed
    assert 'kvlens_tenant_requests_total{cache="miss",tenant="A"} 2.0' in metrics


def test_analyze_reports_the_same_pairs_and_tokens(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "records.jsonl"
    shuffled = scenario()[::-1]  # analyze takes them in arrival order, whatever the file's order
    path.write_bytes(b"".join(orjson.dumps(record) + b"\n" for record in shuffled))
    assert main(["analyze", str(path), "--engine", "numpy", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    validate(report)
    section = report["cross_tenant"]
    assert section["cross_tenant_cached_tokens"] == sum(CROSS_TENANT_TOKENS.values())
    assert {
        (p["storer"], p["getter"]): (p["cached_tokens"], p["example_request_ids"]) for p in section["pairs"]
    } == PAIRS
    assert [p["getter"] for p in section["pairs"]] == ["B", "A"]  # most tokens first
    assert (section["records_checked"], section["remember_blocks"], section["pairs_left_out"]) == (7, 20, 0)
    assert main(["analyze", str(path), "--engine", "numpy", "--markdown"]) == 0
    assert "| A | B | 112 | 4 | r2, r3, r6, r9 |" in capsys.readouterr().out


def test_analyze_lists_at_most_the_first_pairs_and_examples() -> None:
    records = [
        {
            "request_id": f"s{i}",
            "tenant": f"s{i}",
            "prompt_tokens": 16,
            "cached_tokens": 0,
            "prefix_hashes": [i],
        }
        for i in range(30)
    ] + [
        {
            "request_id": f"g{i}-{k}",
            "tenant": "g",
            "prompt_tokens": 16,
            "cached_tokens": 16,
            "prefix_hashes": [i],
        }
        for i in range(30)
        for k in range(7)
    ]
    section = cross_tenant(batch_of(records).batch)
    assert section is not None and len(section["pairs"]) == 20 and section["pairs_left_out"] == 10
    assert section["pairs"][0] == {
        "storer": "s0",
        "getter": "g",
        "cached_tokens": 7 * 16,
        "requests": 7,
        "example_request_ids": [f"g0-{k}" for k in range(5)],
    }
    assert cross_tenant(batch_of([{"tenant": "a", "prompt_tokens": 1, "cached_tokens": 0}]).batch) is None


def test_a_tail_field_mapping_reads_the_tenant_from_a_gateway_log() -> None:
    convert = formats.converter(
        "kvlens",
        fields={
            "tenant": "metadata.team",
            "prompt_tokens": "usage.prompt_tokens",
            "cached_tokens": "usage.cached",
        },
    )
    line = {"metadata": {"team": "A", "cache_salt": "s"}, "usage": {"prompt_tokens": 32, "cached": 16}}
    validated = batch_from_objects([convert(line)])
    assert validated.batch.tenant == ["A"] and len(validated.rejections) == 0
