"""Cache salts read from KV events (vLLM 0.33's extra keys, SGLang's cache_salt), encoded with the
engines' own struct definitions (tests/vllm_kv_events.py): with ``require_cache_salt`` the blocks of
a chain started without a salt are counted, the same by the compiled reader and by msgspec's."""

from __future__ import annotations

from typing import Any

import pytest

from kvlens.fleet.index import FleetIndex
from kvlens.fleet.ordering import Consumer, Publisher
from tests import vllm_kv_events as vllm

TS = 1764600000.25
FIRST = [128000, 128006, 9125, 128007]
SECOND = [65535, 65536, 0, 127]
SALT = "tenant-a-secret-salt"


class EventByEvent(FleetIndex):
    """Every payload through msgspec (as in test_kv_events_batched)."""

    def apply_payload(self, replica: str, payload: bytes) -> list[int] | None:
        return None


def stored(hashes: list[int], parent: int | None, tokens: list[int], **extra: Any) -> vllm.BlockStored:
    fields: dict[str, Any] = {"lora_name": None, "medium": "GPU", **extra}
    return vllm.BlockStored(
        hashes, parent, tokens, 4, None, fields.pop("medium"), fields.pop("lora_name"), **fields
    )


def batch(*events: Any) -> bytes:
    return vllm.encode(vllm.KVEventBatch(ts=TS, events=list(events), data_parallel_rank=0))


def payloads() -> list[bytes]:
    return [
        # unsalted chain starts: 2 blocks (compiled path), 1 with a LoRA adapter, 1 of SGLang
        batch(stored([1, 2], None, FIRST + SECOND)),
        batch(stored([3], None, FIRST, lora_name="ad", extra_keys=[("ad",)])),
        vllm.encode(
            vllm.SGLang2EventBatch(TS, [vllm.SGLang2BlockStored([4], None, SECOND, 4, None, "GPU")], 0)
        ),
        # not counted: a chain's later blocks, an offload copy, salted starts (vLLM's untagged
        # extra keys, with and without a LoRA name; SGLang's metadata map and its map field)
        batch(stored([5], 1, SECOND), stored([6], None, SECOND, medium="CPU")),
        batch(stored([7, 8], None, FIRST + SECOND, extra_keys=[(SALT,), None])),
        batch(stored([9], None, FIRST, lora_name="ad", extra_keys=[("ad", SALT)])),
        vllm.encode(
            vllm.SGLang2EventBatch(
                TS,
                [
                    vllm.SGLangSaltedStored(
                        [10],
                        None,
                        FIRST,
                        4,
                        None,
                        "GPU",
                        metadata=vllm.SGLangBlockStoredMetadata(cache_salt=SALT),
                    )
                ],
                0,
            )
        ),
        vllm.encode(
            vllm.MapEventBatch(ts=TS, events=[vllm.SGLangMapStored([11], None, SECOND, 4, cache_salt=SALT)])
        ),
        # a store whose token ids do not fill its blocks: malformed, not counted
        batch(stored([12], None, FIRST[:3])),
    ]


@pytest.mark.parametrize("index_class", [FleetIndex, EventByEvent], ids=["compiled", "msgspec"])
def test_blocks_of_chains_started_without_a_salt_are_counted(index_class: type[FleetIndex]) -> None:
    c = Consumer(index_class(require_cache_salt=True), [Publisher("a", "tcp://a:5557")])
    for seq, payload in enumerate(payloads()):
        c.message("a", seq, payload, None)
    snapshot = c.index.snapshot()
    assert snapshot.unsalted_blocks == {"a": 4}
    assert SALT not in repr(snapshot) and SALT not in repr(c.status)


def test_without_require_cache_salt_nothing_is_counted() -> None:
    c = Consumer(FleetIndex(), [Publisher("a", "tcp://a:5557")])
    for seq, payload in enumerate(payloads()):
        c.message("a", seq, payload, None)
    assert c.index.snapshot().unsalted_blocks == {}


def test_only_shard_zero_counts_so_that_shards_add_up() -> None:
    counts = []
    for shard in range(2):
        c = Consumer(FleetIndex(require_cache_salt=True, shard=(shard, 2)), [Publisher("a", "tcp://a:5557")])
        for seq, payload in enumerate(payloads()):
            c.message("a", seq, payload, None)
        counts.append(c.index.snapshot().unsalted_blocks)
    assert counts == [{"a": 4}, {}]


def test_the_count_is_exported_per_replica_with_require_cache_salt_only() -> None:
    from kvlens.exporter.collector import kv_families
    from kvlens.fleet.subscriber import KVEvents

    def exported(index: FleetIndex) -> dict[str, float]:
        events = KVEvents([Publisher("a", "tcp://a:1"), Publisher("b", "tcp://b:1")], index, in_process=True)
        for seq, payload in enumerate(payloads()):
            events.consumer.message("a", seq, payload, None)
        return {
            sample.labels["replica"]: sample.value
            for family in kv_families(events)
            for sample in family.samples
            if family.name == "kvlens_kv_unsalted_blocks_stored"
        }

    assert exported(FleetIndex(require_cache_salt=True)) == {"a": 4, "b": 0}
    assert exported(FleetIndex()) == {}


def test_serve_takes_require_cache_salt_as_a_flag_and_a_setting() -> None:
    from kvlens.cli import parser_of
    from kvlens.cli.common import settings_from

    def parsed(*argv: str) -> bool:
        return settings_from(parser_of(argv).parse_args(argv)).kv_events_require_cache_salt

    assert parsed("serve", "--require-cache-salt") is True
    assert parsed("serve") is False
