"""KV events over real ZeroMQ sockets: a publisher that speaks vLLM's wire protocol (PUB + ROUTER
replay, tests/kv_publisher.py) and events encoded with vLLM's own struct definitions; first into
the subscriptions' thread in process, then into a real ``kvlens serve --kv-events`` read back
from its /metrics."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest

from kvlens.fleet.causes import EVICTED_HERE, HELD_ELSEWHERE, NEW
from kvlens.fleet.index import FleetIndex
from kvlens.fleet.ordering import Publisher
from kvlens.fleet.schema import KVEventBatch
from kvlens.fleet.simulated import SimulatedEngine
from kvlens.fleet.subscriber import KVEvents
from kvlens.simulate.run import Fleet, simulate
from kvlens.simulate.trace import BUNDLED, MOONCAKE, Trace
from tests import vllm_kv_events as vllm
from tests.kv_publisher import TestPublisher
from tests.live import free_port, start_kvlens, total, until

pytestmark = pytest.mark.integration
FIRST, SECOND = [1, 2, 3, 4], [5, 6, 7, 8]


def stored(hashes: list[int], parent: int | None, tokens: list[int]) -> bytes:
    event = vllm.BlockStored(hashes, parent, tokens, 4, None, "GPU", None)
    return vllm.encode(vllm.KVEventBatch(ts=1.0, events=[event], data_parallel_rank=0))


def removed(hashes: list[int]) -> bytes:
    return vllm.encode(
        vllm.KVEventBatch(ts=1.0, events=[vllm.BlockRemoved(hashes, "GPU")], data_parallel_rank=0)
    )


@pytest.fixture
def publishers() -> Iterator[tuple[TestPublisher, TestPublisher]]:
    a = TestPublisher(free_port(), replay_port=free_port())
    b = TestPublisher(free_port())
    yield a, b
    a.close()
    b.close()


def test_two_replicas_gaps_replays_and_a_restart_in_process(
    publishers: tuple[TestPublisher, TestPublisher],
) -> None:
    a, b = publishers
    kv = KVEvents(
        [Publisher("a", a.endpoint, a.replay_endpoint), Publisher("b", b.endpoint)],
        FleetIndex(),
    )
    kv.start()
    try:
        a.wait_subscribed()
        b.wait_subscribed()
        until(lambda: all(s.up for s in kv.consumer.status.values()))
        a.publish(stored([101, 102], None, FIRST + SECOND))  # seq 0
        until(lambda: kv.consumer.status["a"].batches == 1)  # publishers are not ordered among them
        b.publish(stored([201], None, FIRST))  # held by a: held_elsewhere
        a.drop(removed([102]))  # seq 1, lost on the way
        a.publish(stored([102], 101, SECOND))  # seq 2: the gap is repaired first
        b.publish(b"\xc1 not msgpack")
        b.drop(stored([202], 201, SECOND))  # no replay endpoint on b: missed
        b.publish(stored([203], 202, [9, 9, 9, 9]))
        until(lambda: kv.consumer.status["b"].batches == 3 and kv.consumer.status["a"].batches == 3)
        snapshot = kv.snapshot()
        sa, sb = snapshot.publishers["a"], snapshot.publishers["b"]
        assert (sa.gaps, sa.replays, sa.replayed, sa.missed) == (1, 1, 1, 0)
        assert (sb.gaps, sb.replays, sb.missed, sb.malformed_payloads) == (1, 0, 1, 1)
        index = snapshot.index
        assert index.recomputed_blocks == {
            ("a", NEW): 2,
            ("b", HELD_ELSEWHERE): 1,
            ("a", EVICTED_HERE): 1,
            ("b", "unknown"): 1,  # 203's parent 202 was lost with b's gap
        }
        a.restart()
        a.publish(stored([102], None, SECOND))  # seq 0 again: a's blocks (101, 102) are gone
        until(lambda: kv.consumer.status["a"].restarts == 1)
        after = kv.snapshot().index
        assert (after.held[("a", "GPU")], after.removed[("a", "GPU")]) == (1, 3)
        # SECOND as a first block is content a held before the restart (its 102 was 101's child)
        assert kv.index.recomputed["a", NEW] == 3
    finally:
        kv.stop()
    assert kv.source is not None and kv.source.errors == 0


def test_serve_exports_the_causes_and_the_publishers_health(
    publishers: tuple[TestPublisher, TestPublisher],
) -> None:
    a, b = publishers
    config = [
        {"name": "a", "endpoint": a.endpoint, "replay_endpoint": a.replay_endpoint},
        {"name": "b", "endpoint": b.endpoint},
    ]
    kvlens = start_kvlens("serve", env={"KVLENS_KV_EVENTS": json.dumps(config)})
    try:
        a.wait_subscribed()
        b.wait_subscribed()
        assert kvlens.wait_for("kvlens_kv_publisher_up", 2) == 2
        batches = "kvlens_kv_event_batches_total"
        a.publish(stored([101, 102], None, FIRST + SECOND))
        assert kvlens.wait_for(batches, 1, replica="a") == 1  # publishers are not ordered among them
        b.publish(stored([201, 202], None, FIRST + SECOND))
        assert kvlens.wait_for(batches, 1, replica="b") == 1
        a.drop(removed([101, 102]))
        a.publish(stored([103], None, FIRST))
        name = "kvlens_kv_recomputed_tokens_total"
        assert kvlens.wait_for(batches, 4) == 4
        assert kvlens.value(name, replica="a", cause=NEW) == 8
        assert kvlens.value(name, replica="b", cause=HELD_ELSEWHERE) == 8
        assert kvlens.value(name, replica="a", cause=HELD_ELSEWHERE) == 4  # b holds it, a evicted it
        assert kvlens.value("kvlens_kv_replayed_batches_total", replica="a") == 1
        assert kvlens.value("kvlens_kv_blocks_held", replica="a") == 1
        assert kvlens.value("kvlens_kv_fleet_blocks", kind="distinct") == 2
        assert kvlens.value("kvlens_kv_fleet_blocks", kind="duplicated") == 1
        assert kvlens.value("kvlens_collector_errors_total") == 0
        rejected = {
            labels: value
            for (name, labels), value in kvlens.samples().items()
            if name == "kvlens_kv_events_rejected_total" and ("replica", "a") in labels
        }
        assert sorted(dict(labels)["reason"] for labels in rejected) == sorted(
            [
                "malformed_payload",
                "malformed_event",
                "unknown_event",
                "unknown_field",
                "other_group",
                "replica_limit",
                "bad_timestamp",
                "error",
            ]
        )
        assert sum(rejected.values()) == 0
    finally:
        out = kvlens.output()
    assert "Traceback" not in out


def test_shards_sum_to_the_whole_over_real_processes() -> None:
    """The simulated fleet's events (4 replicas of 1500 blocks, round robin, the first 800
    requests of the bundled trace; batches 100 us apart by their ``ts``) from 4 publishers to
    three ``kvlens serve``: one whole, and ``--kv-events-shard 0/2`` and ``1/2``. Each process
    applies the publishers' batches in ``ts`` order (the reorder window), so every cause of
    every replica sums exactly."""
    requests = list(Trace(str(BUNDLED), MOONCAKE, 512).requests())[:800]
    encode = msgspec.msgpack.Encoder().encode
    batches: list[tuple[int, bytes]] = []

    def emit(replica: str, event: Any) -> None:
        batch = KVEventBatch(ts=1e9 + len(batches) * 1e-4, events=[event], data_parallel_rank=0)
        batches.append((int(replica[1:]), encode(batch)))

    engines = [SimulatedEngine(f"r{i}", 16, emit) for i in range(4)]
    simulate(requests, Fleet(4, 1500, 512), "round_robin", events=lambda i: engines[i])
    publishers = [TestPublisher(free_port()) for _ in range(4)]
    flags = [arg for i, p in enumerate(publishers) for arg in ("--kv-events", f"r{i}={p.endpoint}")]
    processes = []
    try:
        for shard in ((), ("--kv-events-shard", "0/2"), ("--kv-events-shard", "1/2")):
            processes.append(start_kvlens("serve", *flags, *shard))
        for publisher in publishers:
            for _ in processes:
                publisher.wait_subscribed()
        for replica, payload in batches:
            publishers[replica].publish(payload)
        for process in processes:
            assert process.wait_for("kvlens_kv_event_batches_total", len(batches), timeout=60) == len(batches)
        whole, *shards = (process.samples() for process in processes)
        name = "kvlens_kv_recomputed_tokens_total"
        for replica in ("r0", "r1", "r2", "r3"):
            for cause in ("new", "evicted_here", "held_elsewhere", "evicted_elsewhere"):
                labels = {"replica": replica, "cause": cause}
                assert sum(total(shard, name, **labels) for shard in shards) == total(
                    whole, name, **labels
                ), labels
        assert total(whole, name, cause="held_elsewhere") > 0
        assert all(0 < total(shard, name) < total(whole, name) for shard in shards)
        # the work too: each block's depth chains from its parent, whatever the parent's shard
        work = "kvlens_kv_recomputed_work_total"
        for cause in ("new", "evicted_here", "held_elsewhere", "evicted_elsewhere"):
            assert sum(total(shard, work, cause=cause) for shard in shards) == pytest.approx(
                total(whole, work, cause=cause), rel=1e-12
            ), cause
        assert total(whole, "kvlens_kv_depth_unknown_tokens_total") == 0
        for family in (
            "kvlens_kv_blocks_stored_total",
            "kvlens_kv_blocks_removed_total",
            "kvlens_kv_blocks_held",
        ):
            assert sum(total(shard, family) for shard in shards) == total(whole, family), family
    finally:
        for process in processes:
            process.output()
        for publisher in publishers:
            publisher.close()


def test_a_simulated_fleet_publishes_its_kv_events_to_kvlens_serve() -> None:
    """The whole chain on a laptop: `kvlens simulate serve --kv-events` (two replicas, round robin)
    publishes in vLLM's wire format; `kvlens serve --kv-events` follows both and says why blocks
    were computed. The same 64-token prompt twice: replica 0 computes 4 new blocks, then replica 1
    computes the 4 blocks replica 0 holds (routing)."""
    first = free_port()
    while any(_taken(first + i) for i in range(2)):
        first = free_port()
    fleet = start_kvlens(
        "simulate",
        "serve",
        "--replicas",
        "2",
        "--capacity-blocks",
        "unbounded",
        "--speed",
        "1000",
        "--kv-events",
        f"tcp://127.0.0.1:{first}",
        ready="/health",
    )
    flags = ["--kv-events", f"r0=tcp://127.0.0.1:{first}", "--kv-events", f"r1=tcp://127.0.0.1:{first + 1}"]
    kvlens = start_kvlens("serve", *flags)
    try:
        assert kvlens.wait_for("kvlens_kv_publisher_up", 2) == 2
        prompt = list(range(1000, 1064))
        for _ in range(2):
            answer = httpx.post(
                f"{fleet.url}/v1/completions", json={"model": "simulated", "prompt": prompt, "max_tokens": 1}
            )
            assert answer.status_code == 200
        name = "kvlens_kv_recomputed_tokens_total"
        assert kvlens.wait_for("kvlens_kv_blocks_stored_total", 8) == 8
        assert kvlens.value(name, replica="r0", cause=NEW) == 64
        assert kvlens.value(name, replica="r1", cause=HELD_ELSEWHERE) == 64
        assert kvlens.value(name) == 128
    finally:
        kvlens.output()
        fleet.output()


def _taken(port: int) -> bool:
    import socket

    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def test_serve_finds_its_publishers_by_dns() -> None:
    """``kvlens serve --kv-events-dns localhost:PORT/REPLAY_PORT``: the real resolver gives
    127.0.0.1 (this machine's localhost), a replica named by its address, whose gap is repaired
    from the replay port; its events are classified as any."""
    port, replay_port = free_port(), free_port()
    with TestPublisher(port, replay_port=replay_port) as publisher:
        kvlens = start_kvlens("serve", "--kv-events-dns", f"localhost:{port}/{replay_port}")
        try:
            publisher.wait_subscribed()
            replica = f"127.0.0.1:{port}"
            assert kvlens.wait_for("kvlens_kv_publisher_up", 1, replica=replica) == 1
            publisher.publish(stored([101], None, FIRST))  # seq 0
            assert kvlens.wait_for("kvlens_kv_event_batches_total", 1, replica=replica) == 1
            publisher.drop(stored([102], 101, SECOND))  # seq 1 lost on the way
            publisher.publish(stored([103], 102, [9, 9, 9, 9]))  # seq 2: the gap is repaired first
            assert kvlens.wait_for("kvlens_kv_event_batches_total", 3, replica=replica) == 3
            assert kvlens.value("kvlens_kv_recomputed_tokens_total", replica=replica, cause=NEW) == 12
            assert kvlens.value("kvlens_kv_replayed_batches_total", replica=replica) == 1
            assert kvlens.value("kvlens_kv_dns_replicas", service=f"localhost:{port}") == 1
            assert kvlens.value("kvlens_kv_dns_failures_total", service=f"localhost:{port}") == 0
        finally:
            out = kvlens.output()
    assert "Traceback" not in out
