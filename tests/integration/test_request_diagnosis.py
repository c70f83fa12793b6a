"""Per-request diagnoses from a real ``kvlens serve`` over HTTP: records with prefix_hashes pushed
behind the ingest token, each request's diagnosis read back behind the same token, and the misses
counted on /metrics."""

from __future__ import annotations

import httpx
import pytest

from tests.live import start_kvlens, total

pytestmark = pytest.mark.integration
TOKEN = "s3cret-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}


def test_the_diagnosis_endpoint_answers_behind_the_ingest_token() -> None:
    kvlens = start_kvlens("serve", env={"KVLENS_INGEST_TOKEN": TOKEN, "KVLENS_DIAGNOSIS_REQUESTS": "2"})
    try:
        records = [
            {"request_id": "q1", "replica": "a", "prompt_tokens": 48, "cached_tokens": 0,
             "block_size": 16, "prefix_hashes": [1, 2, 3]},
            {"request_id": "q2", "replica": "b", "prompt_tokens": 48, "cached_tokens": 0,
             "block_size": 16, "prefix_hashes": [1, 2, 4]},
            {"request_id": "q3", "replica": "a", "prompt_tokens": 40, "cached_tokens": 16,
             "block_size": 16, "prefix_hashes": [1, 2]},
        ]  # fmt: skip
        assert httpx.post(f"{kvlens.url}/v1/records", json=records).status_code == 401
        answer = httpx.post(f"{kvlens.url}/v1/records", json=records, headers=AUTH)
        assert answer.json()["accepted"] == 3
        url = f"{kvlens.url}/v1/requests/q2/diagnosis"
        assert httpx.get(url).status_code == 401
        assert httpx.get(url, headers={"authorization": "Bearer wrong"}).status_code == 401
        diagnosis = httpx.get(url, headers=AUTH)
        assert diagnosis.status_code == 200
        assert diagnosis.json() == {
            "request_id": "q2",
            "replica": "b",
            "model": None,
            "prompt_tokens": 48,
            "cached_tokens": 0,
            "block_size": 16,
            "first_missed_block": 0,
            "cause": "seen_elsewhere",
            "missed_tokens": {"new": 16, "seen_elsewhere": 32},
            # the article's unit: a = 1, b = 1/1024; blocks at positions 1-16, 17-32 and 33-48
            "missed_work": {
                "new": 16 + sum(range(33, 49)) / 1024,
                "seen_elsewhere": 32 + sum(range(1, 33)) / 1024,
            },
            "unit": "work_units",
        }
        q3 = httpx.get(f"{kvlens.url}/v1/requests/q3/diagnosis", headers=AUTH).json()
        assert (q3["first_missed_block"], q3["cause"], q3["missed_tokens"]) == (
            1,
            "evicted_here",
            {"evicted_here": 16, "new": 8},
        )
        # two kept: q1, the oldest, is gone; an id never seen is unknown
        for gone in ("q1", "never"):
            assert httpx.get(f"{kvlens.url}/v1/requests/{gone}/diagnosis", headers=AUTH).status_code == 404
        samples = kvlens.samples()
        assert total(samples, "kvlens_request_misses_total", cause="new") == 1
        assert total(samples, "kvlens_request_misses_total", cause="seen_elsewhere") == 1
        assert total(samples, "kvlens_request_misses_total", cause="evicted_here") == 1
        assert total(samples, "kvlens_request_misses_total") == 3
    finally:
        out = kvlens.output()
    assert "Traceback" not in out
