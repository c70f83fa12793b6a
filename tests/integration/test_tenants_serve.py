"""The passive isolation check, live: two tenants POST records with shared ``prefix_hashes`` to a
real ``kvlens serve`` with ``KVLENS_TENANT_REMEMBER_BLOCKS``; /metrics gives the cross-tenant
tokens computed by hand (tests/tenants.py), and ``kvlens analyze`` of the same records the same."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import orjson
import pytest

from kvlens.cli import main
from tests.live import start_kvlens
from tests.tenants import CROSS_TENANT_TOKENS, PAIRS, scenario

pytestmark = pytest.mark.integration
SALT = "SALT-never-shown-4d1c"


@pytest.mark.timeout(120)
def test_pushed_tenants_give_the_hand_computed_cross_tenant_tokens(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    records = scenario()
    # the last POST's records carry a salt (a field kvlens does not know: never shown anywhere)
    records[6:] = [{**record, "cache_salt": SALT} for record in records[6:]]
    kvlens = start_kvlens("serve", env={"KVLENS_TENANT_REMEMBER_BLOCKS": "1000"})
    try:
        url = f"{kvlens.url}/v1/records"
        bad = {"tenant": "bad\ttenant", "prompt_tokens": 16, "cached_tokens": 16, "prefix_hashes": [1]}
        # in arrival order: the fast path (a JSON array), NDJSON, and the record-by-record path
        # (a bad tenant beside good records)
        answers = [
            httpx.post(url, content=orjson.dumps([r for r in records[:3]]), timeout=30),
            httpx.post(
                url,
                content=b"\n".join(orjson.dumps(r) for r in records[3:6]),
                headers={"content-type": "application/x-ndjson"},
                timeout=30,
            ),
            httpx.post(url, content=orjson.dumps([records[6], bad, *records[7:]]), timeout=30),
        ]
        assert [a.status_code for a in answers] == [200] * 3
        assert [a.json()["accepted"] for a in answers] == [3, 3, 3]
        assert answers[2].json()["rejected"] == [
            {
                "index": 1,
                "field": "tenant",
                "reason": "invalid_label",
                "message": "must be printable UTF-8 of at most 128 bytes",
            }
        ]
        samples = kvlens.samples()
        live = {
            dict(labels)["tenant"]: value
            for (name, labels), value in samples.items()
            if name == "kvlens_cross_tenant_cached_tokens_total"
        }
        assert live == {tenant: float(tokens) for tenant, tokens in CROSS_TENANT_TOKENS.items()}
        assert kvlens.value("kvlens_tenant_requests_total", tenant="B") == 4
        assert kvlens.value("kvlens_requests_total") == 9
        metrics = httpx.get(f"{kvlens.url}/metrics", timeout=10).text
        assert SALT not in metrics and "bad\\ttenant" not in metrics
    finally:
        out = kvlens.output()
    assert "Traceback" not in out and SALT not in out
    path = tmp_path / "records.jsonl"
    path.write_bytes(b"".join(orjson.dumps(record) + b"\n" for record in records))
    assert main(["analyze", str(path), "--engine", "numpy", "--json"]) == 0
    report = capsys.readouterr().out
    assert SALT not in report
    section = json.loads(report)["cross_tenant"]
    assert section["cross_tenant_cached_tokens"] == sum(live.values())
    offline = {
        (p["storer"], p["getter"]): (p["cached_tokens"], p["example_request_ids"]) for p in section["pairs"]
    }
    assert offline == PAIRS
    by_getter = {getter: tokens for (_, getter), (tokens, _) in offline.items()}
    assert by_getter == {tenant: live[tenant] for tenant in live if live[tenant]}
