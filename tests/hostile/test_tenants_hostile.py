"""The tenants' accounting against a sender of many tenants and long chains: a scrape never waits
for the cross-tenant check of a batch (the block storers, a pass per record)."""

from __future__ import annotations

import threading
from typing import Any

import orjson
import pytest

from kvlens.config import load_settings
from kvlens.exporter.aggregator import Aggregator
from kvlens.sources.push import read_records

pytestmark = pytest.mark.timeout(60)


def test_a_scrape_does_not_wait_for_the_cross_tenant_check() -> None:
    """Before: the block storers took a batch's chains under the lock a scrape's snapshot takes
    (an 8 MiB body of one-digit ids, 4M blocks, holds them about 3 s): /metrics waited as long."""
    aggregator = Aggregator(load_settings(tenant_remember_blocks=1_000))
    tenants = aggregator.tenants
    assert tenants.storers is not None
    records = [
        {
            "tenant": tenant,
            "prompt_tokens": 32,
            "cached_tokens": 16,
            "block_size": 16,
            "prefix_hashes": [1, 2],
        }
        for tenant in ("a", "b")
    ]
    batch = read_records(orjson.dumps(records), 50_000, keep_prefix_hashes=True)
    checking, release = threading.Event(), threading.Event()
    add = tenants.storers.add

    def held(*args: Any, **kwargs: Any) -> Any:
        checking.set()
        release.wait(30)
        return add(*args, **kwargs)

    tenants.storers.add = held  # type: ignore[method-assign]
    worker = threading.Thread(target=aggregator.add, args=(batch, "push"))
    worker.start()
    try:
        assert checking.wait(10)
        snapshots: list[Any] = []
        scrape = threading.Thread(target=lambda: snapshots.append(tenants.snapshot()))
        scrape.start()
        scrape.join(5)
        assert not scrape.is_alive(), "a scrape waited for the cross-tenant check"
    finally:
        release.set()
        worker.join(10)
    after = tenants.snapshot()
    assert (after.tenants, after.cross_tenant_tokens.tolist()) == (["a", "b"], [0, 16])
