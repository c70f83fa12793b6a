"""``prefix_hashes`` that are no prefix chain: an id repeated in one record (a cycle, as a block
whose parent is itself). A chained hash never repeats in a prompt, but a sender can send
anything: every reader of the chains must count the record once and answer 200."""

from __future__ import annotations

import httpx
import pytest

from kvlens.simulate.cache import PrefixCache
from tests.hostile.conftest import Serve
from tests.live import parse_samples, total

pytestmark = pytest.mark.timeout(120)


def test_a_cache_takes_a_chain_up_to_its_first_repeated_block() -> None:
    cache = PrefixCache(100)
    assert cache.acquire([1, 2, 3, 1, 2, 3], 5) == (0, 3)
    cache.release([1, 2, 3, 1, 2, 3], 3)
    assert cache.acquire([1, 2, 1], 5) == (2, 2)
    cache.release([1, 2, 1], 2)
    assert (cache.held(1), cache.held(2), cache.held(3)) == (0, 0, 0)
    assert cache.cached_prefix([1, 2, 3], 5) == 3


def test_a_record_whose_ids_repeat_is_counted_once_and_answered(serve: Serve) -> None:
    """Before: with the modelled caches on, a record of prefix_hashes [1, 2, 3, 1, 2, 3, ...]
    raised KeyError in the cache's release after the record had been counted: the sender got
    500 "internal error" and would retry a batch already counted."""
    kvlens = serve(KVLENS_MODELLED_CAPACITY_BLOCKS="4")
    record = {"request_id": "c", "replica": "a", "prompt_tokens": 96, "cached_tokens": 0, "block_size": 16}
    for ids in ([1, 2, 3] * 2, [7, 7], [5, 6, 5, 6, 5, 6]):
        answer = httpx.post(f"{kvlens.url}/v1/records", json=[record | {"prefix_hashes": ids}])
        assert (answer.status_code, answer.json().get("accepted")) == (200, 1)
    assert total(parse_samples(httpx.get(f"{kvlens.url}/metrics").text), "kvlens_requests_total") == 3
