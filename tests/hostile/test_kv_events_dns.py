"""KV events DNS discovery facing a resolver that answers a big fleet, over real ZeroMQ sockets:
every address it may answer (up to MAX_DISCOVERED) is subscribed, and running out of sockets or
open files leaves the others followed instead of ending the subscriptions. The lookups are
injected (a real resolver cannot be made to answer 1,024 loopback addresses without root); the
sockets, the publisher and, for the open-files limit, the process are real."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvlens.fleet.discovery import MAX_DISCOVERED, DnsTarget
from kvlens.fleet.index import FleetIndex
from kvlens.fleet.publisher import EventPublisher
from kvlens.fleet.settings import parse_dns_target
from kvlens.fleet.subscriber import FILES_KEPT_FREE, FILES_PER_SUBSCRIPTION, KVEvents
from kvlens.http.server import raise_open_files_limit
from tests import vllm_kv_events as vllm
from tests.kv_publisher import TestPublisher
from tests.live import free_port, until
from tests.unit.test_kv_events_dns import stored

pytestmark = pytest.mark.integration


def loopback(count: int) -> list[str]:
    """``count`` loopback addresses, 127.0.0.1 first (nothing listens on the others)."""
    return [f"127.0.{i // 250}.{i % 250 + 1}" for i in range(count)]


def test_an_answer_of_the_most_addresses_allowed_is_followed_whole() -> None:
    """1,024 addresses (the documented most per name). Before: ZeroMQ's default of 1,023 sockets
    a context (3 per subscription) ran out at the 342nd, the exception ended the subscriptions'
    thread, and no batch of any replica was counted again (with ``errors`` still 0)."""
    raise_open_files_limit()  # as kvlens serve does at start (a soft limit of 1,024 is common)
    port = free_port()
    publisher = EventPublisher(f"tcp://127.0.0.1:{port}")
    addresses = loopback(MAX_DISCOVERED)
    events = KVEvents([], FleetIndex(hashes_alike=True), dns=[DnsTarget("fleet", port, lambda *_: addresses)])
    status = events.consumer.status
    events.start()
    source = events.source
    assert source is not None
    first = f"127.0.0.1:{port}"
    try:
        publisher.wait_subscribed()
        until(lambda: first in status and status[first].up == 1, timeout=30)
        publisher.publish_events([stored(1)])
        until(lambda: status[first].batches == 1, timeout=30)
        assert events.snapshot().dns == {f"fleet:{port}": (MAX_DISCOVERED, 0)}
        assert len(status) == MAX_DISCOVERED
        assert source.errors == 0
        assert sum(s.errors for s in status.values()) == 0
    finally:
        events.stop()
        publisher.close()


CHILD = """
import json, logging, resource, sys, time
from kvlens.fleet import schema
from kvlens.http.server import raise_open_files_limit
from kvlens.fleet.index import FleetIndex
from kvlens.fleet.publisher import EventPublisher
from kvlens.fleet.discovery import DnsTarget
from kvlens.fleet.subscriber import KVEvents

port, count, files = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
logging.basicConfig(level=logging.INFO)
addresses = [f"127.0.{i // 250}.{i % 250 + 1}" for i in range(count)]
publisher = EventPublisher(f"tcp://127.0.0.1:{port}")
resource.setrlimit(resource.RLIMIT_NOFILE, (files, files))
events = KVEvents([], FleetIndex(hashes_alike=True), dns=[DnsTarget("fleet", port, lambda *_: addresses)])
events.start()
publisher.wait_subscribed()
name = f"127.0.0.1:{port}"
deadline = time.monotonic() + 30
status = events.consumer.status
# a batch sent before the subscription's handshake is lost (PUB/SUB): send until one is counted
while not (name in status and status[name].batches) and time.monotonic() < deadline:
    publisher.publish_events([schema.BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[1] * 4,
                                               block_size=4, lora_id=None, medium="GPU", lora_name=None)])
    time.sleep(0.05)
source = events.source
result = {
    "counted": name in status and status[name].batches >= 1,
    "alive": source._thread.is_alive(),
    "errors": source.errors,
    "refused": sum(s.errors for s in status.values()),
}
events.stop()
publisher.close()
print(json.dumps(result))
"""


def test_running_out_of_open_files_leaves_the_subscriptions_running() -> None:
    """A process allowed 2,048 open files (room for 256 subscriptions), a DNS answer of 1,024
    addresses: the subscriptions that cannot be made are counted as errors of their replica and
    logged once, and tried again at the next lookup; the ones made keep being followed. Before:
    the first failed subscription ended the subscriptions' thread (a fleet larger than the
    open-files limit allows lost every event), and the subscriptions took every file."""
    port = free_port()
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(port), str(MAX_DISCOVERED), "2048"],
        capture_output=True,
        text=True,
        timeout=90,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["alive"] is True
    assert result["counted"] is True
    subscribed = (2048 - FILES_KEPT_FREE) // FILES_PER_SUBSCRIPTION
    assert result["refused"] == result["errors"] == MAX_DISCOVERED - subscribed
    assert done.stderr.count("could not be subscribed") == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr


def test_an_ipv6_replica_s_gap_is_repaired_from_its_replay_endpoint() -> None:
    """``--kv-events-dns [::1]:PORT/REPLAY_PORT``: a batch the publisher drops is replayed.
    Before: the brackets stayed in the name, which never resolved (counted as failed lookups for
    good); and the replay's DEALER socket was not IPv6-enabled, so libzmq never connected it to
    ``tcp://[::1]:PORT``: every gap waited out the 2 s replay timeout and was counted missed."""
    port, replay_port = free_port(), free_port()
    publisher = TestPublisher(port, replay_port, host="[::1]")
    # as an operator writes it, and looked up by the real resolver
    host, _, replay = parse_dns_target(f"[::1]:{port}/{replay_port}")
    events = KVEvents([], FleetIndex(hashes_alike=True), dns=[DnsTarget(host, port, replay_port=replay)])
    status = events.consumer.status
    name = f"[::1]:{port}"
    events.start()
    try:
        publisher.wait_subscribed()
        until(lambda: name in status and status[name].up == 1, timeout=30)
        publisher.publish_events([stored(1)])
        until(lambda: status[name].batches == 1, timeout=30)
        publisher.drop(publisher._encode(vllm.KVEventBatch(ts=2.0, events=[])))
        publisher.publish_events([stored(3)])
        until(lambda: status[name].batches == 3 or status[name].missed > 0, timeout=30)
        assert (status[name].gaps, status[name].replays, status[name].replayed, status[name].missed) == (
            1,
            1,
            1,
            0,
        )
    finally:
        events.stop()
        publisher.close()
