"""A hybrid model's KV cache groups declared (``kv_events_group_kinds``), for events that name a
block's group but not its kind (vLLM 0.33's GPU pool); the events of vLLM's own pool are in
``test_kv_events_vllm_pool.py``."""

from __future__ import annotations

import pydantic
import pytest

from kvlens.fleet.groups import FOLLOW, MAX_GROUPS, OTHER, KVCacheGroups
from kvlens.fleet.settings import KVEventsSettings

WINDOW_FIRST = ["sliding_window", "full_attention"]


def test_declared_kinds_follow_the_full_attention_group_of_every_replica() -> None:
    groups = KVCacheGroups(WINDOW_FIRST)
    for replica in ("a", "b"):
        assert groups.is_hybrid(replica)
        assert groups.role(replica, 0, None, store=True) == OTHER
        assert groups.role(replica, 0, None, store=False) == OTHER  # the window's removals
        assert groups.role(replica, 1, None, store=True) == FOLLOW
        assert groups.role(replica, 1, None, store=False) == FOLLOW
        assert groups.role(replica, 2, None, store=False) == OTHER  # a group not declared


def test_a_store_naming_its_kind_overrides_the_declaration_for_its_replica_only() -> None:
    groups = KVCacheGroups(WINDOW_FIRST)
    assert groups.role("a", 0, "full_attention", store=True) == FOLLOW  # the engine's word wins
    assert groups.role("a", 1, None, store=True) == OTHER  # group 0 is now the lowest full attention
    assert groups.role("b", 1, None, store=True) == FOLLOW
    groups.forget("a")  # a replica gone: what it said goes, the declaration stays
    assert groups.role("a", 1, None, store=True) == FOLLOW


def test_one_declared_full_attention_group_is_no_hybrid_and_nothing_declared_is_as_before() -> None:
    assert not KVCacheGroups(["full_attention"]).is_hybrid("a")
    assert KVCacheGroups(["mamba"]).is_hybrid("a")
    groups = KVCacheGroups()
    assert not groups.is_hybrid("a")
    assert groups.role("a", 0, None, store=True) == FOLLOW
    assert groups.role("a", 1, None, store=True) == OTHER


def test_the_setting_is_bounded() -> None:
    assert KVEventsSettings(kv_events_group_kinds=WINDOW_FIRST).kv_events_group_kinds == WINDOW_FIRST
    for kinds in (["full_attention"] * (MAX_GROUPS + 1), [""], ["x" * 65]):
        with pytest.raises(pydantic.ValidationError, match="KV cache group kinds"):
            KVEventsSettings(kv_events_group_kinds=kinds)
    with pytest.raises(ValueError, match="at most 64"):
        KVCacheGroups(["full_attention"] * (MAX_GROUPS + 1))
