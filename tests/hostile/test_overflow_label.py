"""Defect 4: a record whose model is literally ``other`` must not duplicate the overflow series.

Requirement (reliability.md 5.6): every (name, labels) pair unique; the page passes the strict
OpenMetrics parser and promtool in both content types.
"""

from __future__ import annotations

import subprocess
from collections import Counter

import httpx
import orjson
import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families

from tests.hostile.conftest import Serve

pytestmark = pytest.mark.integration
OPENMETRICS = {"accept": "application/openmetrics-text; version=1.0.0"}


def test_a_model_named_other_never_duplicates_the_overflow_series(serve: Serve, promtool: str) -> None:
    sidecar = serve()
    record = {"prompt_tokens": 100, "cached_tokens": 10, "ttft_seconds": 0.1}
    models = ["other"] + [f"model-{i}" for i in range(51)]
    body = orjson.dumps([{**record, "model": model} for model in models])
    assert httpx.post(f"{sidecar.url}/v1/records", content=body).json()["accepted"] == 52

    text = httpx.get(f"{sidecar.url}/metrics").text
    series = Counter(
        (sample.name, tuple(sorted(sample.labels.items())))
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    )
    assert [key for key, count in series.items() if count > 1] == []
    checked = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    list(parse_openmetrics(httpx.get(f"{sidecar.url}/metrics", headers=OPENMETRICS).text))

    requests = sidecar.samples()
    assert sum(v for (name, _), v in requests.items() if name == "kvlens_requests_total") == 52
    # the record named "other" and the one model past the cap share the overflow label
    assert sidecar.value("kvlens_requests_total", model="other") == 2
