"""KV event payloads nested deeper than msgspec recurses, against a real ``kvlens serve
--kv-events``: msgspec raises RecursionError (not a DecodeError) on them, even while skipping
them as raw events; before, it went out of the handler as a kvlens bug (a traceback logged per
message, counted as ``error``). Now such a payload is a malformed payload, and the publisher's
next batch counts."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator

import pytest

from tests import vllm_kv_events as vllm
from tests.hostile.conftest import Serve
from tests.kv_publisher import TestPublisher
from tests.live import free_port

pytestmark = pytest.mark.integration
DEEP = b"\x91" * 200_000 + b"\xc0"  # [[[...[nil]...]]], 200,000 levels in 200 KB


@pytest.fixture
def publisher() -> Iterator[TestPublisher]:
    pub = TestPublisher(free_port())
    yield pub
    pub.close()


def test_a_deeply_nested_payload_or_event_is_malformed_not_a_failure(
    serve: Serve, publisher: TestPublisher
) -> None:
    sidecar = serve(KVLENS_KV_EVENTS=json.dumps([{"name": "r0", "endpoint": publisher.endpoint}]))
    publisher.wait_subscribed()
    stored = vllm.encode(vllm.BlockStored([1, 2], None, [0] * 32, 16, None, "GPU", None))
    ts = b"\xcb" + struct.pack(">d", 1.0)
    publisher.publish(b"\x93" + ts + b"\x92" + stored + DEEP + b"\x00")  # a good event, a deep one
    publisher.publish(b"\x93" + ts + b"\x91" + DEEP + b"\x00")
    publisher.publish(DEEP)  # not even a ts
    publisher.publish(b"\x93" + ts + b"\x91" + stored + b"\x00")
    assert sidecar.wait_for("kvlens_kv_event_batches_total", 4, replica="r0") == 4
    rejected = {
        reason: sidecar.value("kvlens_kv_events_rejected_total", replica="r0", reason=reason)
        for reason in ("malformed_payload", "malformed_event", "error")
    }
    assert rejected == {"malformed_payload": 3, "malformed_event": 0, "error": 0}
    assert sidecar.value("kvlens_kv_blocks_held", replica="r0") == 2
