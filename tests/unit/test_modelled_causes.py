"""The live modelled caches' limits: replicas past modelled_max_replicas, another block size and
records without a replica are left out and counted; the rest is ModelledFleet's result."""

from __future__ import annotations

import pytest

from kvlens.config import load_settings
from kvlens.errors import SettingsError
from kvlens.exporter.modelled import ModelledCauses
from kvlens.fleet.causes import HELD_ELSEWHERE, NEW
from kvlens.fleet.limits import MAX_REPLICAS
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


def test_the_replicas_modelled_are_capped_at_the_index_s_replicas() -> None:
    """The default is the index's 64 replica slots: the 65th replica's records are counted, not
    modelled (they used to reach the index, which raised out of the batch)."""
    settings = load_settings(None, modelled_capacity_blocks=8)
    assert settings.modelled_max_replicas == MAX_REPLICAS == 64
    modelled = ModelledCauses(8, 4, max_replicas=settings.modelled_max_replicas, remember_blocks=100)
    objects = [
        {"prompt_tokens": 9, "cached_tokens": 0, "replica": f"r{i}", "prefix_hashes": [1, 2]}
        for i in range(66)
    ]
    modelled.add(batch_from_objects(objects).batch)
    snapshot = modelled.snapshot()
    assert snapshot.records == {"modelled": 64, "no_replica": 0, "block_size": 0, "replicas": 2}
    assert snapshot.index.recomputed_tokens[("r63", HELD_ELSEWHERE)] == 8
    with pytest.raises(SettingsError, match=r"modelled_max_replicas: at most 64 \(one bit each"):
        load_settings(None, modelled_max_replicas=65)
    with pytest.raises(ValueError, match="max_replicas 65: the fleet index holds at most 64 replicas"):
        ModelledCauses(8, 4, max_replicas=65, remember_blocks=100)
