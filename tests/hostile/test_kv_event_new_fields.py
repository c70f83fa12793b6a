"""The KV events' newer fields (a hybrid model's group and kind, sessions, salts in extra keys or
in SGLang's metadata map, remaining copy counts) of any msgpack type, through both readers (the
compiled one, and msgspec's, which a hybrid replica's payloads take): never an exception out of
the consumer, every event counted. Pinned: no defect found in this review."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from kvlens.fleet.index import FleetIndex
from kvlens.fleet.ordering import Consumer, PublisherStatus

pytestmark = pytest.mark.timeout(120)
encode = msgspec.msgpack.Encoder().encode
VALUES: list[Any] = [
    True,
    -1,
    2**64 - 1,
    -(2**63),
    1.5,
    float("nan"),
    "",
    "x" * 70_000,
    b"\x00",
    [],
    [[1]],
    {},
    {"cache_salt": {"x": [1]}},
    [[None]],
    [[[[[[1]]]]]],
    [{"a": 1}],
    msgspec.msgpack.Ext(1, b"x"),
]
STORED = {
    "type": "BlockStored",
    "block_hashes": [11, 12],
    "parent_block_hash": None,
    "token_ids": list(range(32)),
    "block_size": 16,
    "lora_id": None,
    "medium": "GPU",
    "lora_name": None,
}
REMOVED = {"type": "BlockRemoved", "block_hashes": [11, 12], "medium": "GPU"}
FIELDS = (
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "session_id",
    "cache_salt",
    "lora_name",
    "lookahead_token_ids",
    "remaining_copy_counts",
)


@pytest.mark.parametrize("hybrid", [False, True], ids=["compiled first", "msgspec"])
@pytest.mark.parametrize("name", FIELDS)
def test_any_value_of_a_new_field_is_counted_never_raised(name: str, hybrid: bool) -> None:
    for value in VALUES:
        consumer = Consumer(FleetIndex(sessions=4), [])
        if hybrid:
            consumer.index.groups.hybrid.add("r")
        status = PublisherStatus()
        event = (REMOVED if name == "remaining_copy_counts" else STORED) | {name: value}
        salted_array = ["BlockStored", [13], None, list(range(16)), 16, None, "GPU", value]
        consumer._apply("r", status, encode([1.0, [event, salted_array], None]))
        # an event is counted received, and also malformed or another group's when it is
        counted = sum(status.events.values()) + status.malformed_events + status.unknown_events
        assert counted >= 2 and status.malformed_payloads == 0, (value, status)
