"""Why reuse is lost without KV events, live: records with ``prefix_hashes`` and ``replica`` POSTed
to a real ``kvlens serve`` with ``KVLENS_MODELLED_CAPACITY_BLOCKS`` give, on /metrics, exactly the
causes :class:`~kvlens.simulate.modelled.ModelledFleet` gives offline for the same records."""

from __future__ import annotations

from collections import Counter
from typing import Any

import httpx
import orjson
import pytest

from kvlens.fleet.causes import CAUSES, EVICTED_ELSEWHERE, EVICTED_HERE, HELD_ELSEWHERE, NEW
from kvlens.fleet.index import FleetIndex
from kvlens.simulate.modelled import ModelledFleet
from kvlens.simulate.trace import BUNDLED, MOONCAKE, Trace
from tests.live import start_kvlens

pytestmark = pytest.mark.integration
BLOCK, CAPACITY, REPLICAS = 512, 300, 3


def records() -> list[dict[str, Any]]:
    requests = list(Trace(str(BUNDLED), MOONCAKE, BLOCK).requests())[:900]
    out = []
    for i, request in enumerate(requests):
        ids: list[int | str] = list(request.blocks)
        if i % 2:  # LiteLLM's form: 16 hex digits, read as the same 64-bit ids
            ids = [f"{key:016x}" for key in request.blocks]
        out.append(
            {
                "prompt_tokens": request.prompt_tokens,
                "cached_tokens": 0,
                "replica": f"r{i % REPLICAS}",
                "prefix_hashes": ids,
                **({"block_size": BLOCK} if i % 3 == 0 else {}),
            }
        )
    return out


def test_posted_records_give_the_offline_modelled_causes() -> None:
    sent = records()
    offline = ModelledFleet(FleetIndex(hashes_alike=True), CAPACITY, BLOCK)
    for record in sent:
        offline.record(record["replica"], record["prefix_hashes"], record["prompt_tokens"])
    expected = offline.index.recomputed_tokens
    assert {cause for _, cause in expected} == {NEW, EVICTED_HERE, HELD_ELSEWHERE, EVICTED_ELSEWHERE}
    left_out = [
        {"prompt_tokens": 1024, "cached_tokens": 0, "prefix_hashes": [1, 2]},  # no replica
        {"prompt_tokens": 64, "cached_tokens": 0, "replica": "r0", "block_size": 16, "prefix_hashes": [1]},
        {"prompt_tokens": 64, "cached_tokens": 0, "replica": "r0"},  # no prefix_hashes: not counted
    ]
    kvlens = start_kvlens(
        "serve",
        env={"KVLENS_MODELLED_CAPACITY_BLOCKS": str(CAPACITY), "KVLENS_MODELLED_BLOCK_SIZE": str(BLOCK)},
    )
    try:
        url = f"{kvlens.url}/v1/records"
        # the fast path (a JSON array), NDJSON, and the record-by-record path (an unknown field)
        first = httpx.post(url, content=orjson.dumps(sent[:400]), timeout=30)
        lines = b"\n".join(orjson.dumps(r) for r in sent[400:700])
        second = httpx.post(url, content=lines, headers={"content-type": "application/x-ndjson"}, timeout=30)
        third = httpx.post(url, content=orjson.dumps([{**r, "extra": 1} for r in sent[700:]]), timeout=30)
        fourth = httpx.post(url, content=orjson.dumps(left_out), timeout=30)
        assert [a.status_code for a in (first, second, third, fourth)] == [200] * 4
        assert [a.json()["accepted"] for a in (first, second, third, fourth)] == [400, 300, 200, 3]
        samples = kvlens.samples()
        name = "kvlens_kv_modelled_recomputed_tokens_total"
        found = Counter(
            {
                (dict(labels)["replica"], dict(labels)["cause"]): value
                for (metric, labels), value in samples.items()
                if metric == name and value
            }
        )
        assert found == Counter({key: float(tokens) for key, tokens in expected.items()})
        exported = {(dict(labels)["replica"], dict(labels)["cause"]) for (m, labels) in samples if m == name}
        assert exported == {(f"r{i}", cause) for i in range(REPLICAS) for cause in CAUSES}
        outcomes = {
            dict(labels)["outcome"]: v
            for (m, labels), v in samples.items()
            if m == "kvlens_kv_modelled_records_total"
        }
        assert outcomes == {"modelled": 900, "no_replica": 1, "block_size": 1, "replicas": 0}
        assert kvlens.value("kvlens_requests_total") == 903
        assert kvlens.value("kvlens_kv_recomputed_tokens_total") == 0  # the observed family: no KV events
        assert kvlens.value("kvlens_collector_errors_total") == 0
    finally:
        out = kvlens.output()
    assert "Traceback" not in out
