"""A KV event publisher whose batch timestamps are absurd (not a number, far ahead of kvlens's
clock), beside an honest publisher that sends steadily, against a real ``kvlens serve
--kv-events`` with its default reorder window (0.25 s). The honest replica's batches are applied
while it sends, each within the window (plus a poll) of its arrival.

Before: a batch stamped NaN sat at the top of the reorder heap for good (it is never "older than
the newest by the window"), and while the honest publisher kept kvlens busy nothing behind it was
applied: 0 of the honest batches until the sending stopped (the issue: 0 of 986 in 20 s)."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator

import pytest

from tests import vllm_kv_events as vllm
from tests.hostile.conftest import Serve
from tests.kv_publisher import TestPublisher
from tests.live import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
HONEST_BATCHES = 200


@pytest.fixture
def publishers() -> Iterator[tuple[TestPublisher, TestPublisher]]:
    bad, honest = TestPublisher(free_port()), TestPublisher(free_port())
    yield bad, honest
    bad.close()
    honest.close()


def stamped(ts: float, block: int) -> bytes:
    event = vllm.BlockStored([block], None, [block % 1000], 1, None, "GPU", None)
    return vllm.encode(vllm.KVEventBatch(ts=ts, events=[event], data_parallel_rank=0))


# named, not given as values: an hour ahead is read off the clock when the test runs (a value
# computed at collection differs between pytest-xdist's workers, which must collect alike)
@pytest.mark.parametrize("absurd_name", ["nan", "an_hour_ahead"])
def test_an_absurd_timestamp_never_stalls_another_replica(
    serve: Serve, publishers: tuple[TestPublisher, TestPublisher], absurd_name: str
) -> None:
    absurd = math.nan if absurd_name == "nan" else time.time() + 3600.0
    bad, honest = publishers
    config = [{"name": name, "endpoint": p.endpoint} for name, p in (("bad", bad), ("honest", honest))]
    sidecar = serve(KVLENS_KV_EVENTS=json.dumps(config))
    bad.wait_subscribed()
    honest.wait_subscribed()
    honest.publish(stamped(time.time(), 1))
    assert sidecar.wait_for("kvlens_kv_event_batches_total", 1, replica="honest") == 1
    bad.publish(stamped(absurd, 2))
    # the honest replica sends a batch every 20 ms (kvlens is never idle for its 100 ms poll)
    # and, half way, how many of its batches kvlens has applied is read
    applied_half_way = 0.0
    for block in range(3, HONEST_BATCHES + 3):
        honest.publish(stamped(time.time(), block))
        if block == HONEST_BATCHES // 2:
            applied_half_way = sidecar.value("kvlens_kv_event_batches_total", replica="honest")
        time.sleep(0.02)  # the honest publisher's pace, not a wait for kvlens
    sent = HONEST_BATCHES + 1
    applied_while_sending = sidecar.value("kvlens_kv_event_batches_total", replica="honest")
    print(f"honest batches applied half way {applied_half_way:.0f}, at the end {applied_while_sending:.0f}")
    # all but the last window's (0.25 s, some 13 batches, and a scrape's time) were applied
    assert applied_while_sending >= sent - 50
    assert applied_half_way >= HONEST_BATCHES // 2 - 50
    assert sidecar.wait_for("kvlens_kv_event_batches_total", sent, replica="honest") == sent
    assert sidecar.value("kvlens_kv_events_rejected_total", replica="bad", reason="bad_timestamp") == 1
    assert sidecar.value("kvlens_kv_event_batches_total", replica="bad") == 1  # its events used
    assert sidecar.value("kvlens_kv_blocks_stored_total", replica="bad") == 1
