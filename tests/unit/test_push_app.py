"""POST /v1/records and the other routes, through the ASGI app (status codes, limits, no echo)."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator

import orjson
import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from kvlens.config import load_settings
from kvlens.exporter.app import create_app
from tests.article import article_records

GOOD = {"prompt_tokens": 128, "cached_tokens": 16}
CANARY = "CANARY-7f3a9"


@pytest.fixture
def client() -> Iterator[TestClient]:
    app = create_app(load_settings(max_body_bytes=64 * 1024, max_models=3), CollectorRegistry())
    with TestClient(app) as test_client:
        yield test_client


def ndjson(records: list[object]) -> bytes:
    return b"\n".join(orjson.dumps(r) for r in records) + b"\n"


def scrape(client: TestClient) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            key = sample.name + json.dumps(sample.labels, sort_keys=True)
            out[key] = sample.value
    return out


def total(values: dict[str, float], name: str, **labels: str) -> float:
    return sum(
        v
        for k, v in values.items()
        if k.startswith(name + "{") and all(f'"{a}": "{b}"' in k for a, b in labels.items())
    )


@pytest.mark.parametrize(
    ("body", "headers"),
    [
        (orjson.dumps(GOOD), {"content-type": "application/json"}),
        (orjson.dumps([GOOD, GOOD]), {"content-type": "application/json"}),
        (ndjson([GOOD, GOOD, GOOD]), {"content-type": "application/x-ndjson"}),
        (b'{\n  "prompt_tokens": 128,\n  "cached_tokens": 16\n}', {}),
        (gzip.compress(ndjson([GOOD, GOOD])), {"content-encoding": "gzip"}),
        (gzip.compress(orjson.dumps([GOOD])), {}),  # gzip recognised by its magic bytes
    ],
)
def test_accepted_payload_shapes(client: TestClient, body: bytes, headers: dict[str, str]) -> None:
    response = client.post("/v1/records", content=body, headers=headers)
    assert response.status_code == 200, response.text
    result = response.json()
    assert result["accepted"] >= 1 and result["rejected_count"] == 0


def test_partial_acceptance_names_each_bad_line(client: TestClient) -> None:
    body = b"\n".join(
        [
            orjson.dumps(GOOD),
            b'{"prompt_tokens": NaN, "cached_tokens": 0}',
            b"this is not json " + CANARY.encode(),
            b'{"prompt_tokens": 1e400, "cached_tokens": 0}',
            orjson.dumps({"prompt_tokens": CANARY, "cached_tokens": 0}),
            b"",
            orjson.dumps(GOOD),
        ]
    )
    response = client.post("/v1/records", content=body)
    assert response.status_code == 200
    result = response.json()
    assert result["accepted"] == 2
    assert result["rejected_count"] == 4
    assert [(r["index"], r["field"], r["reason"]) for r in result["rejected"]] == [
        (1, "prompt_tokens", "not_an_integer"),
        (2, None, "malformed_json"),
        (3, "prompt_tokens", "not_an_integer"),
        (4, "prompt_tokens", "not_an_integer"),
    ]
    assert CANARY not in response.text
    values = scrape(client)
    assert total(values, "kvlens_records_received_total") == 6
    assert total(values, "kvlens_records_rejected_total", reason="malformed_json") == 1
    assert total(values, "kvlens_requests_total") == 2
    assert CANARY not in client.get("/metrics").text


def test_rejected_list_is_capped_but_count_exact() -> None:
    app = create_app(load_settings(max_rejections_listed=5), CollectorRegistry())
    with TestClient(app) as client:
        result = client.post(
            "/v1/records", content=ndjson([{"prompt_tokens": -1, "cached_tokens": 0}] * 50)
        ).json()
    assert result["rejected_count"] == 50
    assert len(result["rejected"]) == 5


@pytest.mark.parametrize("body", [b"not json at all", b"[1, 2", b"\xff\xfe garbage", b"{\n{\n"])
def test_nothing_decodes_is_400(client: TestClient, body: bytes) -> None:
    response = client.post("/v1/records", content=body)
    assert response.status_code == 400
    assert "error" in response.json()


def test_all_records_invalid_is_still_200(client: TestClient) -> None:
    response = client.post("/v1/records", content=orjson.dumps([{"prompt_tokens": -1, "cached_tokens": 0}]))
    assert response.status_code == 200
    assert response.json()["accepted"] == 0


def test_body_over_limit_is_413(client: TestClient) -> None:
    response = client.post("/v1/records", content=b"[" + b" " * 70_000 + b"]")
    assert response.status_code == 413


def test_chunked_body_over_limit_is_413(client: TestClient) -> None:
    def chunks() -> Iterator[bytes]:
        for _ in range(100):
            yield b" " * 1024

    response = client.post("/v1/records", content=chunks())
    assert response.status_code == 413


def test_gzip_bomb_is_413(client: TestClient) -> None:
    bomb = gzip.compress(b" " * (10 * 1024 * 1024))
    assert len(bomb) < 64 * 1024
    response = client.post("/v1/records", content=bomb, headers={"content-encoding": "gzip"})
    assert response.status_code == 413


def test_bad_gzip_is_400_and_an_unknown_encoding_415(client: TestClient) -> None:
    assert (
        client.post("/v1/records", content=b"\x1f\x8bnope", headers={"content-encoding": "gzip"}).status_code
        == 400
    )
    assert client.post("/v1/records", content=b"{}", headers={"content-encoding": "br"}).status_code == 415


def test_label_cap_folds_into_other_and_counts(client: TestClient) -> None:
    records = [{**GOOD, "model": f"m{i}"} for i in range(6)]
    client.post("/v1/records", content=orjson.dumps(records))
    values = scrape(client)
    models = {k.split('"model": "')[1].split('"')[0] for k in values if k.startswith("kvlens_requests_total")}
    assert models == {"m0", "m1", "m2", "other"}
    assert total(values, "kvlens_requests_total", model="other") == 3
    assert values["kvlens_series_overflow_total{}"] == 3
    assert total(values, "kvlens_requests_total") == 6  # nothing lost to the cap


def test_allow_list_fixes_the_model_label() -> None:
    app = create_app(load_settings(models=["llama"]), CollectorRegistry())
    with TestClient(app) as client:
        client.post("/v1/records", content=orjson.dumps([{**GOOD, "model": "llama"}, {**GOOD, "model": "x"}]))
        values = scrape(client)
    assert total(values, "kvlens_requests_total", model="llama") == 1
    assert total(values, "kvlens_requests_total", model="other") == 1


def test_bearer_token_is_required_when_set() -> None:
    app = create_app(load_settings(ingest_token="s3cret-token"), CollectorRegistry())
    with TestClient(app) as client:
        denied = client.post(
            "/v1/records", content=orjson.dumps(GOOD), headers={"authorization": "Bearer wrong"}
        )
        assert denied.status_code == 401
        assert "wrong" not in denied.text and "s3cret" not in denied.text
        assert client.post("/v1/records", content=orjson.dumps(GOOD)).status_code == 401
        ok = client.post(
            "/v1/records", content=orjson.dumps(GOOD), headers={"authorization": "Bearer s3cret-token"}
        )
        assert ok.status_code == 200


def test_metrics_content_negotiation(client: TestClient) -> None:
    plain = client.get("/metrics")
    assert plain.status_code == 200
    assert plain.headers["content-type"].startswith("text/plain; version=0.0.4")
    open_metrics = client.get("/metrics", headers={"accept": "application/openmetrics-text; version=1.0.0"})
    assert open_metrics.headers["content-type"].startswith("application/openmetrics-text")
    assert open_metrics.text.endswith("# EOF\n")


def test_metrics_is_a_route_not_a_redirect(client: TestClient) -> None:
    response = client.get("/metrics", follow_redirects=False)
    assert response.status_code == 200


def test_health_and_readiness(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").json() == {"status": "ready"}


def test_openapi_documents_the_record_schema(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    body = spec["paths"]["/v1/records"]["post"]["requestBody"]["content"]
    record = body["application/x-ndjson"]["schema"]
    assert record["required"] == ["prompt_tokens", "cached_tokens"]
    assert "description" in record["properties"]["cached_tokens"]


def test_article_end_to_end_in_process(client: TestClient) -> None:
    client.post("/v1/records", content=ndjson(article_records()))
    values = scrape(client)
    requests = total(values, "kvlens_requests_total")
    assert round(total(values, "kvlens_requests_total", cache="hit") / requests, 4) == 0.9
    assert (
        round(total(values, "kvlens_cached_tokens_total") / total(values, "kvlens_prompt_tokens_total"), 4)
        == 0.0154
    )
    work = total(values, "kvlens_reused_work_units_total") / total(values, "kvlens_prompt_work_units_total")
    assert round(work, 5) == 0.00344


def test_allow_listed_models_are_exported_at_zero_from_the_start() -> None:
    app = create_app(load_settings(models=["llama"]), CollectorRegistry())
    with TestClient(app) as client:
        values = scrape(client)
    assert values['kvlens_requests_total{"cache": "hit", "model": "llama", "prompt_len": "0-511"}'] == 0
    assert total(values, "kvlens_requests_total") == 0
    assert len([k for k in values if k.startswith("kvlens_requests_total")]) == 10  # 5 lengths x hit/miss
    assert not [k for k in values if k.startswith("kvlens_ttft_seconds")]  # histograms wait for data


def test_a_batch_retried_with_its_id_is_counted_once(client: TestClient) -> None:
    body = orjson.dumps([GOOD, GOOD])
    first = client.post("/v1/records", content=body, headers={"kvlens-batch-id": "b1", "kvlens-dropped": "7"})
    again = client.post("/v1/records", content=body, headers={"kvlens-batch-id": "b1", "kvlens-dropped": "7"})
    assert first.json()["accepted"] == again.json()["accepted"] == 2
    assert again.headers["kvlens-duplicate"] == "1"
    client.post("/v1/records", content=body, headers={"kvlens-batch-id": "b2"})
    values = scrape(client)
    assert total(values, "kvlens_requests_total") == 4
    assert values['kvlens_records_dropped_total{"source": "push"}'] == 7


def test_a_refused_batch_id_may_be_retried(client: TestClient) -> None:
    too_big = b"[" + b" " * 70_000 + b"]"
    assert client.post("/v1/records", content=too_big, headers={"kvlens-batch-id": "b3"}).status_code == 413
    retry = client.post("/v1/records", content=orjson.dumps([GOOD]), headers={"kvlens-batch-id": "b3"})
    assert retry.json()["accepted"] == 1


def test_the_ingest_answer_is_the_documented_model(client: TestClient) -> None:
    """The answer is written by orjson on the hot path; it stays what IngestResult documents."""
    from kvlens.exporter.app import IngestResult

    bad = {"prompt_tokens": 10, "cached_tokens": 20}
    response = client.post("/v1/records", content=ndjson([GOOD, bad, {"x": 1, **GOOD}]))
    assert response.status_code == 200
    expected = IngestResult.model_validate(response.json()).model_dump_json().encode()
    assert response.content == expected
    assert response.json()["rejected"][0]["index"] == 1
    assert response.json()["accepted"] == 2


def test_a_bug_on_the_ingest_path_is_a_500_that_quotes_nothing(
    client: TestClient, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """POST /v1/records skips FastAPI's layers; an exception still gets the 500 of the rest."""
    from kvlens.sources import push

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError(CANARY)

    monkeypatch.setattr(push, "read_records", broken)
    response = client.post("/v1/records", content=ndjson([GOOD]))
    assert (response.status_code, response.json()) == (500, {"error": "internal error"})
    assert CANARY not in caplog.text
    assert "RuntimeError in POST /v1/records" in caplog.text


def test_ingest_under_a_root_path_is_routed_as_before() -> None:
    app = create_app(load_settings(), CollectorRegistry())
    with TestClient(app, root_path="/kvlens") as client:
        response = client.post("/v1/records", content=ndjson([GOOD]))
        assert (response.status_code, response.json()["accepted"]) == (200, 1)
        assert client.get("/v1/records").status_code == 405
