"""The live modelled caches' limits: replicas past modelled_max_replicas, another block size and
records without a replica are left out and counted; the rest is ModelledFleet's result."""

from __future__ import annotations

from kvlens.exporter.modelled import ModelledCauses
from kvlens.fleet.index import HELD_ELSEWHERE, NEW
from kvlens.records import batch_from_objects


def test_records_past_the_limits_are_counted_not_modelled() -> None:
    modelled = ModelledCauses(8, 4, max_replicas=2, remember_blocks=100)
    objects = [
        {"prompt_tokens": 9, "cached_tokens": 0, "replica": "a", "prefix_hashes": [1, 2]},
        {"prompt_tokens": 9, "cached_tokens": 0, "replica": "b", "prefix_hashes": [1, 2], "block_size": 4},
        {"prompt_tokens": 9, "cached_tokens": 0, "replica": "c", "prefix_hashes": [1, 2]},
        {"prompt_tokens": 9, "cached_tokens": 0, "replica": "a", "prefix_hashes": [1], "block_size": 16},
        {"prompt_tokens": 9, "cached_tokens": 0, "prefix_hashes": [1]},
        {"prompt_tokens": 9, "cached_tokens": 0, "replica": "a"},
    ]
    modelled.add(batch_from_objects(objects).batch)
    snapshot = modelled.snapshot()
    assert snapshot.records == {"modelled": 2, "no_replica": 1, "block_size": 1, "replicas": 1}
    assert snapshot.replicas == ["a", "b"]
    assert snapshot.index.recomputed_tokens == {("a", NEW): 8, ("b", HELD_ELSEWHERE): 8}
