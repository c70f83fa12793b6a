"""The fleet index against vLLM 0.33's own ``BlockPool``: the events its real code published, and
its own map of cached blocks after each batch (``tests/fixtures/vllm_pool/``, recorded by
``make_events.py`` from the vllm 0.33.0 wheel). After every batch, through the compiled reader
and through msgspec's, each replica holds in kvlens what its pool holds in its followed KV cache
group, physical copies included, and each stored block has the cause the pools' states give it:

- vLLM #55092: a fully cached prompt's last block recomputed into a second block of the same
  hash, then one copy evicted (``BlockRemoved`` of a hash another block still backs);
- a hybrid model's two KV cache groups, each announcing its blocks (``group_idx``) and evicting
  on its own (vLLM 0.33's pool sends no ``kv_cache_spec_kind``);
- two replicas under eviction pressure (every cause) and ``AllBlocksCleared``.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvlens.fleet.ordering import Consumer, Publisher
from tests.unit.test_kv_events_batched import Counting, EventByEvent  # the two readers

HERE = Path(__file__).parents[1] / "fixtures" / "vllm_pool"
RECORDED: dict[str, Any] = json.loads((HERE / "events.json").read_text())
SCENARIOS = sorted(name for name in RECORDED if name != "vllm")


def test_the_recording_is_vllm_0_33() -> None:
    assert RECORDED["vllm"] == {"version": "0.33.0", "commit": "g4ba787ec9"}
    assert SCENARIOS == ["duplicate_block", "evictions_and_clear", "hybrid_groups", "hybrid_window_first"]


@pytest.mark.parametrize("alike", [False, True], ids=["content_keys", "hashes_alike"])
@pytest.mark.parametrize("index", [Counting, EventByEvent], ids=["compiled", "msgspec"])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_index_holds_what_vllms_pool_holds_and_its_causes(
    scenario: str, index: type[Counting | EventByEvent], alike: bool
) -> None:
    recorded = RECORDED[scenario]
    names = [replica[0] for replica in recorded["replicas"]]
    # the groups' kinds as the engine names them (get_kv_cache_group_metadata()), since its events don't
    kinds = recorded["kinds"]
    followed = str(kinds.index("full_attention"))
    publishers = [Publisher(name, f"tcp://{name}:5557") for name in names]
    consumer = Consumer(index(hashes_alike=alike, group_kinds=kinds), publishers)
    seq = dict.fromkeys(names, 0)
    causes: Counter[tuple[str, str]] = Counter()
    every_hash: set[str] = set()
    for step in recorded["steps"]:
        replica = step["replica"]
        consumer.message(replica, seq[replica], base64.b64decode(step["payload"]), None)
        seq[replica] += 1
        causes.update((replica, cause) for cause in step["causes"].values())
        snapshot = consumer.index.snapshot()
        for name in names:
            pool = step["pools"][name].get(followed, {})  # the full-attention group
            assert snapshot.held.get((name, "GPU"), 0) == sum(pool.values()), (step["step"], name)
            every_hash |= set(pool)
        assert dict(snapshot.recomputed_blocks) == dict(causes), step["step"]
        if alike:  # the engine hash is the fleet's key: each block's holders, one by one
            for block in every_hash:
                held_by = [name for name in names if block in step["pools"][name].get(followed, {})]
                assert consumer.index.holders(int(block)) == held_by, (step["step"], block)
    status = consumer.status
    assert sum(s.malformed_events + s.unknown_events + s.unknown_fields for s in status.values()) == 0
    others = sum(
        1
        for step in recorded["steps"]
        for event in _events(step["payload"])
        if "group_idx" in event and str(event["group_idx"]) != followed
    )
    assert sum(s.other_group_events for s in status.values()) == others
    if isinstance(consumer.index, Counting) and len(kinds) == 1:
        # a model of one group: every payload read by the compiled reader, none left to msgspec
        assert consumer.index.read == len(recorded["steps"])


def _events(payload: str) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = msgspec.msgpack.decode(base64.b64decode(payload))[1]
    return events


def test_the_scenarios_reach_what_they_are_for() -> None:
    """The recording holds the cases it was made for, so a re-recording cannot lose them."""
    duplicate = RECORDED["duplicate_block"]["steps"]
    # a removal of a hash the pool still backs with another block (#55092)
    backed = [
        event
        for before, step in itertools.pairwise(duplicate)
        for event in _events(step["payload"])
        if event["type"] == "BlockRemoved"
        and before["pools"]["a"]["0"].get(str(event["block_hashes"][0]), 0) > 1
        and str(event["block_hashes"][0]) in step["pools"]["a"]["0"]
    ]
    assert len(backed) == 1
    for name, window in (("hybrid_groups", "1"), ("hybrid_window_first", "0")):
        full = str(RECORDED[name]["kinds"].index("full_attention"))
        pools = [step["pools"]["a"] for step in RECORDED[name]["steps"]]
        # the window's group evicted what full attention holds
        assert any(set(pool[full]) - set(pool[window]) for pool in pools)
        assert all(
            "kv_cache_spec_kind" not in e for s in RECORDED[name]["steps"] for e in _events(s["payload"])
        )
    clear = RECORDED["evictions_and_clear"]["steps"]
    assert {cause for step in clear for cause in step["causes"].values()} == {
        "new",
        "held_elsewhere",
        "evicted_here",
        "evicted_elsewhere",
    }
    assert [e["type"] for e in _events(clear[-2]["payload"])] == ["AllBlocksCleared"]


@pytest.mark.skipif(
    not os.environ.get("KVLENS_VLLM_WHEEL"), reason="KVLENS_VLLM_WHEEL: an unpacked vllm 0.33.0 wheel"
)
@pytest.mark.timeout(60)
def test_vllms_pool_records_the_same_again() -> None:
    """Against the wheel itself (see make_events.py for how to get it): its pool, run again, gives
    the recording byte for byte (the hashes are sha256 with vLLM's fixed seed: reproducible)."""
    wheel = os.environ["KVLENS_VLLM_WHEEL"]
    done = subprocess.run(
        [sys.executable, str(HERE / "make_events.py"), wheel, "--stdout"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert done.stdout == (HERE / "events.json").read_text()
