"""One reader of a Prometheus exposition from an engine: kvlens.sources.vllm_metrics.families holds
its limits (no line past MAX_LINE_CHARS) and turns what prometheus_client cannot read into a
ScrapeError; the sidecar's scrape, the experiment's sampler and its block-size check read with it."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvlens.errors import ScrapeError
from kvlens.sources import vllm_metrics

PACKAGE = Path(vllm_metrics.__file__).parents[1]


def test_only_the_one_reader_calls_the_parser() -> None:
    callers = [
        str(path.relative_to(PACKAGE))
        for path in sorted(PACKAGE.rglob("*.py"))
        if "text_string_to_metric_families" in path.read_text()
    ]
    assert callers == ["sources/vllm_metrics.py"]


def test_the_reader_holds_the_limits() -> None:
    assert [family.name for family in vllm_metrics.families("# TYPE a gauge\na 1\n")] == ["a"]
    with pytest.raises(ScrapeError) as long:
        list(vllm_metrics.families("a 1\n" + "b" * (vllm_metrics.MAX_LINE_CHARS + 1)))
    with pytest.raises(ScrapeError) as bad:
        list(vllm_metrics.families("a{b=1} 1\n"))
    assert (long.value.reason, bad.value.reason) == ("too_large", "parse")
